"""Graph-transformer variants of the Planetoid network: attention over all node pairs.

Same two-layer network, protocol and conv as the local ``tgattn`` model of
:mod:`tgattn.bench.planetoid`; only the edge set (and an optional structural bias) changes:

* ``tgattn_global``: every node attends to every node, ``builders.full(N)`` (self included),
  with no structural information at all: the graph's edges are not used.
* ``tgattn_union``: the same all-pairs set plus a learned per-head score bias for each
  shortest-path-distance bucket, the spatial encoding of Graphormer (Ying et al., "Do
  Transformers Really Perform Bad for Graph Representation?", NeurIPS 2021). Bucket 1 is
  exactly the graph's own edge set and bucket 0 the self-loops, so this is the union of the
  local and the global set with a learned weighting of the two. Buckets: distance
  ``0 .. max_distance``, farther but reachable, unreachable (another connected component).
  The biases start at ``-DECAY * bucket`` (attention decaying with distance, nearly local at
  first; started at 0, i.e. plain global attention, it still scored like plain global
  attention after 40 epochs on Cora) and are
  trained with the rest.

On a single-graph data set the all-pairs set has ``N**2`` edges (7.3 M for Cora): it is a
full structure, so the engine runs it on dense SDPA with the bias as a float mask.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import builders
from ..nn.conv import GraphAttentionConv
from .planetoid import Net, _dropout

DECAY = 2.0  # initial bias per hop of the union model: exp(-2 d) weighs ~2000 far nodes below a neighbour


def spd_buckets(edge_index: Tensor, num_nodes: int, *, max_distance: int = 5) -> Tensor:
    """Shortest-path-distance bucket of every (query i, key j) pair, ``LongTensor[N, N]``.

    Distances are hop counts on the undirected graph. Bucket ``d`` for ``d <= max_distance``,
    ``max_distance + 1`` for farther reachable nodes, ``max_distance + 2`` for unreachable ones.

    Example:
        >>> spd_buckets(torch.tensor([[0, 1], [1, 2]]), 4, max_distance=1)
        tensor([[0, 1, 2, 3],
                [1, 0, 1, 3],
                [2, 1, 0, 3],
                [3, 3, 3, 0]])
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import shortest_path

    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 1:
        raise ValueError(f"max_distance must be a positive int (got {max_distance!r})")
    src, dst = edge_index.cpu().numpy()
    adj = coo_matrix((np.ones(len(src)), (dst, src)), shape=(num_nodes, num_nodes)).tocsr()
    dist = shortest_path(adj, directed=False, unweighted=True)  # [N, N] float, inf = unreachable
    buckets = np.where(np.isinf(dist), max_distance + 2, np.minimum(dist, max_distance + 1))
    return torch.from_numpy(buckets.astype(np.int64)).to(edge_index.device)


def _global_conv(i: int, o: int, heads: int, concat: bool) -> GraphAttentionConv:
    # The all-pairs set already holds every self-pair: no self-loop handling.
    return GraphAttentionConv(i, o, heads, concat=concat, dropout=0.6, root_weight=False)


class GlobalNet(Net):
    """The GAT paper's two-layer network attending over all node pairs, optionally with SPD bias.

    ``forward(x, edge_index)`` ignores ``edge_index`` (the graph's edges are folded into the
    distance buckets at construction), so the network trains with the same loop as the others.
    """

    def __init__(self, in_channels: int, num_classes: int, edge_index: Tensor, num_nodes: int, *,
                 distance_bias: bool, max_distance: int = 5, hidden: int = 8, heads: int = 8,
                 out_heads: int = 1, dropout: float = 0.6):
        super().__init__(_global_conv, in_channels, num_classes, hidden=hidden, heads=heads, out_heads=out_heads,
                         dropout=dropout)
        full = builders.full(num_nodes, device=edge_index.device)
        self.register_buffer("pairs", full, persistent=False)  # [2, N*N]; one tensor: analysed once
        self.bias1 = self.bias2 = None
        if distance_bias:
            buckets = spd_buckets(edge_index, num_nodes, max_distance=max_distance)
            self.register_buffer("bucket", buckets[full[1], full[0]], persistent=False)  # [N*N]
            self.bias1 = nn.Embedding(max_distance + 3, heads)  # [buckets, H]
            self.bias2 = nn.Embedding(max_distance + 3, out_heads)
            with torch.no_grad():
                for emb in (self.bias1, self.bias2):  # [buckets, heads] = -DECAY * bucket
                    emb.weight.copy_(-DECAY * torch.arange(max_distance + 3.0).unsqueeze(1).expand_as(emb.weight))

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        b1 = b2 = None
        if self.bias1 is not None:
            b1, b2 = self.bias1(self.bucket), self.bias2(self.bucket)  # [N*N, H], [N*N, out_heads]
        x = _dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, self.pairs, edge_bias=b1))  # [N, heads * hidden]
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, self.pairs, edge_bias=b2)  # [N, classes] logits
