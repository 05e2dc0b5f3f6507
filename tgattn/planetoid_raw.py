"""Read the raw Planetoid files (Yang et al., "Revisiting Semi-Supervised Learning with Graph
Embeddings", ICML 2016) without SciPy.

The raw files pickle their feature matrices as ``scipy.sparse.csr_matrix``; PyG's reader needs
SciPy to unpickle them. This reader maps that class to a small stand-in that keeps the CSR
arrays, then builds the same graph as PyG's ``Planetoid`` (public split): features of the test
nodes put back in their ``test.index`` order, CiteSeer's isolated test nodes as zero rows,
self-loops and duplicate edges removed, 140/120/60 training, 500 validation, 1000 test nodes.
"""
from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .builders._common import sort_unique


class _CSR:
    """What unpickling a ``scipy.sparse.csr_matrix`` yields here: its state, densified on demand."""

    def __setstate__(self, state: dict) -> None:
        self.state = state

    def dense(self) -> Tensor:
        s = self.state
        rows, cols = s["_shape"]
        counts = np.diff(s["indptr"])
        out = torch.zeros(rows, cols)
        row = torch.from_numpy(np.repeat(np.arange(rows), counts))
        out[row, torch.from_numpy(s["indices"].astype(np.int64))] = torch.from_numpy(s["data"]).float()
        return out


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module.startswith("scipy.sparse") and name == "csr_matrix":
            return _CSR
        return super().find_class(module, name)


def _read(raw: Path, prefix: str, part: str):
    with (raw / f"ind.{prefix}.{part}").open("rb") as f:
        out = _Unpickler(f, encoding="latin1").load()
    if isinstance(out, _CSR):
        return out.dense()
    if isinstance(out, np.ndarray):
        return torch.from_numpy(out).float()
    return out  # the adjacency dict


def read_planetoid(raw: Path, name: str):
    """The public-split ``torch_geometric.data.Data`` of Planetoid ``name`` from its ``raw`` folder."""
    from torch_geometric.data import Data

    prefix = name.lower()
    tx, allx, ty, ally, graph = (_read(raw, prefix, p) for p in ("tx", "allx", "ty", "ally", "graph"))
    num_train = _read(raw, prefix, "y").shape[0]
    test_index = torch.tensor([int(line) for line in (raw / f"ind.{prefix}.test.index").read_text().split()])
    ordered = test_index.sort().values
    if prefix == "citeseer":  # isolated test nodes have no rows in tx / ty: insert zero rows
        lo, span = int(ordered[0]), int(ordered[-1] - ordered[0]) + 1
        tx_full, ty_full = tx.new_zeros(span, tx.shape[1]), ty.new_zeros(span, ty.shape[1])
        tx_full[ordered - lo], ty_full[ordered - lo] = tx, ty
        tx, ty = tx_full, ty_full
    x = torch.cat([allx, tx])  # [N, F]
    x[test_index] = x[ordered]
    y = torch.cat([ally, ty]).argmax(dim=1)  # [N]
    y[test_index] = y[ordered]
    n = y.shape[0]
    src = [j for i, nbrs in graph.items() for j in [i] * len(nbrs)]
    dst = [k for nbrs in graph.values() for k in nbrs]
    edge_index = torch.tensor([src, dst], dtype=torch.long)
    edge_index = sort_unique(edge_index[:, edge_index[0] != edge_index[1]], n)
    masks = {}
    for split, index in (("train", torch.arange(num_train)), ("val", torch.arange(num_train, num_train + 500)),
                         ("test", test_index)):
        masks[f"{split}_mask"] = torch.zeros(n, dtype=torch.bool).index_fill_(0, index, True)
    return Data(x=x, edge_index=edge_index, y=y, **masks)
