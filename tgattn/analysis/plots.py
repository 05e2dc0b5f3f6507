"""Pictures of attention: pattern, heatmap, graph, one token's neighbourhood and top influencers.

Each function draws on ``ax`` when given, otherwise on a new figure, and returns the
:class:`matplotlib.figure.Figure`; nothing is shown or saved (call ``fig.savefig``).
matplotlib is imported inside the functions, so tgattn does not depend on it.
Rows of every matrix picture are queries i, columns are keys j. Token labels are cut to
:data:`LABEL_CHARS` characters, and a matrix labels as many tokens as its axes have room
for at draw time (every token, else every 2nd, 5th, 10th, ... with its index), so that
labels never overlap, at 4 tokens as at 200.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..builders import to_mask
from ..builders._common import check_count
from .graph import to_networkx
from .influence import Influencers
from .weights import Head, count_nodes, layer_csr, layer_matrix

LABEL_CHARS = 12  # longer tokens are cut, with an ellipsis
NEIGHBOURHOOD_FONT = 9  # points: the largest size of a neighbourhood's labels


def short(token: str, limit: int = LABEL_CHARS) -> str:
    """``token`` cut to ``limit`` characters, its last one an ellipsis.

    Example:
        >>> short("tokenization"), short("internationalization")
        ('tokenization', 'internation…')
    """
    return token if len(token) <= limit else token[: limit - 1] + "…"


def _axes(ax, figsize):
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=figsize, layout="constrained").add_subplot()
    return ax


def _label(ax, n_q: int, n_k: int, tokens: Optional[Sequence[str]]) -> None:
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    if tokens is None:
        return
    _token_ticks(ax.xaxis, tokens[:n_k])
    _token_ticks(ax.yaxis, tokens[:n_q])
    ax.tick_params(axis="x", labelrotation=90)


def _token_ticks(axis, tokens: Sequence[str]) -> None:
    """Label ``axis`` with every token, or every 2nd, 5th, 10th, ... one and its index: as many
    as the axis has room for when it is drawn (its tick space), none outside the tokens."""
    from matplotlib import rcParams
    from matplotlib.font_manager import FontProperties
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    class EveryKth(MaxNLocator):
        step = 1

        def tick_values(self, vmin, vmax):
            # labels one line high (the x axis turns them upright) with a 0.4 line gap; matplotlib's
            # own "auto" keeps at most 10 ticks, too few for a 40-token axis with room for all
            box, font = self.axis.axes.bbox, rcParams[f"{self.axis.axis_name}tick.labelsize"]
            length = (box.width if self.axis.axis_name == "x" else box.height) * 72 / self.axis.axes.figure.dpi
            self.set_params(nbins=max(int(length / (1.4 * FontProperties(size=font).get_size_in_points())), 1))
            ticks = [int(v) for v in super().tick_values(vmin, vmax)
                     if 0 <= v < len(tokens) and min(vmin, vmax) <= v <= max(vmin, vmax)]
            self.step = ticks[1] - ticks[0] if len(ticks) > 1 else 1
            return ticks

    locator = EveryKth(integer=True, steps=[1, 2, 5, 10])
    axis.set_major_locator(locator)
    axis.set_major_formatter(FuncFormatter(
        lambda value, _: short(tokens[int(value)]) if locator.step == 1 else f"{int(value)} {short(tokens[int(value)])}"
    ))


def plot_pattern(
    edge_index: Tensor,
    *,
    num_queries: Optional[int] = None,
    num_keys: Optional[int] = None,
    tokens: Optional[Sequence[str]] = None,
    title: Optional[str] = None,
    ax=None,
):
    """The pattern matrix of an edge set: a dark cell where query i attends to key j.

    Example:
        >>> from tgattn import builders
        >>> fig = plot_pattern(builders.window(8, 2))
        >>> fig.axes[0].get_title()
        'pattern: 34 edges of 64 (53.1%)'
    """
    mask = to_mask(edge_index, num_queries, num_keys).cpu()  # [Nq, Nk]
    ax = _axes(ax, (4, 4))
    ax.imshow(mask.numpy(), cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
    _label(ax, mask.shape[0], mask.shape[1], tokens)
    edges, cells = int(mask.sum()), mask.numel()
    ax.set_title(title or f"pattern: {edges} edges of {cells} ({100 * edges / max(cells, 1):.1f}%)")
    return ax.figure


def plot_attention(
    edge_index: Tensor,
    alpha: Tensor,
    *,
    tokens: Optional[Sequence[str]] = None,
    head: Head = "mean",
    num_nodes: Optional[int] = None,
    query: Optional[int] = None,
    around: Optional[int] = None,
    scale: str = "log",
    title: Optional[str] = None,
    ax=None,
):
    """Attention heatmap: weight of key j for query i; cells outside the edge set stay blank.

    ``query`` (default: none) outlines that token's row in red. ``around`` (with ``query``) draws
    only the ``around`` tokens nearest the query, rows and columns (the title says which), so a
    long text shows the query's neighbourhood, not a matrix of unreadable cells; only that block
    is ever made dense. ``scale="log"`` (default) spreads the colours over the weights drawn (at
    most 4 decades below the largest), which at 1,000 tokens are around 1e-3; ``"linear"`` maps
    0 to 1 as before.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(3)
        >>> fig = plot_attention(ei, torch.tensor([1.0, 0.5, 0.5, 0.2, 0.3, 0.5]), tokens=["a", "b", "c"])
        >>> ax, bar = fig.axes
        >>> ax.get_title(), ax.get_xlabel(), bar.get_ylabel()
        ('attention (mean over heads)', 'key j', 'weight (log scale)')
        >>> fig = plot_attention(builders.causal(100), torch.rand(5050), query=99, around=10)
        >>> fig.axes[0].get_title().splitlines()
        ['attention (mean over heads)', 'tokens 90-99 of 100, centred on #99']
    """
    from matplotlib.colors import LogNorm, Normalize

    if scale not in ("log", "linear"):
        raise ValueError(f"scale must be 'log' or 'linear' (got {scale!r})")
    if num_nodes is None and tokens is not None:
        num_nodes = len(tokens)
    n = count_nodes([(edge_index, alpha)], num_nodes)
    lo, hi = 0, n
    if around is not None and query is not None and around < n:
        around = check_count("around", around)
        lo = min(max(query % n - around // 2, 0), n - around)
        hi = lo + around
    block = layer_csr(edge_index, alpha, n, head=head, residual=False)[lo:hi, lo:hi]
    present = block.copy()
    present.data[:] = 1
    shown = np.where(present.toarray() > 0, block.toarray(), np.nan)  # [hi - lo, hi - lo]
    drawn = shown[np.isfinite(shown)]
    if scale == "log":
        top = float(drawn.max()) if drawn.size and drawn.max() > 0 else 1.0
        floor = max(float(drawn[drawn > 0].min()) if (drawn > 0).any() else top, top * 1e-4)
        norm = LogNorm(vmin=min(floor, top / 10), vmax=top, clip=True)
    else:
        norm = Normalize(vmin=0)
    ax = _axes(ax, (5, 4))
    image = ax.imshow(shown, cmap="viridis", norm=norm, interpolation="nearest",
                      extent=(lo - 0.5, hi - 0.5, hi - 0.5, lo - 0.5))
    bar = ax.figure.colorbar(image, ax=ax, label="weight (log scale)" if scale == "log" else "weight")
    if scale == "log":  # a few plain labels inside the range: none reaches past the bar's ends
        bar.minorticks_off()
        bar.set_ticks(np.geomspace(norm.vmin, norm.vmax, 5)[1:-1], labels=[
            f"{v:.2g}" for v in np.geomspace(norm.vmin, norm.vmax, 5)[1:-1]])
    _label(ax, n, n, tokens)
    if query is not None:
        from matplotlib.patches import Rectangle

        ax.add_patch(Rectangle((lo - 0.5, query % n - 0.5), hi - lo, 1, fill=False, edgecolor="red", linewidth=1.2))
    which = "mean over heads" if head in (None, "mean") else f"head {head}"
    title = title or f"attention ({which})"
    if (lo, hi) != (0, n):
        title += f"\ntokens {lo}-{hi - 1} of {n}, centred on #{query % n}"
    ax.set_title(title)
    return ax.figure


def plot_graph(
    edge_index: Tensor,
    alpha: Tensor,
    *,
    tokens: Optional[Sequence[str]] = None,
    head: Head = "mean",
    top_k: int = 2,
    num_nodes: Optional[int] = None,
    title: Optional[str] = None,
    ax=None,
):
    """The attention graph: tokens on a line, an arc from key j to query i, width ∝ weight.

    Only the ``top_k`` strongest keys of each query are drawn (edges of weight 0 never).

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(3)
        >>> fig = plot_graph(ei, torch.tensor([1.0, 0.5, 0.5, 0.2, 0.3, 0.5]), tokens=["a", "b", "c"], top_k=1)
        >>> [t.get_text() for t in fig.axes[0].texts]
        ['a', 'b', 'c']
        >>> len(fig.axes[0].patches)  # one arrow per query
        3
    """
    import networkx as nx

    graph = to_networkx(edge_index, alpha, tokens=tokens, head="mean" if head is None else head, num_nodes=num_nodes)
    keep = []
    for i in graph.nodes:
        incoming = sorted(graph.in_edges(i, data="weight"), key=lambda e: (-e[2], e[0]))
        keep += [(j, i, w) for j, i, w in incoming[:top_k] if w > 0]
    shown = nx.DiGraph()
    shown.add_nodes_from(graph.nodes)
    shown.add_weighted_edges_from(keep)
    heaviest = max((w for _, _, w in keep), default=1.0)
    ax = _axes(ax, (max(4, 0.9 * graph.number_of_nodes()), 3))
    pos = {i: (float(i), 0.0) for i in graph.nodes}
    labels = {i: graph.nodes[i].get("token", str(i)) for i in graph.nodes}
    nx.draw_networkx_nodes(shown, pos, ax=ax, node_color="#dbe9f6", node_size=900)
    nx.draw_networkx_labels(shown, pos, labels=labels, ax=ax, font_size=9)
    nx.draw_networkx_edges(
        shown,
        pos,
        ax=ax,
        edgelist=[(j, i) for j, i, _ in keep],
        width=[4.0 * w / heaviest for _, _, w in keep],
        edge_color="#1f77b4",
        connectionstyle="arc3,rad=-0.5",
        arrowsize=12,
        node_size=900,
    )
    ax.set_title(title or f"attention graph (top {top_k} keys per query, width ∝ weight)")
    ax.margins(x=0.08, y=0.6)
    ax.set_axis_off()
    return ax.figure


def plot_influencers(
    influencers: Influencers,
    *,
    tokens: Optional[Sequence[str]] = None,
    query: Optional[int] = None,
    method: str = "rollout",
    title: Optional[str] = None,
    ax=None,
):
    """Bar chart of :func:`top_influencers`: one bar per token, strongest first.

    Example:
        >>> fig = plot_influencers(Influencers(torch.tensor([2, 0]), torch.tensor([0.6, 0.3])), query=2, method="flow")
        >>> ax = fig.axes[0]
        >>> len(ax.patches), ax.get_ylabel(), ax.get_title()
        (2, 'flow', 'top influencers of token 2')
    """
    index, score = influencers.index.tolist(), influencers.score.tolist()
    names = [f"{short(tokens[j])}\n#{j}" if tokens is not None else f"#{j}" for j in index]
    ax = _axes(ax, (max(3, 0.6 * len(index) + 1), 3))
    ax.bar(range(len(index)), score, color="#ff7f0e")
    ax.set_xticks(range(len(index)), names)
    ax.set_xlabel("input token")
    ax.set_ylabel(method)
    if title is None:
        title = "top influencers" if query is None else f"top influencers of token {query}"
        if query is not None and tokens is not None:
            title += f" {short(tokens[query])!r}"
    ax.set_title(title)
    return ax.figure


def plot_neighbourhood(
    edge_index: Tensor,
    alpha: Tensor,
    query: int,
    nodes: Sequence[int],
    *,
    tokens: Optional[Sequence[str]] = None,
    head: Head = "mean",
    top_k: int = 2,
    num_nodes: Optional[int] = None,
    title: Optional[str] = None,
    ax=None,
):
    """One token's neighbourhood in a layer's attention graph, readable at any length of text.

    Only ``nodes`` (the ``query`` and the tokens around it that matter, e.g. its top keys and
    top influencers) are drawn, evenly spaced in text order with ``query`` in orange; an arc
    goes from key j to query i for the ``top_k`` strongest edges into each drawn token from
    other drawn tokens, width ∝ weight. Each label (token and index) gets its own slot: turned
    upright and made smaller when the slots are narrow, so labels never overlap.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(3)
        >>> fig = plot_neighbourhood(ei, torch.tensor([1.0, 0.5, 0.5, 0.2, 0.3, 0.5]), 2, [0, 2], tokens=["a", "b", "c"])
        >>> [t.get_text() for t in fig.axes[0].texts], len(fig.axes[0].patches)  # one arc: 0 -> 2
        (['a\\n#0', 'c\\n#2'], 1)
    """
    from matplotlib.patches import FancyArrowPatch

    n = count_nodes([(edge_index, alpha)], num_nodes if num_nodes is not None else (len(tokens) if tokens else None))
    query %= n
    nodes = sorted(set(int(i) % n for i in nodes) | {query})
    index = torch.tensor(nodes)
    block = layer_matrix(edge_index, alpha, n, head=head, residual=False).index_select(0, index).to_dense()[:, index]
    block.fill_diagonal_(0.0)  # [m, m]: weights among the drawn tokens, self-attention left out
    arcs = [(a, b, float(block[b, a])) for b in range(len(nodes))
            for a in block[b].argsort(descending=True)[:top_k].tolist() if block[b, a] > 0]
    heaviest = max((w for _, _, w in arcs), default=1.0)
    ax = _axes(ax, (max(4, 0.7 * len(nodes)), 3))
    names = [tokens[i] if tokens is not None else "" for i in nodes]
    labels = [f"{short(s)}\n#{i}" if tokens is not None else f"#{i}" for s, i in zip(names, nodes)]
    # the slot of one label, in points, from the axes' share of the figure
    slot = ax.get_position().width * ax.figure.get_figwidth() * 72 / len(nodes)
    size = NEIGHBOURHOOD_FONT
    wide = 0.62 * size * max(len(line) for label in labels for line in label.split("\n"))
    upright = wide > 0.9 * slot
    if upright:  # one line, turned: the slot must hold one line's height
        labels = [label.replace("\n", " ") for label in labels]
        size = min(size, 0.7 * slot)
    ax.scatter(range(len(nodes)), [0] * len(nodes), s=120, zorder=3,
               color=["#ff7f0e" if i == query else "#9ecae1" for i in nodes])
    for x, label in enumerate(labels):
        ax.text(x, -0.12, label, ha="center", va="top", fontsize=size, rotation=90 if upright else 0)
    for a, b, w in arcs:
        bend = -0.3 if a < b else 0.3  # arcs above the line, either way
        ax.add_patch(FancyArrowPatch((a, 0), (b, 0), connectionstyle=f"arc3,rad={bend}", arrowstyle="-|>",
                                     mutation_scale=10, linewidth=0.5 + 3.5 * w / heaviest, color="#1f77b4",
                                     shrinkA=6, shrinkB=6, zorder=2))
    ax.set_xlim(-0.6, len(nodes) - 0.4)
    ax.set_ylim(-1.0, 0.15 * max(len(nodes) - 1, 1) + 0.3)
    ax.set_axis_off()
    ax.set_title(title or f"around {short(names[nodes.index(query)])!r} (#{query}): top {top_k} keys per token")
    return ax.figure
