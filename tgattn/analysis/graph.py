"""Attention as a ``networkx.DiGraph``: one layer, or a stack of layers as a layered graph."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import networkx as nx
from torch import Tensor

from ..functional import check_edge_index
from .weights import Head, Layer, as_layers, count_nodes, layer_matrix, select_head


def _check_tokens(tokens: Optional[Sequence[str]], n: int) -> None:
    if tokens is not None and len(tokens) != n:
        raise ValueError(f"tokens has {len(tokens)} labels but there are {n} nodes")


def to_networkx(
    edge_index: Tensor,
    alpha: Optional[Tensor] = None,
    *,
    tokens: Optional[Sequence[str]] = None,
    head: Head = None,
    num_nodes: Optional[int] = None,
) -> nx.DiGraph:
    """One layer's attention as a directed graph: edge ``j -> i`` for key j and query i.

    The direction is PyG's ``source_to_target`` flow (a message goes from key j to query
    i), so ``G.predecessors(i)`` are the tokens that query i reads.

    Edge attributes, by ``head``:

    * ``None`` (default): ``weight`` = mean over heads, and ``heads`` = tuple of the
      weight of every head (``alpha [E]`` counts as one head);
    * ``int``: ``weight`` = that head's weight; ``"mean"``: ``weight`` = mean over heads.

    With ``alpha=None`` the graph is the bare pattern (edges without attributes).
    Nodes are ``0 .. N-1``; with ``tokens`` each has the attribute ``token``. Duplicate
    edges add their weights.

    Args:
        edge_index: ``[2, E]``, row 0 = key j, row 1 = query i.
        alpha: attention weights ``[E, H]`` or ``[E]`` in the order of ``edge_index``.
        tokens: one label per node.
        head: see above.
        num_nodes: number of nodes (default: ``len(tokens)``, else largest id + 1).

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> alpha = torch.tensor([[1.0, 1.0], [0.5, 0.0], [0.5, 1.0]])
        >>> G = to_networkx(builders.causal(2), alpha, tokens=["sky", "blue"])
        >>> G.nodes[1]["token"], G.edges[0, 1]
        ('blue', {'weight': 0.25, 'heads': (0.5, 0.0)})
        >>> to_networkx(builders.causal(2), alpha, head=1).edges[1, 1]["weight"]
        1.0
    """
    if num_nodes is None:
        num_nodes = len(tokens) if tokens is not None else (int(edge_index.max()) + 1 if edge_index.numel() else 0)
    edge_index = check_edge_index(edge_index, num_nodes, num_nodes)
    _check_tokens(tokens, num_nodes)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(num_nodes))
    if tokens is not None:
        nx.set_node_attributes(graph, dict(enumerate(tokens)), "token")
    pairs = edge_index.t().tolist()  # [E, 2] as (j, i)
    if alpha is None:
        graph.add_edges_from(pairs)
        return graph
    if alpha.shape[0] != edge_index.shape[1]:
        raise ValueError(f"alpha has {alpha.shape[0]} rows but edge_index has {edge_index.shape[1]} edges")
    alpha = alpha.detach().cpu().double()
    weight = select_head(alpha, head).tolist()
    heads = alpha.reshape(alpha.shape[0], -1).tolist() if head is None else None
    for e, (j, i) in enumerate(pairs):
        if graph.has_edge(j, i):  # a duplicate edge: add up
            data = graph.edges[j, i]
            data["weight"] += weight[e]
            if heads is not None:
                data["heads"] = tuple(a + b for a, b in zip(data["heads"], heads[e]))
        elif heads is not None:
            graph.add_edge(j, i, weight=weight[e], heads=tuple(heads[e]))
        else:
            graph.add_edge(j, i, weight=weight[e])
    return graph


def to_networkx_layered(
    attention: Union[Layer, Sequence[Layer]],
    *,
    tokens: Optional[Sequence[str]] = None,
    head: Head = "mean",
    residual: bool = False,
    num_nodes: Optional[int] = None,
) -> nx.DiGraph:
    """A stack of layers as one layered DAG: node ``(l, i)`` = token i after layer l.

    ``(0, i)`` are the inputs. Layer l (1-based) adds edges ``(l-1, j) -> (l, i)`` with
    ``weight`` = the attention of query i on key j (``head="mean"`` or ``None``: mean over
    heads; an int: that head). With ``residual=True`` the weights are Abnar & Zuidema's
    ``rownorm(0.5 A + 0.5 I)`` (the capacities of :func:`attention_flow`), which adds the
    edges ``(l-1, i) -> (l, i)``. Nodes carry ``layer``, ``position`` and, with ``tokens``,
    ``token``.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> ei = builders.causal(2)
        >>> G = to_networkx_layered([(ei, torch.tensor([1.0, 0.5, 0.5]))] * 2, tokens=["a", "b"])
        >>> G.number_of_nodes(), G.number_of_edges(), G.edges[(0, 0), (1, 1)]["weight"]
        (6, 6, 0.5)
        >>> G.nodes[(2, 1)]
        {'layer': 2, 'position': 1, 'token': 'b'}
    """
    layers = as_layers(attention)
    if num_nodes is None and tokens is not None:
        num_nodes = len(tokens)
    n = count_nodes(layers, num_nodes)
    _check_tokens(tokens, n)
    graph = nx.DiGraph()
    for layer in range(len(layers) + 1):
        for i in range(n):
            attrs = {"layer": layer, "position": i}
            if tokens is not None:
                attrs["token"] = tokens[i]
            graph.add_node((layer, i), **attrs)
    for layer, (edge_index, alpha) in enumerate(layers, start=1):
        matrix = layer_matrix(edge_index, alpha, n, head=head, residual=residual)
        rows, cols = matrix.indices().tolist()
        graph.add_edges_from(
            ((layer - 1, j), (layer, i), {"weight": w}) for i, j, w in zip(rows, cols, matrix.values().tolist())
        )
    return graph
