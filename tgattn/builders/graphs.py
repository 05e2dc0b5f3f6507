"""Any directed graph is an attention pattern: edge sets from networkx graphs."""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch
from torch import Tensor

from ._common import sort_unique


def from_networkx(G, *, nodelist: Optional[Sequence[Hashable]] = None, device=None) -> Tensor:
    """The edge set of a networkx graph: an edge ``u -> v`` lets query ``v`` attend to key ``u``.

    Node ``G`` is numbered by its position in ``nodelist`` (default ``list(G)``, networkx's
    insertion order), so row ``i`` of your ``x`` must hold the features of ``nodelist[i]``.
    An undirected graph gives both directions of each edge; parallel edges of a multigraph
    count once; self-loops ``u -> u`` are kept (and only those the graph has: add them with
    :func:`add_self_loops`). Rows = queries i, columns = keys j. Edges: the number of
    distinct directed edges of ``G``. The inverse, with attention weights as edge
    attributes, is :func:`tgattn.analysis.to_networkx`.

    Args:
        G: a ``networkx.Graph`` / ``DiGraph`` (or multigraph).
        nodelist: the node order (default: ``list(G)``); must hold every node of an edge.
        device: where to put the edges.

    Example:
        >>> import networkx as nx
        >>> from tgattn.builders import draw
        >>> G = nx.DiGraph([("a", "b"), ("b", "c"), ("a", "c")])
        >>> print(draw(from_networkx(G), 3))
        . . .
        x . .
        x x .
    """
    nodes = list(G) if nodelist is None else list(nodelist)
    position = {node: i for i, node in enumerate(nodes)}
    if len(position) != len(nodes):
        raise ValueError("nodelist holds a node twice")
    pairs = []
    for u, v in G.edges():
        for node in (u, v):
            if node not in position:
                raise ValueError(f"node {node!r} has an edge but is not in nodelist")
        pairs.append((position[u], position[v]))
        if not G.is_directed():
            pairs.append((position[v], position[u]))
    edges = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2).T  # [2, E]: row 0 = key u, row 1 = query v
    return sort_unique(edges, len(nodes)).to(device)
