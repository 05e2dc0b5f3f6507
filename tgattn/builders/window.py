"""Sliding-window (local) attention."""
from __future__ import annotations

from torch import Tensor

from ._common import Sizes, band, check_count, packed


def window(n: Sizes, w: int, *, causal: bool = False, device=None) -> Tensor:
    """Query i attends to the keys at distance at most ``w``: ``|i - j| <= w``.

    ``w`` is the one-sided radius, the query itself included, so an interior query sees
    ``2w + 1`` keys (``w + 1`` with ``causal=True``, rule ``0 <= i - j <= w``). Conventions
    differ between libraries: Longformer's "window 512" is ``w = 256`` here; a causal
    "sliding window of W tokens" (Mistral, FlexAttention's ``q - kv < W``) is ``w = W - 1``.

    Rows = queries i, columns = keys j. Edges: ``n (2w + 1) - w (w + 1)`` for ``w < n``
    (causal: ``n (w + 1) - w (w + 1) / 2``). Beltagy et al., "Longformer", 2020.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        w: window radius, ``>= 0`` (0 = each token sees only itself).
        causal: keep only keys ``j <= i``.
        device: where to build the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> print(draw(window(5, 1)))
        x x . . .
        x x x . .
        . x x x .
        . . x x x
        . . . x x
        >>> window(5, 1).shape[1] == 5 * 3 - 1 * 2
        True
    """
    w = check_count("w", w)
    return packed(n, lambda length: band(length, w, 0 if causal else w), device)
