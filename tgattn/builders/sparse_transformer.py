"""The two factorized patterns of the Sparse Transformer: ``strided`` and ``fixed``."""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import Sizes, check_count, packed, sort_unique
from .local import block_local, offsets_band


def strided(n: Sizes, stride: int, *, causal: bool = False, device=None) -> Tensor:
    """Strided attention: the last ``stride`` tokens, plus every ``stride``-th token before them.

    Child et al. (2019), section 4.2, use two heads (or layers): ``A(1)_i = {j : i - l <= j <= i}``
    and ``A(2)_i = {j : (i - j) mod l = 0}`` with ``l = stride``, both causal. This builder
    is their union (the "merged head"). Rows = queries i, columns = keys j; rule with
    ``causal=True`` (the paper's): ``0 <= i - j <= stride or (j <= i and (i - j) % stride == 0)``;
    with ``causal=False`` (default, as in every builder) the same rule on ``|i - j|``:
    ``|i - j| <= stride or (i - j) % stride == 0``. For one factor alone use
    ``window(n, stride, causal=True)`` and ``dilated(n, n, stride, causal=True)``.

    Edges: ``|window| + sum_i #{j : |i - j| > stride, (i - j) % stride == 0}``; about
    ``n (2 stride + 1) + n**2 / stride`` (causal: half), so ``O(n sqrt n)`` at ``stride = sqrt n``.
    Child et al., "Generating Long Sequences with Sparse Transformers", 2019.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        stride: ``l >= 1``.
        causal: keep only keys ``j <= i`` (the paper's setting).
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(strided(7, 2, causal=True)))
        x . . . . . .
        x x . . . . .
        x x x . . . .
        . x x x . . .
        x . x x x . .
        . x . x x x .
        x . x . x x x
        >>> strided(7, 2, causal=True).shape[1]
        22
    """
    stride = check_count("stride", stride, 1)

    def single(length: int) -> Tensor:
        reach = max(length - 1, 0)
        local = torch.arange(-stride, 1 if causal else stride + 1)
        far = torch.arange(-(reach // stride), 1 if causal else reach // stride + 1) * stride
        return sort_unique(torch.cat([offsets_band(length, local), offsets_band(length, far)], dim=1), length)

    return packed(n, single, device)


def fixed(n: Sizes, block: int, c: int, *, causal: bool = False, device=None) -> Tensor:
    """Fixed attention: attend within your block, and to the last ``c`` tokens of every block.

    Child et al. (2019), section 4.2: ``A(1)_i = {j : floor(j / l) = floor(i / l)}`` and
    ``A(2)_i = {j : j mod l in {l - c, ..., l - 1}}`` with ``l = block``; the "summary"
    tokens at the end of each block carry information across blocks. This builder is the
    union; the paper's patterns are causal (``causal=True``: also ``j <= i``), the default
    ``causal=False`` is the bidirectional version. Rows = queries i, columns = keys j; rule:
    ``i // block == j // block or j % block >= block - c``.

    Edges (``causal=False``, ``n`` a multiple of ``block``, ``b = n / block`` blocks):
    ``b block**2 + b (b - 1) block c`` (each query also sees the ``c`` summaries of the
    ``b - 1`` other blocks), i.e. ``O(n**2 c / block)``.
    Child et al., "Generating Long Sequences with Sparse Transformers", 2019.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        block: block size ``l >= 1``.
        c: summary tokens per block, ``0 <= c <= block`` (``c = 0`` is :func:`block_local`).
        causal: keep only keys ``j <= i`` (the paper's setting).
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(fixed(6, 3, 1, causal=True)))
        x . . . . .
        x x . . . .
        x x x . . .
        . . x x . .
        . . x x x .
        . . x x x x
        >>> fixed(6, 3, 1).shape[1] == 2 * 3**2 + 2 * 1 * 3 * 1
        True
    """
    block = check_count("block", block, 1)
    c = check_count("c", c)
    if c > block:
        raise ValueError(f"c must be <= block = {block} (got {c})")

    def single(length: int) -> Tensor:
        summaries = torch.arange(length)
        summaries = summaries[summaries % block >= block - c]  # [S]
        i = torch.arange(length)
        to_summaries = torch.stack([summaries.repeat(length), i.repeat_interleave(summaries.numel())])
        edges = torch.cat([block_local(length, block), to_summaries], dim=1)
        if causal:
            edges = edges[:, edges[0] <= edges[1]]
        return sort_unique(edges, length)

    return packed(n, single, device)
