"""Attention patterns of a decoder, named in :class:`GPTConfig` and built by :mod:`tgattn.builders`.

A pattern is a function ``lengths -> edge_index`` (a packed batch of sequences becomes one
block-diagonal edge set). Every pattern here is causal (keys ``j <= i``) and gives each token
its own position as a key, so no query is ever left without a key.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from .. import builders
from .config import PATTERNS

Pattern = Callable[[Sequence[int]], Tensor]


def make_pattern(config) -> Pattern:
    """The causal edge-set builder named by ``config.pattern``, with its options from ``config``.

    * ``"causal"``: ``j <= i`` (the GPT mask).
    * ``"window"``: ``0 <= i - j <= config.window`` (``window + 1`` keys per query).
    * ``"dilated"``: every ``config.dilation``-th key back to ``window * dilation``.
    * ``"bigbird"``: window + the first ``config.num_global`` tokens + ``config.num_random``
      random earlier keys per query, drawn once from ``config.pattern_seed``.

    Example:
        >>> from tgattn.models import GPTConfig
        >>> from tgattn.builders import draw
        >>> print(draw(make_pattern(GPTConfig(pattern="window", window=1))([4])))
        x . . .
        x x . .
        . x x .
        . . x x
    """
    name = config.pattern
    if name == "causal":
        return lambda lengths: builders.causal(list(lengths))
    if name == "window":
        return lambda lengths: builders.window(list(lengths), config.window, causal=True)
    if name == "dilated":
        dilated = _builder("dilated")
        return lambda lengths: dilated(list(lengths), config.window, config.dilation, causal=True)
    if name == "bigbird":
        bigbird = _builder("bigbird")

        def pattern(lengths: Sequence[int]) -> Tensor:
            generator = torch.Generator().manual_seed(config.pattern_seed)
            w, g, r = config.window, config.num_global, config.num_random
            return bigbird(list(lengths), w, g, r, generator=generator, causal=True)

        return pattern
    raise ValueError(f"unknown attention pattern {name!r}; choose one of {PATTERNS}")


def _builder(name: str):
    fn = getattr(builders, name, None)
    if fn is None:
        raise ValueError(f"pattern {name!r} needs tgattn.builders.{name}, which this version of tgattn lacks")
    return fn
