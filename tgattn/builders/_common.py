"""Helpers shared by the builders: sizes, packed batches, and ordering of edges."""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

Sizes = Union[int, Sequence[int], Tensor]


def check_count(name: str, value: int, minimum: int = 0) -> int:
    """Return ``value`` as an int, or raise ``ValueError`` naming it when it is below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)) and not (
        isinstance(value, Tensor) and value.dim() == 0 and not value.is_floating_point()
    ):
        raise TypeError(f"{name} must be an int (got {value!r})")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum} (got {value})")
    return value


def as_lengths(n: Sizes) -> Optional[List[int]]:
    """``None`` for a single sequence length ``n``, else the list of packed sequence lengths."""
    if isinstance(n, Tensor) and n.dim() == 0:
        n = int(n)
    if isinstance(n, int) and not isinstance(n, bool):
        check_count("n", n)
        return None
    if isinstance(n, Tensor):
        if n.dim() != 1 or n.is_floating_point():
            raise ValueError(f"lengths must be a 1-D integer tensor (got shape {list(n.shape)}, dtype {n.dtype})")
        n = n.tolist()
    try:
        lengths = [check_count("each length", length) for length in n]
    except TypeError:
        raise TypeError(f"n must be an int or a sequence of lengths (got {n!r})") from None
    return lengths


def total_nodes(n: Sizes) -> int:
    """Number of nodes of a single sequence ``n`` or of a packed batch of lengths ``n``."""
    lengths = as_lengths(n)
    return int(n) if lengths is None else sum(lengths)


def packed(n: Sizes, single: Callable[[int], Tensor], device=None) -> Tensor:
    """Apply a one-sequence builder to ``n``, or to each packed sequence with node offsets.

    The result is block-diagonal (no edge crosses two sequences) and stays sorted by
    (target, source) because every block is sorted and offsets grow. Sequences of equal
    length share one call of ``single`` (so ``single`` must be deterministic).
    """
    lengths = as_lengths(n)
    if lengths is None:
        return single(int(n)).to(device)
    cache, parts, offset = {}, [], 0
    for length in lengths:
        if length not in cache:
            cache[length] = single(length).to(device)
        parts.append(cache[length] + offset)
        offset += length
    if not parts:
        return torch.empty(2, 0, dtype=torch.long, device=device)
    return torch.cat(parts, dim=1)


def band(length: int, left: int, right: int) -> Tensor:
    """Edges ``(j, i)`` with ``i - left <= j <= i + right`` inside ``[0, length)``, sorted."""
    if length == 0:
        return torch.empty(2, 0, dtype=torch.long)
    left, right = min(left, length - 1), min(right, length - 1)
    if left == length - 1 and right == 0:
        i, j = torch.tril_indices(length, length)
        return torch.stack([j, i])
    i = torch.arange(length).unsqueeze(1)  # [T, 1]
    j = i + torch.arange(-left, right + 1)  # [T, left + right + 1]
    keep = (j >= 0) & (j < length)
    return torch.stack([j[keep], i.expand_as(j)[keep]])


def sort_unique(edge_index: Tensor, num_keys: int) -> Tensor:
    """Sort edges by (target, source) and drop duplicates."""
    if edge_index.numel() == 0:
        return edge_index.view(2, 0).long()
    key = edge_index[1] * max(num_keys, 1) + edge_index[0]
    key = torch.unique(key)  # sorted
    return torch.stack([key % max(num_keys, 1), key // max(num_keys, 1)])


def packed_pairs(n_q: Sizes, n_k: Sizes, single: Callable[[int, int], Tensor], device=None) -> Tensor:
    """Apply a bipartite builder to ``(n_q, n_k)``, or to each pair of packed lengths.

    For packed batches ``n_q = [Lq_1, ...]`` and ``n_k = [Lk_1, ...]`` pair up item by item:
    query ``i`` of item ``b`` is node ``sum(Lq[:b]) + i`` and key ``j`` is ``sum(Lk[:b]) + j``,
    so no edge links a query of one item to a key of another.
    """
    q_lengths, k_lengths = as_lengths(n_q), as_lengths(n_k)
    if (q_lengths is None) != (k_lengths is None):
        raise ValueError(f"n_q and n_k must both be ints or both be packed lengths (got {n_q!r} and {n_k!r})")
    if q_lengths is None:
        return single(int(n_q), int(n_k)).to(device)
    if len(q_lengths) != len(k_lengths):
        raise ValueError(f"n_q and n_k must pair up: {len(q_lengths)} query lengths vs {len(k_lengths)} key lengths")
    parts, q_offset, k_offset = [], 0, 0
    for lq, lk in zip(q_lengths, k_lengths):
        block = single(lq, lk).to(device)
        parts.append(block + torch.tensor([[k_offset], [q_offset]], device=device))
        q_offset, k_offset = q_offset + lq, k_offset + lk
    if not parts:
        return torch.empty(2, 0, dtype=torch.long, device=device)
    return torch.cat(parts, dim=1)
