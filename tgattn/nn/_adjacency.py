"""The adjacency forms a PyG conv takes, read as tgattn's ``edge_index`` and written back.

PyG passes a graph to a conv as a dense ``edge_index [2, E]``, an ``EdgeIndex`` (the same with
its sizes attached), or a *transposed* sparse adjacency ``adj_t`` (``torch.sparse`` COO / CSR /
CSC or ``torch_sparse.SparseTensor``) whose entry ``adj_t[i, j]`` is the edge j -> i: rows =
targets (queries i), columns = sources (keys j). These helpers turn each into tgattn's
``edge_index`` (row 0 = key j, row 1 = query i) in the adjacency's own edge order, and put
per-edge attention weights back into the adjacency's form, as PyG's ``GATConv`` returns them.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch_geometric import EdgeIndex
from torch_geometric.typing import SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor, to_edge_index, to_torch_sparse_tensor

from ..edgeset import EdgeSet

Size = Tuple[Optional[int], Optional[int]]


def read(adj, edge_attr: Optional[Tensor], size: Optional[Size], values: bool):
    """``(edge_index [2, E] or EdgeSet, edge_attr, (num_sources, num_targets))`` of any PyG adjacency.

    Args:
        adj: ``edge_index [2, E]``, a prepared :class:`~tgattn.EdgeSet` (returned as it is), ``EdgeIndex``,
            or a sparse ``adj_t`` ``[num_targets, num_sources]``.
        edge_attr: edge features given beside ``adj`` (in its edge order), or None.
        size: ``(num_sources, num_targets)`` given by the caller (entries may be None).
        values: take a sparse adjacency's values as ``edge_attr`` when none is given (PyG's rule:
            a ``SparseTensor``'s values, a ``torch.sparse`` tensor's only when they are ``[E, F]``).

    Raises:
        ValueError: if ``size`` disagrees with the sizes the adjacency carries.
    """
    known: Size = (None, None)
    if isinstance(adj, SparseTensor):
        row, col, value = adj.coo()  # row = target i, col = source j
        adj, known = torch.stack([col, row]), (adj.size(1), adj.size(0))
        edge_attr = value if edge_attr is None and values else edge_attr
    elif is_torch_sparse_tensor(adj):
        (row, col), value = to_edge_index(adj)
        adj, known = torch.stack([col, row]), (adj.size(1), adj.size(0))
        edge_attr = value if edge_attr is None and values and value.dim() > 1 else edge_attr
    elif isinstance(adj, EdgeSet):
        known = (adj.num_keys, adj.num_queries)
    elif isinstance(adj, EdgeIndex):
        adj, known = adj.as_tensor(), (adj.num_rows, adj.num_cols)  # rows = sources there
    if size is None:
        return adj, edge_attr, known
    if len(size) != 2 or any(s is not None and k is not None and s != k for s, k in zip(size, known)):
        raise ValueError(f"size must be (num_sources, num_targets) = {known} for this adjacency (got {size!r})")
    return adj, edge_attr, tuple(k if s is None else s for s, k in zip(size, known))


def write(adj, edge_index: Tensor, alpha: Tensor, size: Tuple[int, int]):
    """Attention weights ``alpha [E, H]`` over ``edge_index`` in the form of the input adjacency.

    As ``GATConv`` returns them: a ``SparseTensor`` ``[Nq, Nk]`` with ``[E, H]`` values for a
    ``SparseTensor``; ``(adj_t [Nq, Nk, H], alpha)`` with ``adj_t`` of the input's layout for a
    ``torch.sparse`` tensor; ``(edge_index, alpha)`` otherwise. ``edge_index`` (which may hold
    self-loops the conv added) gives the entries.
    """
    num_sources, num_targets = size
    if isinstance(adj, SparseTensor):
        return SparseTensor(row=edge_index[1], col=edge_index[0], value=alpha, sparse_sizes=(num_targets, num_sources))
    if is_torch_sparse_tensor(adj):
        weights = to_torch_sparse_tensor(edge_index.flip(0), alpha, size=(num_targets, num_sources), layout=adj.layout)
        return weights, alpha
    return edge_index, alpha

