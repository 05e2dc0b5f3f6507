"""Prefix language modelling: bidirectional over a prefix, causal after it."""
from __future__ import annotations

from typing import Sequence, Union

import torch
from torch import Tensor

from ._common import Sizes, as_lengths, band, check_count, packed, sort_unique


def _prefix_single(length: int, prefix: int) -> Tensor:
    p = min(prefix, length)
    square = torch.stack([torch.arange(p).repeat(p), torch.arange(p).repeat_interleave(p)])  # the prefix block
    return sort_unique(torch.cat([band(length, length, 0), square], dim=1), length)


def prefix_lm(n: Sizes, prefix: Union[int, Sequence[int], Tensor], *, device=None) -> Tensor:
    """The first ``prefix`` tokens see each other; every later token sees all tokens up to itself.

    Rows = queries i, columns = keys j; rule: ``j <= i or j < prefix`` (for ``i >= prefix``
    the second clause adds nothing). ``prefix = 0`` or ``1`` is :func:`causal`, ``prefix >= n``
    is :func:`full`. Edges: ``p**2 + (n - p) (n + p + 1) / 2`` with ``p = min(prefix, n)``.
    Raffel et al., "Exploring the Limits of Transfer Learning with a Unified Text-to-Text
    Transformer" (T5), 2020, section 3.2.1; Dong et al., "UniLM", 2019.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        prefix: prefix length ``>= 0``; for a packed batch one int for all sequences or one
            per sequence (a prefix longer than its sequence covers all of it).
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(prefix_lm(5, 2)))
        x x . . .
        x x . . .
        x x x . .
        x x x x .
        x x x x x
        >>> prefix_lm(5, 2).shape[1] == 2**2 + 3 * (5 + 2 + 1) // 2
        True
    """
    lengths = as_lengths(n)
    if isinstance(prefix, (int, torch.SymInt)) or (isinstance(prefix, Tensor) and prefix.dim() == 0):
        p = check_count("prefix", prefix)
        return packed(n, lambda length: _prefix_single(length, p), device)
    prefixes = [check_count("each prefix", p) for p in (prefix.tolist() if isinstance(prefix, Tensor) else prefix)]
    if lengths is None or len(prefixes) != len(lengths):
        count = "a single length" if lengths is None else f"{len(lengths)} lengths"
        raise ValueError(f"got {len(prefixes)} prefixes for {count}; give one prefix per packed sequence")
    parts, offset = [], 0
    for length, p in zip(lengths, prefixes):
        parts.append(_prefix_single(length, p).to(device) + offset)
        offset += length
    return torch.cat(parts, dim=1) if parts else torch.empty(2, 0, dtype=torch.long, device=device)
