"""Global attention (Longformer): chosen tokens attend to all tokens and are attended by all."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ._common import Sizes, as_lengths, packed, sort_unique

Indices = Union[Sequence[int], Tensor]


def check_indices(idx: Indices, length: int, name: str = "idx", *, where: Optional[str] = None) -> Tensor:
    """``idx`` as a sorted LongTensor of distinct positions in ``[0, length)``, or ``ValueError`` naming a bad one."""
    idx = torch.as_tensor(idx).reshape(-1)
    if idx.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    if idx.is_floating_point() or idx.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer positions (got dtype {idx.dtype})")
    idx = torch.unique(idx.long().cpu())
    if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= length):
        bad = int(idx[0]) if int(idx[0]) < 0 else int(idx[-1])
        raise ValueError(f"{name} holds position {bad}, outside {where or f'a sequence of length {length}'}")
    return idx


def global_part(length: int, idx: Tensor, causal: bool) -> Tensor:
    """Global edges of one sequence for sorted distinct positions ``idx`` (all valid)."""
    i = torch.arange(length)
    k = idx.numel()
    as_query = torch.stack([i.repeat(k), idx.repeat_interleave(length)])  # global g sees every j
    as_key = torch.stack([idx.repeat(length), i.repeat_interleave(k)])  # every i sees global g
    edges = torch.cat([as_query, as_key], dim=1)
    if causal:
        edges = edges[:, edges[0] <= edges[1]]
    return sort_unique(edges, length)


def global_tokens(n: Sizes, idx: Indices, *, causal: bool = False, device=None) -> Tensor:
    """The tokens at positions ``idx`` attend to every token and every token attends to them.

    Rows = queries i, columns = keys j; rule: ``i in idx or j in idx`` (``causal=True``: and
    ``j <= i``). Combine with :func:`window` through :func:`union` for Longformer's pattern.
    Edges: ``2 k n - k**2`` for ``k`` distinct positions (per sequence for a packed batch).
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020, section 3.1.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        idx: positions of the global tokens inside each sequence (e.g. ``[0]`` for ``[CLS]``).
            For a packed batch they apply to every sequence; a sequence shorter than a
            position simply has no token there, and a position that fits no sequence is an error.
        causal: keep only keys ``j <= i``.
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw, union, window
        >>> print(draw(global_tokens(5, [1])))
        . x . . .
        x x x x x
        . x . . .
        . x . . .
        . x . . .
        >>> global_tokens(5, [1]).shape[1] == 2 * 1 * 5 - 1
        True
        >>> longformer = union(window(1024, 64), global_tokens(1024, [0]))
    """
    lengths = as_lengths(n)
    if lengths == []:  # an empty batch
        return torch.empty(2, 0, dtype=torch.long, device=device)
    if lengths is None:
        positions = check_indices(idx, int(n))
    else:
        longest = max(lengths)
        positions = check_indices(idx, longest, where=f"every packed sequence (the longest has length {longest})")
    return packed(n, lambda length: global_part(length, positions[positions < length], causal), device)
