"""The GNN models and inputs several benchmarks share (a benchmark imports no other benchmark).

* :class:`Net`: the GAT paper's two-layer network around any conv of :data:`MODELS` (GATConv,
  TransformerConv, tgattn's GraphAttentionConv), its Planetoid input (:func:`prepare`), training
  with the paper's early stopping (:func:`train`) and :func:`evaluate`: the networks of
  :mod:`tgattn.bench.planetoid`, :mod:`~tgattn.bench.gnn`, :mod:`~tgattn.bench.gpu`,
  :mod:`~tgattn.bench.graph_transformers` and :mod:`tgattn.distributed.gnn`;
* :func:`molecule_batches`: molecule-sized batches, a new edge set in each.

Graph-transformer variants of the network (:class:`GlobalNet`): attention over all node pairs.
Same two-layer network, protocol and conv as the local ``tgattn`` model; only the edge set (and
an optional structural bias) changes:

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

import time
import warnings
from typing import Callable, Dict, Iterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import builders
from ..nn.conv import GraphAttentionConv


def _gat(i, o, heads, concat):
    from torch_geometric.nn import GATConv

    return GATConv(i, o, heads=heads, concat=concat, dropout=0.6)


def _transformer(i, o, heads, concat):
    from torch_geometric.nn import TransformerConv

    return TransformerConv(i, o, heads=heads, concat=concat, dropout=0.6)


def _tgattn(i, o, heads, concat):
    return GraphAttentionConv(i, o, heads, concat=concat, dropout=0.6, add_self_loops=True, root_weight=False)


def _tgattn_shared(i, o, heads, concat):
    return GraphAttentionConv(i, o, heads, concat=concat, dropout=0.6, add_self_loops=True, root_weight=False,
                              shared_projection=True)


# model name -> conv factory (in_channels, out_channels, heads, concat). GATConv adds self-loops
# itself (its default); TransformerConv runs on the graph's edges with its defaults (root weight
# on, no self-loops); tgattn attends over the edges plus self-loops, without a root weight, like
# GAT (on Cora, seed 0, the root weight cost 2.4 points: 80.7 vs 83.1 %, see README_planetoid.md).
# tgattn_shared: the same with one projection for queries, keys and values (GAT's single W).
MODELS: Dict[str, Callable[[int, int, int, bool], nn.Module]] = {
    "gat": _gat,
    "transformer": _transformer,
    "tgattn": _tgattn,
    "tgattn_shared": _tgattn_shared,
}
# Graph-transformer networks (all node pairs, :class:`GlobalNet`): name -> SPD bias on?
GRAPH_TRANSFORMERS: Dict[str, bool] = {"tgattn_global": False, "tgattn_union": True}
MODEL_NAMES = (*MODELS, *GRAPH_TRANSFORMERS)


class Net(nn.Module):
    """The GAT paper's two-layer network around any conv factory from :data:`MODELS`."""

    def __init__(self, conv: Callable, in_channels: int, num_classes: int, *, hidden: int = 8, heads: int = 8,
                 out_heads: int = 1, dropout: float = 0.6):
        super().__init__()
        self.dropout = dropout
        self.conv1 = conv(in_channels, hidden, heads, True)
        self.conv2 = conv(hidden * heads, num_classes, out_heads, False)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        x = _dropout(x, self.dropout, self.training)
        x = F.elu(self.conv1(x, edge_index))  # [N, heads * hidden]
        x = F.dropout(x, self.dropout, self.training)
        return self.conv2(x, edge_index)  # [N, classes] logits


def _dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """Dropout on a dense or sparse CSR tensor (on its stored values: zeros stay zero either way)."""
    if x.layout != torch.sparse_csr:
        return F.dropout(x, p, training)
    values = F.dropout(x.values(), p, training)
    return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), values, x.shape, check_invariants=False)


def prepare(data):
    """Row-normalized features (as in the GAT paper) stored as sparse CSR.

    Bag-of-words features are ~1 % non-zero; a sparse first projection gives every model the
    same, ~3x cheaper input layer on CPU without changing any number the model computes.
    """
    data = data.clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
        data.x = (data.x / data.x.sum(dim=1, keepdim=True).clamp(min=1)).to_sparse_csr()
    return data


def build_model(model: str, data, dataset: str) -> Net:
    """The network for ``model`` (one of :data:`MODEL_NAMES`) on a Planetoid ``data`` object."""
    if model not in MODEL_NAMES:
        raise ValueError(f"unknown model {model!r}; choose from {sorted(MODEL_NAMES)}")
    out_heads = 8 if dataset == "PubMed" else 1
    classes = int(data.y.max()) + 1
    if model in GRAPH_TRANSFORMERS:
        return GlobalNet(data.num_features, classes, data.edge_index, data.num_nodes,
                         distance_bias=GRAPH_TRANSFORMERS[model], out_heads=out_heads)
    return Net(MODELS[model], data.num_features, classes, out_heads=out_heads)


def train(net: Net, data, *, epochs: int = 1000, patience: int = 100, lr: float = 0.005,
          weight_decay: float = 5e-4, on_epoch: Optional[Callable[[dict], None]] = None) -> dict:
    """Train with Adam and the GAT paper's early stopping; return the run's summary.

    Training stops when neither the validation accuracy nor the validation loss improved for
    ``patience`` epochs. The reported test accuracy is the one at the epoch with the best
    validation accuracy (ties: lower validation loss). ``on_epoch`` receives each epoch's
    ``{"epoch", "loss", "train_acc", "val_acc", "test_acc", "val_loss"}``.
    """
    opt = torch.optim.Adam(net.parameters(), lr=lr, weight_decay=weight_decay)
    best = {"val_acc": -1.0, "val_loss": float("inf")}
    best_loss, best_acc, waited, train_time = float("inf"), -1.0, 0, 0.0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        net.train()
        opt.zero_grad()
        loss = F.cross_entropy(net(data.x, data.edge_index)[data.train_mask], data.y[data.train_mask])
        loss.backward()
        opt.step()
        train_time += time.perf_counter() - start
        stats = {"epoch": epoch, "loss": loss.item(), **evaluate(net, data)}
        if on_epoch is not None:
            on_epoch(stats)
        if (stats["val_acc"], -stats["val_loss"]) > (best["val_acc"], -best["val_loss"]):
            best = stats
        if stats["val_acc"] > best_acc or stats["val_loss"] < best_loss:
            best_acc, best_loss, waited = max(best_acc, stats["val_acc"]), min(best_loss, stats["val_loss"]), 0
        else:
            waited += 1
            if waited >= patience:
                break
    return {"test_acc": best["test_acc"], "val_acc": best["val_acc"], "best_epoch": best["epoch"],
            "epochs": epoch, "ms_per_epoch": 1000 * train_time / epoch}


@torch.no_grad()
def evaluate(net: Net, data) -> dict:
    """Accuracy on the train/val/test masks and the validation loss, in eval mode."""
    net.eval()
    logits = net(data.x, data.edge_index)
    pred = logits.argmax(-1)
    acc = {f"{split}_acc": float((pred[m] == data.y[m]).float().mean())
           for split, m in (("train", data.train_mask), ("val", data.val_mask), ("test", data.test_mask))}
    acc["val_loss"] = float(F.cross_entropy(logits[data.val_mask], data.y[data.val_mask]))
    return acc


def molecule_batches(steps: int, *, graphs: int = 128, sizes=(18, 30), features: int = 64, seed: int = 0) -> Iterator:
    """``steps`` batches ``(x [N, features], edge_index [2, E], y [N])`` of ring-shaped graphs with
    three random chords each (both directions), a fresh edge set per batch."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(sizes[0], sizes[1] + 1, (graphs,), generator=g)
        offsets = torch.cumsum(lengths, 0) - lengths
        node_graph = torch.repeat_interleave(torch.arange(graphs), lengths)
        nodes = torch.arange(int(lengths.sum()))
        ring = torch.stack([nodes, offsets[node_graph] + (nodes - offsets[node_graph] + 1) % lengths[node_graph]])
        pick = torch.randint(0, 1 << 30, (2, graphs * 3), generator=g)
        graph = torch.arange(graphs).repeat_interleave(3)
        chords = offsets[graph] + pick % lengths[graph]
        edges = torch.cat([ring, chords], dim=1)
        edges = torch.cat([edges, edges.flip(0)], dim=1)
        yield torch.randn(nodes.numel(), features, generator=g), edges, torch.randint(0, 16, (nodes.numel(),), generator=g)


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
