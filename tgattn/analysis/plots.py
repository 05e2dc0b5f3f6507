"""Pictures of attention: pattern, heatmap, graph and top influencers.

Each function draws on ``ax`` when given, otherwise on a new figure, and returns the
:class:`matplotlib.figure.Figure`; nothing is shown or saved (call ``fig.savefig``).
matplotlib is imported inside the functions, so tgattn does not depend on it.
Rows of every matrix picture are queries i, columns are keys j.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from ..builders import to_mask
from .graph import to_networkx
from .influence import Influencers
from .weights import Head, count_nodes, layer_matrix

MAX_TICKS = 48  # label every token up to this many, otherwise let matplotlib choose


def _axes(ax, figsize):
    if ax is None:
        from matplotlib.figure import Figure

        ax = Figure(figsize=figsize, layout="constrained").add_subplot()
    return ax


def _label(ax, n_q: int, n_k: int, tokens: Optional[Sequence[str]]) -> None:
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    if tokens is not None and max(n_q, n_k) <= MAX_TICKS:
        ax.set_xticks(range(n_k), tokens[:n_k], rotation=90)
        ax.set_yticks(range(n_q), tokens[:n_q])


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
    title: Optional[str] = None,
    ax=None,
):
    """Attention heatmap: weight of key j for query i; cells outside the edge set stay blank.

    Example:
        >>> from tgattn import builders
        >>> ei = builders.causal(3)
        >>> fig = plot_attention(ei, torch.tensor([1.0, 0.5, 0.5, 0.2, 0.3, 0.5]), tokens=["a", "b", "c"])
        >>> ax, bar = fig.axes
        >>> ax.get_title(), ax.get_xlabel(), bar.get_ylabel()
        ('attention (mean over heads)', 'key j', 'weight')
    """
    if num_nodes is None and tokens is not None:
        num_nodes = len(tokens)
    n = count_nodes([(edge_index, alpha)], num_nodes)
    matrix = layer_matrix(edge_index, alpha, n, head=head, residual=False).to_dense()  # [N, N]
    mask = to_mask(edge_index, n, n).cpu()
    shown = torch.where(mask, matrix, torch.full_like(matrix, float("nan")))
    ax = _axes(ax, (5, 4))
    image = ax.imshow(shown.numpy(), cmap="viridis", vmin=0, interpolation="nearest")
    ax.figure.colorbar(image, ax=ax, label="weight")
    _label(ax, n, n, tokens)
    which = "mean over heads" if head in (None, "mean") else f"head {head}"
    ax.set_title(title or f"attention ({which})")
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
    names = [f"{tokens[j]}\n#{j}" if tokens is not None else f"#{j}" for j in index]
    ax = _axes(ax, (max(3, 0.6 * len(index) + 1), 3))
    ax.bar(range(len(index)), score, color="#ff7f0e")
    ax.set_xticks(range(len(index)), names)
    ax.set_xlabel("input token")
    ax.set_ylabel(method)
    if title is None:
        title = "top influencers" if query is None else f"top influencers of token {query}"
        if query is not None and tokens is not None:
            title += f" {tokens[query]!r}"
    ax.set_title(title)
    return ax.figure
