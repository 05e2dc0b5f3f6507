"""Structural encodings of graph transformers: Graphormer's spatial and centrality encodings.

Ying et al., "Do Transformers Really Perform Bad for Graph Representation?", NeurIPS 2021
(https://arxiv.org/abs/2106.05234). The spatial encoding is a learned attention-score bias
per shortest-path distance and head; it enters tgattn through ``edge_bias`` (``[E, H]``, one
value per attention edge), so it costs ``O(E H)`` and never an ``N x N`` matrix. Its gradient
flows through every backend of :func:`tgattn.functional.graph_attention`.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from ..builders._common import check_count


def shortest_path_distance(edge_index: Tensor, pairs: Tensor, num_nodes: int, *, max_distance: int) -> Tensor:
    """Hop distance from key j to query i along ``edge_index`` for each pair ``(j, i)`` of ``pairs``.

    Paths follow the edges in their direction (source -> target, the way messages flow); on
    an undirected graph (both directions stored, as in PyG) this is the usual distance.
    Distances above ``max_distance``, and pairs with no path, get ``max_distance + 1``.
    A breadth-first search from every key node of ``pairs`` at once, ``max_distance`` levels
    deep, on integer codes of (start, node) pairs: memory grows with the number of node pairs
    within ``max_distance`` hops, never with ``num_nodes**2``.

    Args:
        edge_index: the graph ``[2, E_graph]`` (row 0 = source j, row 1 = target i).
        pairs: the attention edges ``[2, E]`` whose distances are wanted (same convention).
        num_nodes: number of nodes N.
        max_distance: deepest level searched, ``>= 0``.

    Returns:
        ``LongTensor[E]``, in the order of ``pairs``.

    Example:
        >>> path = torch.tensor([[0, 1, 1, 2], [1, 0, 2, 1]])  # 0 - 1 - 2
        >>> from tgattn import builders
        >>> shortest_path_distance(path, builders.full(3), 3, max_distance=1)
        tensor([0, 1, 2, 1, 0, 1, 2, 1, 0])
    """
    max_distance = check_count("max_distance", max_distance)
    n = max(int(num_nodes), 1)
    device = pairs.device
    src, dst = edge_index.long().to(device)
    order = torch.argsort(src * n + dst)
    col = dst[order]  # out-neighbours, grouped by source
    ptr = torch.zeros(n + 1, dtype=torch.long, device=device)
    ptr[1:] = torch.cumsum(torch.bincount(src, minlength=n), 0)
    target = pairs[0].long() * n + pairs[1].long()  # [E] codes (start j, end i)
    dist = torch.full_like(target, max_distance + 1)
    starts = torch.unique(pairs[0].long())
    frontier = starts * n + starts  # codes of (start, node) first reached at this level
    seen = frontier
    dist[torch.isin(target, frontier)] = 0
    for level in range(1, max_distance + 1):
        if frontier.numel() == 0:
            break
        start, node = frontier // n, frontier % n
        deg = ptr[node + 1] - ptr[node]  # [F]
        first = torch.repeat_interleave(ptr[node], deg)  # [F'] where each node's neighbours begin
        offset = torch.arange(first.numel(), device=device) - torch.repeat_interleave(torch.cumsum(deg, 0) - deg, deg)
        step = torch.unique(torch.repeat_interleave(start, deg) * n + col[first + offset])
        frontier = step[~torch.isin(step, seen)]
        seen = torch.cat([seen, frontier])
        dist[torch.isin(target, frontier)] = level
    return dist


class SpatialEncoding(nn.Module):
    r"""Graphormer's spatial encoding: a learned score bias per shortest-path distance and head.

    :math:`b^h_{ij} = w^h_{\phi(i, j)}` with :math:`\phi` the hop distance from j to i,
    capped: distances ``0 .. max_distance`` have their own bias, farther or unreachable pairs
    share bucket ``max_distance + 1``. Pass the result to ``edge_bias`` of
    :class:`~tgattn.GraphAttention` (or ``attn_bias`` of :class:`~tgattn.nn.GPSConv`).
    The biases start at 0 (plain attention).

    Args:
        num_heads (int): heads H.
        max_distance (int, optional): largest distance with its own bias (default: 5).

    Shapes:
        - input: ``distance [E]`` (integers ``>= 0``, from :func:`shortest_path_distance`)
        - output: ``[E, H]``

    Example:
        >>> enc = SpatialEncoding(2, max_distance=3)
        >>> enc(torch.tensor([0, 1, 9])).shape
        torch.Size([3, 2])
    """

    def __init__(self, num_heads: int, max_distance: int = 5):
        super().__init__()
        self.num_heads = check_count("num_heads", num_heads, 1)
        self.max_distance = check_count("max_distance", max_distance)
        self.bias = nn.Embedding(self.max_distance + 2, self.num_heads)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.zeros_(self.bias.weight)

    def forward(self, distance: Tensor) -> Tensor:
        return self.bias(distance.clamp(max=self.max_distance + 1))  # [E, H]

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(heads={self.num_heads}, max_distance={self.max_distance})"


class CentralityEncoding(nn.Module):
    r"""Graphormer's centrality encoding: learned vectors for in- and out-degree added to nodes.

    :math:`h_i = x_i + z^-_{\deg^-(i)} + z^+_{\deg^+(i)}`, degrees capped at ``max_degree``.
    On an undirected graph both degrees are equal (Graphormer then uses one table; here the
    two tables add up to one learned vector per degree).

    Args:
        channels (int): node feature size D.
        max_degree (int, optional): largest degree with its own vector (default: 64).

    Shapes:
        - input: ``x [N, D]``, ``edge_index [2, E]``
        - output: ``[N, D]``

    Example:
        >>> enc = CentralityEncoding(4, max_degree=2)
        >>> enc(torch.zeros(3, 4), torch.tensor([[0, 0, 0], [1, 2, 1]])).shape
        torch.Size([3, 4])
    """

    def __init__(self, channels: int, max_degree: int = 64):
        super().__init__()
        self.channels = check_count("channels", channels, 1)
        self.max_degree = check_count("max_degree", max_degree)
        self.in_degree = nn.Embedding(self.max_degree + 1, self.channels)
        self.out_degree = nn.Embedding(self.max_degree + 1, self.channels)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.in_degree.weight, std=0.02)
        nn.init.normal_(self.out_degree.weight, std=0.02)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        n = x.shape[0]
        deg_in = torch.bincount(edge_index[1], minlength=n).clamp(max=self.max_degree)  # [N]
        deg_out = torch.bincount(edge_index[0], minlength=n).clamp(max=self.max_degree)  # [N]
        return x + self.in_degree(deg_in) + self.out_degree(deg_out)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.channels}, max_degree={self.max_degree})"
