import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from analysis_cases import HAND, random_stack  # noqa: E402
from tgattn import builders  # noqa: E402
from tgattn.analysis import top_influencers  # noqa: E402
from tgattn.analysis.plots import plot_attention, plot_graph, plot_influencers, plot_pattern  # noqa: E402

TOKENS = ["The", "sky", "is", "blue"]


def test_plot_pattern_draws_the_mask():
    fig = plot_pattern(builders.causal(4), tokens=TOKENS)
    assert isinstance(fig, Figure)
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("key j", "query i")
    assert ax.get_title() == "pattern: 10 edges of 16 (62.5%)"
    assert [t.get_text() for t in ax.get_yticklabels()] == TOKENS
    assert (ax.images[0].get_array() == builders.to_mask(builders.causal(4)).numpy()).all()


def test_plot_attention_shows_weights_and_blanks():
    (layer,), (dense,) = random_stack([builders.window(4, 1)], 4, heads=2)
    fig = plot_attention(*layer, tokens=TOKENS, head=1)
    ax, colorbar = fig.axes
    assert ax.get_title() == "attention (head 1)" and colorbar.get_ylabel() == "weight (log scale)"
    image = ax.images[0].get_array()  # masked where there is no edge
    assert image.mask[0, 3] and not image.mask[0, 1]
    assert image[2, 1] == pytest.approx(float(dense[1, 2, 1]), abs=1e-12)


def test_plot_graph_keeps_top_k_edges_with_widths_by_weight():
    ei, alpha = HAND[0]  # A1 = [[1, 0, 0], [.5, .5, 0], [.5, .25, .25]]
    fig = plot_graph(ei, alpha, tokens=["a", "b", "c"], top_k=2)
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.texts] == ["a", "b", "c"]
    assert "top 2 keys per query" in ax.get_title()
    # Query 0: one edge (weight 1); query 1: two edges of .5; query 2: (0,2) .5 and, of the
    # tied .25 edges, the smaller key 1. Widths are 4 * weight / 1.
    widths = sorted(p.get_linewidth() for p in ax.patches)
    assert widths == pytest.approx([1.0, 2.0, 2.0, 2.0, 4.0])


def test_plot_influencers_bars_equal_scores():
    ranked = top_influencers(2, 3, HAND, method="rollout")
    fig = plot_influencers(ranked, tokens=["a", "b", "c"], query=2)
    (ax,) = fig.axes
    assert [p.get_height() for p in ax.patches] == pytest.approx([0.46875, 0.28125, 0.25])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["c\n#2", "b\n#1", "a\n#0"]
    assert ax.get_ylabel() == "rollout" and ax.get_title() == "top influencers of token 2 'c'"


def test_plots_draw_on_given_axes():
    fig = Figure()
    left, right = fig.subplots(1, 2)
    assert plot_pattern(builders.full(3), ax=left) is fig
    assert plot_influencers(top_influencers(0, 1, HAND[0]), ax=right, method="attention") is fig
    assert right.get_ylabel() == "attention" and len(right.patches) == 1


def test_a_long_texts_heatmap_shows_the_querys_neighbourhood_on_a_log_scale():
    n = 300
    (layer,), (dense,) = random_stack([builders.causal(n)], n, heads=2)
    fig = plot_attention(*layer, query=250, around=40)
    ax = fig.axes[0]
    assert ax.get_title() == "attention (mean over heads)\ntokens 230-269 of 300, centred on #250"
    image = ax.images[0]
    expected = dense.mean(0)[230:270, 230:270]  # [40, 40]
    got = image.get_array()
    assert got.shape == (40, 40) and (got.mask.numpy() if hasattr(got.mask, "numpy") else got.mask).tolist() == \
        (expected == 0).tolist()  # causal: blank above the diagonal
    assert abs(got.filled(0) - expected.numpy()).max() <= 1e-12
    # the colours span the weights drawn: the largest is the top of a log scale
    assert image.norm.vmax == pytest.approx(float(expected.max())) and type(image.norm).__name__ == "LogNorm"
    assert ax.get_xlim() == (229.5, 269.5)  # axes count tokens of the whole text
    linear = plot_attention(*layer, query=250, around=40, scale="linear").axes[0].images[0].norm
    assert type(linear).__name__ == "Normalize" and linear.vmin == 0
