"""Bipartite edge sets for cross attention: queries from one sequence, keys from another."""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import Sizes, check_count, packed_pairs


def _full_pair(n_q: int, n_k: int) -> Tensor:
    i = torch.arange(n_q).repeat_interleave(n_k)
    j = torch.arange(n_k).repeat(n_q)
    return torch.stack([j, i])


def cross(n_q: Sizes, n_k: Sizes, *, device=None) -> Tensor:
    """Every query attends to every key of the other sequence (encoder-decoder attention).

    Query and key nodes are numbered separately: query i in ``[0, n_q)``, key j in
    ``[0, n_k)``; run it with ``layer((x_kv, x_q), edge_index)``. Rows = queries i,
    columns = keys j; rule: always true. Edges: ``n_q * n_k``. For packed batches give a
    pair of length lists: item b's queries see exactly item b's keys (block-diagonal
    ``[sum Lq, sum Lk]`` mask). Vaswani et al., "Attention Is All You Need", 2017.

    Args:
        n_q: number of queries, or the query lengths of a packed batch.
        n_k: number of keys, or the key lengths of a packed batch (same count as ``n_q``).
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(cross([1, 2], [2, 1]), 3, 3))
        x x .
        . . x
        . . x
    """
    return packed_pairs(n_q, n_k, _full_pair, device)


def _aligned_pair(n_q: int, n_k: int, w: int) -> Tensor:
    i = torch.arange(n_q).unsqueeze(1)  # [Tq, 1]
    centre = ((2 * i + 1) * n_k) // (2 * max(n_q, 1))  # [Tq, 1], the key under query i's midpoint
    j = centre + torch.arange(-w, w + 1)  # [Tq, 2w + 1]
    keep = (j >= 0) & (j < n_k)
    return torch.stack([j[keep], i.expand_as(j)[keep]])


def cross_window(n_q: Sizes, n_k: Sizes, w: int, *, device=None) -> Tensor:
    """Monotonic-alignment window: query i sees the keys near its proportional position.

    Query i is aligned with key ``c_i = floor((i + 1/2) * n_k / n_q)`` (the key under the
    midpoint of query i's share of the key axis; non-decreasing in i, so the alignment is
    monotonic) and attends to ``|j - c_i| <= w``. With ``n_q == n_k`` this is :func:`window`.
    Rows = queries i, columns = keys j; rule: ``|j - (2 i + 1) n_k // (2 n_q)| <= w``.
    Edges: ``sum_i (min(c_i + w, n_k - 1) - max(c_i - w, 0) + 1)``, at most ``n_q (2w + 1)``.
    Suits roughly monotonic alignments (speech, transliteration); cf. the diagonal prior of
    Tachibana et al., "Efficiently Trainable Text-to-Speech ... Guided Attention", 2018.

    Args:
        n_q: number of queries, or the query lengths of a packed batch.
        n_k: number of keys, or the key lengths of a packed batch (same count as ``n_q``).
        w: window radius around the aligned key, ``>= 0``.
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(cross_window(3, 6, 1), 3, 6))
        x x x . . .
        . . x x x .
        . . . . x x
    """
    w = check_count("w", w)
    return packed_pairs(n_q, n_k, lambda a, b: _aligned_pair(a, b, w), device)
