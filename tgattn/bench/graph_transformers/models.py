"""The networks of :mod:`tgattn.bench.graph_transformers`: a local baseline, GPS (PyG / tgattn), Exphormer.

Every network is ``encoder -> layers -> head`` with the same widths; only the layers change:

* ``gine`` / ``gat``: the local baseline (GINE on molecules, Xu et al. / Hu et al. 2020;
  the GAT paper's two-layer network on Planetoid, :mod:`tgattn.bench.planetoid`);
* ``gps_mha``: PyG's ``GPSConv`` (local conv + ``nn.MultiheadAttention`` over the padded batch);
* ``gps_tgattn``: :class:`tgattn.nn.GPSConv` converted from the ``gps_mha`` network of the same
  seed (:meth:`~tgattn.nn.GPSConv.from_pyg`): the same weights, attention over each graph's
  node pairs without padding;
* ``exphormer``: :class:`tgattn.nn.ExphormerConv` (the same local conv; attention over graph
  edges + a random ``EXPANDER_DEGREE``-regular expander + one virtual node per graph).
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import builders
from ...nn import ExphormerConv, GPSConv, VirtualNodes, exphormer_edge_kinds, full_per_graph

MOLECULE_MODELS = ("gine", "gps_mha", "gps_tgattn", "exphormer")
NODE_MODELS = ("gat", "gps_mha", "gps_tgattn", "exphormer")
EXPANDER_DEGREE = 4  # neighbours per node in the expander (Exphormer's exp_deg = 2)


def add_expander(graphs: List, seed: int = 0) -> None:
    """Store each graph's expander edges as ``expander_index`` (PyG offsets it when batching)."""
    g = torch.Generator().manual_seed(seed)
    for data in graphs:
        data.expander_index = builders.expander(data.num_nodes, EXPANDER_DEGREE, generator=g)


class Embed(nn.Module):
    """Sum of one learned embedding per categorical column (``from_smiles`` atom / bond features)."""

    def __init__(self, sizes: List[int], hidden: int):
        super().__init__()
        self.tables = nn.ModuleList([nn.Embedding(s, hidden) for s in sizes])

    def forward(self, x: Tensor) -> Tensor:
        return sum(table(x[:, c]) for c, table in enumerate(self.tables))  # [N, hidden]


def _gine(hidden: int):
    from torch_geometric.nn import GINEConv

    return GINEConv(nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden)), edge_dim=hidden)


def _gat(hidden: int, heads: int):
    from torch_geometric.nn import GATConv

    return GATConv(hidden, hidden // heads, heads=heads, dropout=0.6)


def gt_layers(model: str, local, hidden: int, heads: int, layers: int, dropout: float, backend: str,
              norm: str = "batch_norm") -> nn.ModuleList:
    """``layers`` graph-transformer layers of kind ``model`` around fresh ``local()`` convs.

    ``norm`` is the GPS layer's normalization (a PyG name such as ``"batch_norm"``,
    ``"layer_norm"``, or ``"none"``).
    """
    from torch_geometric.nn import GPSConv as PyGGPSConv

    norm = None if norm == "none" else norm
    if model == "exphormer":
        return nn.ModuleList([ExphormerConv(hidden, local(), heads, dropout, norm=norm, backend=backend)
                              for _ in range(layers)])
    stack = [PyGGPSConv(hidden, local(), heads, dropout, norm=norm) for _ in range(layers)]
    if model == "gps_tgattn":
        with torch.random.fork_rng():  # converting draws fresh weights first: keep the stream of gps_mha
            stack = [GPSConv.from_pyg(layer, backend=backend) for layer in stack]
    return nn.ModuleList(stack)


class MoleculeNet(nn.Module):
    """Graph regression: atom/bond embeddings, ``layers`` layers, mean pooling, a two-layer head.

    ``rwse > 0`` adds a linear embedding of each atom's random-walk return probabilities
    (``batch.random_walk_pe [N, rwse]``, PyG's ``AddRandomWalkPE``; the RWSE of GPS)."""

    def __init__(self, model: str, *, hidden: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.0,
                 rwse: int = 0, norm: str = "batch_norm", backend: str = "fused"):
        from torch_geometric.utils.smiles import e_map, x_map

        super().__init__()
        if model not in MOLECULE_MODELS:
            raise ValueError(f"unknown molecule model {model!r}; choose from {MOLECULE_MODELS}")
        self.model = model
        self.atoms = Embed([len(v) for v in x_map.values()], hidden)
        self.bonds = Embed([len(v) for v in e_map.values()], hidden)
        self.rwse = nn.Linear(rwse, hidden) if rwse else None  # random-walk structural encoding
        if model == "gine":
            self.layers = nn.ModuleList([_gine(hidden) for _ in range(layers)])
            self.norms = nn.ModuleList([nn.BatchNorm1d(hidden) for _ in range(layers)])
        else:
            self.layers = gt_layers(model, lambda: _gine(hidden), hidden, heads, layers, dropout, backend, norm)
        self.virtual = VirtualNodes(1, hidden) if model == "exphormer" else None
        self.head = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, batch) -> Tensor:
        from torch_geometric.nn import global_mean_pool

        x, e, n = self.atoms(batch.x), self.bonds(batch.edge_attr), batch.num_nodes
        if self.rwse is not None:
            x = x + self.rwse(batch.random_walk_pe)  # [N, hidden]
        ei, b = batch.edge_index, batch.batch
        if self.model == "gine":
            for conv, norm in zip(self.layers, self.norms):
                x = x + F.relu(norm(conv(x, ei, e)))
        elif self.model == "exphormer":
            lengths = torch.bincount(b, minlength=batch.num_graphs)
            pairs = builders.exphormer(torch.cat([ei, batch.expander_index], 1), lengths, 0)
            kinds = exphormer_edge_kinds(pairs, ei, n)
            x = self.virtual(x, batch.num_graphs)  # [N + B, D]
            for layer in self.layers:
                x = layer(x, ei, attn_edge_index=pairs, attn_edge_kind=kinds, edge_attr=e)
            x = x[:n]
        else:
            pairs = full_per_graph(b, n) if self.model == "gps_tgattn" else None
            for layer in self.layers:
                x = layer(x, ei, b, edge_attr=e) if pairs is None else layer(x, ei, b, attn_edge_index=pairs, edge_attr=e)
        return self.head(global_mean_pool(x, b, size=batch.num_graphs)).squeeze(-1)  # [B]


class NodeNet(nn.Module):
    """Node classification on one graph: input dropout, a linear encoder, ``layers`` GT layers, a linear head.

    ``forward(x, edge_index)`` (the signature of :func:`tgattn.bench.models.train`); the
    attention edge set (all pairs, or the Exphormer set) is built once in the constructor.
    """

    def __init__(self, model: str, in_channels: int, num_classes: int, edge_index: Tensor, num_nodes: int, *,
                 hidden: int = 32, heads: int = 4, layers: int = 1, dropout: float = 0.5, seed: int = 0,
                 norm: str = "batch_norm", backend: str = "auto"):
        super().__init__()
        if model not in NODE_MODELS[1:]:
            raise ValueError(f"unknown graph-transformer model {model!r}; choose from {NODE_MODELS[1:]}")
        self.model, self.dropout, self.num_nodes = model, dropout, num_nodes
        self.encoder = nn.Linear(in_channels, hidden)
        self.layers = gt_layers(model, lambda: _gat(hidden, 8), hidden, heads, layers, dropout, backend, norm)
        self.head = nn.Linear(hidden, num_classes)
        self.pairs = self.kinds = self.virtual = None
        if model == "gps_tgattn":
            self.pairs = builders.full(num_nodes)  # one tensor: the engine analyses it once
        elif model == "exphormer":
            g = torch.Generator().manual_seed(seed)
            self.pairs = builders.exphormer(edge_index, num_nodes, EXPANDER_DEGREE, generator=g)
            self.kinds = exphormer_edge_kinds(self.pairs, edge_index, num_nodes)
            self.virtual = VirtualNodes(1, hidden)

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        from ..models import _dropout

        x = self.encoder(_dropout(x, self.dropout, self.training))  # [N, hidden]
        if self.virtual is not None:
            x = self.virtual(x, 1)
        for layer in self.layers:
            if self.model == "gps_mha":
                x = layer(x, edge_index)
            elif self.model == "gps_tgattn":
                x = layer(x, edge_index, attn_edge_index=self.pairs)
            else:
                x = layer(x, edge_index, attn_edge_index=self.pairs, attn_edge_kind=self.kinds)
        return self.head(F.dropout(x[: self.num_nodes], self.dropout, self.training))  # [N, classes]
