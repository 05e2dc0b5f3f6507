"""Attention weights of one or more layers as per-edge values and sparse matrices.

Every function here takes what :class:`tgattn.GraphAttention` returns with
``return_attention_weights=True``: one layer is ``(edge_index [2, E], alpha [E, H])`` (or
``alpha [E]`` for a single head), a stack is a list of them, first layer first. Rows of a
layer matrix are queries i, columns are keys j: ``A[i, j] = alpha`` of edge ``(j, i)``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from scipy.sparse import coo_matrix, csr_matrix
from torch import Tensor

from ..builders._common import check_count
from ..functional import check_edge_index

Head = Union[None, int, str]
Layer = Tuple[Tensor, Tensor]


def select_head(alpha: Tensor, head: Head = "mean") -> Tensor:
    """The weight of each edge ``[E]`` for one head (``int``) or averaged over heads (``"mean"``).

    ``alpha`` may be ``[E]`` (one head; then ``head`` must be ``None``, ``"mean"`` or 0) or
    ``[E, H]``. ``head=None`` means ``"mean"`` here; :func:`tgattn.analysis.to_networkx`
    additionally keeps every head as an attribute.

    Example:
        >>> alpha = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
        >>> select_head(alpha, 1), select_head(alpha, "mean")
        (tensor([0., 1.]), tensor([0.5000, 0.5000]))
    """
    if alpha.dim() == 1:
        alpha = alpha.unsqueeze(-1)
    if alpha.dim() != 2:
        raise ValueError(f"alpha must have shape [E] or [E, H] (got {list(alpha.shape)})")
    if head is None or head == "mean":
        return alpha.mean(dim=1)
    if isinstance(head, bool) or not isinstance(head, int):
        raise ValueError(f"head must be None, an int or 'mean' (got {head!r})")
    if not -alpha.shape[1] <= head < alpha.shape[1]:
        raise ValueError(f"head {head} does not exist: alpha has {alpha.shape[1]} heads")
    return alpha[:, head]


def as_layers(attention: Union[Layer, Sequence[Layer]]) -> List[Layer]:
    """One ``(edge_index, alpha)`` pair or a sequence of them, as a list of pairs."""
    single = isinstance(attention, tuple) and len(attention) == 2 and isinstance(attention[0], Tensor)
    layers = [attention] if single else list(attention)
    for number, layer in enumerate(layers):
        if not (isinstance(layer, (tuple, list)) and len(layer) == 2 and all(isinstance(t, Tensor) for t in layer)):
            got = type(layer).__name__
            raise ValueError(f"layer {number} must be a pair (edge_index, alpha) of tensors (got {got})")
        if layer[1].shape[0] != layer[0].shape[1]:
            raise ValueError(
                f"layer {number}: alpha has {layer[1].shape[0]} rows but edge_index has {layer[0].shape[1]} edges"
            )
    if not layers:
        raise ValueError("attention must hold at least one layer (got an empty sequence)")
    for number, (edge_index, alpha) in enumerate(layers):
        check_shares(number, edge_index, alpha)
    return layers


def check_shares(number: int, edge_index: Tensor, alpha: Tensor) -> None:
    """Refuse a negative weight in layer ``number``, naming its edge (and head).

    Rollout and flow read weights as shares of a query's attention (flow as capacities): a
    negative one has no meaning there and would silently shift every result. NaN and inf are
    not refused: they propagate as NaN to the results they touch.

    Example:
        >>> check_shares(1, torch.tensor([[0, 1], [1, 1]]), torch.tensor([[0.5, 0.2], [0.5, -0.2]]))
        Traceback (most recent call last):
        ...
        ValueError: layer 1: edge 1 (key 1 -> query 1) has weight -0.2 in head 1: attention weights are shares and cannot be negative
    """
    negative = (alpha.detach() < 0).nonzero()
    if len(negative):
        edge, head = (negative[0].tolist() + [None])[:2]
        where = "" if head is None else f" in head {head}"
        key, query = edge_index[:, edge].tolist()
        raise ValueError(f"layer {number}: edge {edge} (key {key} -> query {query}) has weight "
                         f"{float(alpha.detach()[tuple(negative[0].tolist())]):.3g}{where}: attention weights are shares "
                         "and cannot be negative")


def count_nodes(layers: Sequence[Layer], num_nodes: Optional[int] = None) -> int:
    """``num_nodes`` checked against the edges, or the largest node id + 1 over all layers."""
    if num_nodes is None:
        return max((int(ei.max()) + 1 if ei.numel() else 0) for ei, _ in layers)
    num_nodes = check_count("num_nodes", num_nodes)
    for edge_index, _ in layers:
        check_edge_index(edge_index, num_nodes, num_nodes)
    return num_nodes


def layer_csr(
    edge_index: Tensor,
    alpha: Tensor,
    num_nodes: int,
    *,
    head: Head = "mean",
    residual: bool = True,
) -> csr_matrix:
    """:func:`layer_matrix` as a SciPy CSR matrix (sorted, duplicates added up): what rollout, flow
    and the page compute with (SciPy builds it in one pass, where torch's ``coalesce`` sorts).

    Example:
        >>> ei = torch.tensor([[0, 0, 1], [0, 1, 1]])
        >>> layer_csr(ei, torch.tensor([1.0, 0.5, 0.5]), 2).toarray()
        array([[1.  , 0.  ],
               [0.25, 0.75]])
    """
    edge_index = check_edge_index(edge_index, num_nodes, num_nodes)
    weight = select_head(alpha.detach().to("cpu", torch.float64), head).numpy()  # [E]
    rows, cols = edge_index[1].cpu().numpy(), edge_index[0].cpu().numpy()
    if residual:
        eye = np.arange(num_nodes)
        rows, cols = np.concatenate([rows, eye]), np.concatenate([cols, eye])
        weight = np.concatenate([0.5 * weight, np.full(num_nodes, 0.5)])
    matrix = coo_matrix((weight, (rows, cols)), shape=(num_nodes, num_nodes)).tocsr()
    matrix.sum_duplicates()  # also sorts each row's columns
    if residual:
        total = np.add.reduceat(matrix.data, matrix.indptr[:-1]) if matrix.nnz else np.zeros(num_nodes)
        with np.errstate(invalid="ignore"):  # a NaN / inf weight makes its row NaN, as rollout and flow expect
            matrix.data /= np.repeat(total, np.diff(matrix.indptr))  # every row holds its diagonal: no empty row
    return matrix


def layer_matrix(
    edge_index: Tensor,
    alpha: Tensor,
    num_nodes: int,
    *,
    head: Head = "mean",
    residual: bool = True,
) -> Tensor:
    r"""The attention of one layer as a sparse ``float64`` matrix ``[N, N]`` (rows = queries i).

    With ``residual=True`` this is Abnar & Zuidema's account of the skip connection,
    :math:`\tilde A = \operatorname{rownorm}(0.5\,A + 0.5\,I)`; a query without edges keeps
    only itself. Duplicate edges add up. The result is coalesced (sorted by row, column).

    Example:
        >>> ei = torch.tensor([[0, 0, 1], [0, 1, 1]])
        >>> alpha = torch.tensor([1.0, 0.5, 0.5])
        >>> layer_matrix(ei, alpha, 2).to_dense()
        tensor([[1.0000, 0.0000],
                [0.2500, 0.7500]], dtype=torch.float64)
    """
    return to_torch(layer_csr(edge_index, alpha, num_nodes, head=head, residual=residual))


def to_torch(matrix: csr_matrix) -> Tensor:
    """A SciPy CSR matrix as a coalesced sparse COO ``float64`` tensor."""
    matrix.sum_duplicates()  # sorted columns in each row, as a coalesced tensor needs
    coo = matrix.tocoo()
    index = torch.from_numpy(np.stack([coo.row, coo.col]).astype(np.int64))
    return torch.sparse_coo_tensor(index, torch.from_numpy(coo.data.astype(np.float64)), matrix.shape,
                                   is_coalesced=True, check_invariants=False)
