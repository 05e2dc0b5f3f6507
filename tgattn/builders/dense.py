"""Full and causal attention: the two patterns of the original Transformer."""
from __future__ import annotations

import torch
from torch import Tensor

from ._common import Sizes, band, packed


def full(n: Sizes, *, device=None) -> Tensor:
    """Every query attends to every key (of its own sequence), itself included.

    Rows = queries i, columns = keys j; rule: always true. Edges: ``n**2``
    (``sum(L**2)`` for a packed batch). Vaswani et al., "Attention Is All You Need", 2017.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(full([2, 1])))
        x x .
        x x .
        . . x
    """
    return packed(n, lambda length: band(length, length, length), device)


def causal(n: Sizes, *, device=None) -> Tensor:
    """Query i attends to keys ``j <= i`` (autoregressive / decoder masking).

    Rows = queries i, columns = keys j; rule: ``j <= i``. Edges: ``n (n + 1) / 2``.
    Vaswani et al., 2017; the mask of GPT-style decoders.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(causal(4)))
        x . . .
        x x . .
        x x x .
        x x x x
    """
    return packed(n, lambda length: band(length, length, 0), device)
