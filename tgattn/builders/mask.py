"""Conversions between edge sets and dense boolean masks, and a text picture of a pattern."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._common import check_count


def to_mask(edge_index: Tensor, n_q: Optional[int] = None, n_k: Optional[int] = None) -> Tensor:
    """The dense twin of an edge set: ``mask[i, j] = True`` for each edge ``(j, i)``.

    Rows = queries i, columns = keys j (the boolean ``attn_mask`` convention of
    ``scaled_dot_product_attention``).

    Args:
        edge_index: ``LongTensor[2, E]``; row 0 = key j, row 1 = query i.
        n_q: number of queries (default: largest target + 1).
        n_k: number of keys (default: ``n_q``).

    Example:
        >>> to_mask(torch.tensor([[0, 0, 1], [0, 1, 1]]))
        tensor([[ True, False],
                [ True,  True]])
    """
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E] (got {list(edge_index.shape)})")
    if n_q is None:
        n_q = int(edge_index.max()) + 1 if edge_index.numel() else 0
    n_q = check_count("n_q", n_q)
    n_k = n_q if n_k is None else check_count("n_k", n_k)
    if edge_index.numel():
        if int(edge_index[1].max()) >= n_q or int(edge_index[0].max()) >= n_k or int(edge_index.min()) < 0:
            raise ValueError(f"edge_index does not fit a [{n_q}, {n_k}] mask")
    mask = torch.zeros(n_q, n_k, dtype=torch.bool, device=edge_index.device)
    mask[edge_index[1], edge_index[0]] = True
    return mask


def from_mask(mask: Tensor) -> Tensor:
    """The edge set of a boolean mask, sorted by (target, source).

    Args:
        mask: ``[Nq, Nk]`` (rows = queries i, columns = keys j), or ``[B, Nq, Nk]`` for a
            batch: then query i of item b is node ``b * Nq + i`` and key j is ``b * Nk + j``
            (a packed, block-diagonal edge set).

    Example:
        >>> from_mask(torch.tensor([[True, False], [True, True]]))
        tensor([[0, 0, 1],
                [0, 1, 1]])
    """
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a boolean tensor (got {mask.dtype})")
    if mask.dim() == 2:
        i, j = mask.nonzero(as_tuple=True)
        return torch.stack([j, i])
    if mask.dim() == 3:
        b, i, j = mask.nonzero(as_tuple=True)
        return torch.stack([b * mask.shape[2] + j, b * mask.shape[1] + i])
    raise ValueError(f"mask must have shape [Nq, Nk] or [B, Nq, Nk] (got {list(mask.shape)})")


def draw(edge_index: Tensor, n_q: Optional[int] = None, n_k: Optional[int] = None) -> str:
    """The pattern as text: one line per query i, ``x`` where key j is attended, ``.`` elsewhere.

    Example:
        >>> print(draw(torch.tensor([[0, 0, 1], [0, 1, 1]])))
        x .
        x x
    """
    mask = to_mask(edge_index, n_q, n_k)
    return "\n".join(" ".join("x" if m else "." for m in row) for row in mask.tolist())
