"""Local patterns beyond the plain window: dilated windows and non-overlapping blocks."""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import Sizes, check_count, packed


def offsets_band(length: int, offsets: Tensor) -> Tensor:
    """Edges ``(i + o, i)`` for increasing ``offsets`` o, kept inside ``[0, length)``, sorted."""
    i = torch.arange(length).unsqueeze(1)  # [T, 1]
    j = i + offsets  # [T, O]
    keep = (j >= 0) & (j < length)
    return torch.stack([j[keep], i.expand_as(j)[keep]])


def dilated(n: Sizes, w: int, dilation: int, *, causal: bool = False, device=None) -> Tensor:
    """Dilated sliding window: ``w`` keys on each side, spaced ``dilation`` apart.

    Rows = queries i, columns = keys j; rule: ``|i - j| <= w * dilation and (i - j) % dilation == 0``
    (``causal=True``: also ``j <= i``). Two definitions are in use: this one, where ``w``
    counts keys (Longformer, section 3.1: a window of ``w`` with gaps of ``d - 1`` reaches
    ``w * d`` tokens), and one where ``w`` is a span in tokens, ``|i - j| <= w`` keeping every
    ``dilation``-th key. We count keys because then ``dilated(n, w, 1) == window(n, w)`` and
    the cost per query, ``2w + 1`` keys, does not depend on the dilation: dilation widens the
    receptive field for free, which is its purpose. The span definition is
    ``dilated(n, w // dilation, dilation)``.

    Edges: ``n + 2 * sum_{k=1..w} max(0, n - k * dilation)`` (causal: one such sum, not two).
    Beltagy et al., "Longformer: The Long-Document Transformer", 2020.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        w: keys on each side of the query, ``>= 0``.
        dilation: distance between consecutive keys, ``>= 1``.
        causal: keep only keys ``j <= i``.
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(dilated(7, 1, 2)))
        x . x . . . .
        . x . x . . .
        x . x . x . .
        . x . x . x .
        . . x . x . x
        . . . x . x .
        . . . . x . x
        >>> dilated(7, 1, 2).shape[1] == 7 + 2 * (7 - 2)
        True
    """
    w = check_count("w", w)
    dilation = check_count("dilation", dilation, 1)
    offsets = torch.arange(-w, 1 if causal else w + 1) * dilation  # increasing: sorted keys
    return packed(n, lambda length: offsets_band(length, offsets), device)


def block_local(n: Sizes, block: int, *, causal: bool = False, device=None) -> Tensor:
    """Chunked attention: the sequence is cut into blocks of ``block`` tokens, each attends within itself.

    Rows = queries i, columns = keys j; rule: ``i // block == j // block`` (``causal=True``:
    also ``j <= i``). Edges: ``(n // block) * block**2 + (n % block)**2`` (causal:
    ``(n // block) * block (block + 1) / 2 + m (m + 1) / 2`` with ``m = n % block``).
    The local half of Child et al., "Generating Long Sequences with Sparse Transformers",
    2019 (``fixed`` pattern, ``A(1)``); also "blockwise" / "chunked" attention
    (Qiu et al., "Blockwise Self-Attention for Long Document Understanding", 2019).

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        block: block size, ``>= 1``; the last block of a sequence may be shorter.
        causal: keep only keys ``j <= i``.
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(block_local(5, 2)))
        x x . . .
        x x . . .
        . . x x .
        . . x x .
        . . . . x
        >>> block_local(5, 2).shape[1] == 2 * 2**2 + 1**2
        True
    """
    block = check_count("block", block, 1)

    def single(length: int) -> Tensor:
        i = torch.arange(length).unsqueeze(1)  # [T, 1]
        start = i - i % block
        j = start + torch.arange(block)  # [T, block]
        keep = (j < length) & ((j <= i) if causal else True)
        return torch.stack([j[keep], i.expand_as(j)[keep]])

    return packed(n, single, device)
