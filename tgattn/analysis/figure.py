"""The picture of ``python -m tgattn show``: who influences a token, in four panels.

:func:`rank` orders a token's influencers by rollout and by flow; :func:`show_figure` draws
the last layer's heatmap, the token's neighbourhood in its graph and both rankings. The
command line (:mod:`tgattn.analysis.show`) and :func:`tgattn.hf.show` draw with them.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

from .influence import Influencers, top_influencers
from .labels import TITLE_CHARS, fit
from .weights import Layer, select_head

HEATMAP_TOKENS = 48  # a longer text's heatmap shows the query's 48 nearest tokens: cells stay visible


def rank(attention: Sequence[Layer], query: int, k: int, num_nodes: int) -> Dict[str, Influencers]:
    """The top ``k`` influencers of ``query`` by rollout and by flow."""
    return {m: top_influencers(query, k, attention, method=m, num_nodes=num_nodes) for m in ("rollout", "flow")}


def neighbourhood(attention: Sequence[Layer], ranked: Dict[str, Influencers], query: int, num_nodes: int,
                  *, keys: int = 2) -> List[int]:
    """The tokens the graph panel draws around ``query``: itself, its ``keys`` strongest keys in
    the last layer and its ranked influencers, in text order.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> ei = builders.causal(4)  # query 3's edges come last: keys 0, 1, 2, 3
        >>> alpha = torch.tensor([1.0, 0.5, 0.5, 0.4, 0.3, 0.3, 0.7, 0.1, 0.1, 0.1])
        >>> neighbourhood([(ei, alpha)], {"rollout": Influencers(torch.tensor([3, 2]), torch.ones(2))}, 3, 4, keys=1)
        [0, 2, 3]
    """
    edge_index, alpha = attention[-1]
    into = edge_index[1] == query
    strongest = edge_index[0][into][select_head(alpha[into]).argsort(descending=True)[:keys]]
    chosen = {query, *strongest.tolist()}
    for influencers in ranked.values():
        chosen.update(influencers.index.tolist())
    return sorted(j % num_nodes for j in chosen)


def show_figure(
    tokens: Sequence[str], attention: Sequence[Layer], ranked: Dict[str, Influencers], *, query: int, title: str = ""
):
    """Four panels: the last layer's heatmap (``query``'s row outlined; past :data:`HEATMAP_TOKENS`
    tokens only the query's nearest ones, on a log colour scale) and ``query``'s
    neighbourhood in its graph, then the ``ranked`` bars into ``query``.

    The graph panel draws only ``query``'s neighbourhood (:func:`neighbourhood`), and every
    title is cut to fit its panel, so the picture reads the same at 4 tokens and at 200.
    """
    from matplotlib.figure import Figure

    from .plots import plot_attention, plot_influencers, plot_neighbourhood, short

    query %= len(tokens)
    fig = Figure(figsize=(12, 8.5), layout="constrained")
    grid = fig.add_gridspec(2, 2)
    last, name = len(attention), short(tokens[query])
    heatmap, graph = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1])
    plot_attention(*attention[-1], tokens=tokens, query=query, around=HEATMAP_TOKENS,
                   title=f"layer {last} attention (mean over heads)", ax=heatmap)
    plot_neighbourhood(*attention[-1], query, neighbourhood(attention, ranked, query, len(tokens)), tokens=tokens,
                       num_nodes=len(tokens), title=f"layer {last} around {name!r} (#{query})\ntop 2 keys per token, width ∝ weight",
                       ax=graph)
    for column, (method, influencers) in enumerate(ranked.items()):
        plot_influencers(
            influencers,
            tokens=tokens,
            query=query,
            method=method,
            title=f"attention {method} into {name!r} (#{query}) over {last} layers",
            ax=fig.add_subplot(grid[1, column]),
        )
    if title:
        fig.suptitle(fit(title, TITLE_CHARS))
    return fig
