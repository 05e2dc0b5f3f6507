"""Random attention and BigBird (window + global + random), element-wise and seeded."""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ._common import Sizes, as_lengths, band, check_count, packed, sort_unique
from .longformer import global_part


def _sample_keys(lengths: List[int], r: int, generator: Optional[torch.Generator], causal: bool) -> Tensor:
    """Per query i, ``min(r, m_i)`` distinct keys drawn uniformly from its ``m_i`` allowed keys.

    Query i of a sequence of length L (packed: node ids offset by the sequence start) may
    use the keys ``start .. start + m_i - 1`` with ``m_i = L`` (or ``i + 1`` when causal).
    Robert Floyd's subset sampling, run for all queries of all sequences at once: ``r``
    steps, each drawing one uniform number per query, so the cost is ``O(N r**2)``, never
    ``O(N**2)``. Returns edges sorted by (target, source).
    """
    n = sum(lengths)
    if n == 0 or r == 0:
        return torch.empty(2, 0, dtype=torch.long)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    sizes = torch.tensor(lengths)
    start = torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)  # [N] first node of my sequence
    queries = torch.arange(n)
    m = queries - start + 1 if causal else torch.repeat_interleave(sizes, sizes)  # [N] allowed keys
    # Row-major [N, r]: query i uses the numbers i*r .. i*r + r - 1 of the stream, whatever N.
    uniform = torch.rand(n, r, generator=generator, dtype=torch.float64, device=gen_device).cpu()
    chosen = torch.empty(n, r, dtype=torch.long)  # [N, r] offsets in 0 .. m_i - 1
    for step in range(r):
        top = m - r + step  # Floyd: draw from 0..top; on a repeat take top itself
        draw = torch.minimum((uniform[:, step] * (top + 1)).long(), top)
        repeat = (chosen[:, :step] == draw.unsqueeze(1)).any(dim=1)
        chosen[:, step] = torch.where(repeat, top, draw)
    keep = torch.ones(n, r, dtype=torch.bool)
    few = m <= r  # these queries keep all their allowed keys: 0 .. m_i - 1
    chosen[few] = torch.arange(r).expand(int(few.sum()), r)
    keep[few] = torch.arange(r) < m[few].unsqueeze(1)
    keys = chosen + start.unsqueeze(1)  # [N, r] node ids
    return sort_unique(torch.stack([keys[keep], queries.unsqueeze(1).expand(n, r)[keep]]), n)


def _lengths(n: Sizes) -> List[int]:
    lengths = as_lengths(n)
    return [int(n)] if lengths is None else lengths


def random(
    n: Sizes, r: int, *, generator: Optional[torch.Generator] = None, causal: bool = False, device=None
) -> Tensor:
    """Each query attends to ``r`` keys drawn uniformly at random, without repetition.

    Rows = queries i, columns = keys j; rule: ``j in R_i``, a uniform random ``r``-subset of
    the allowed keys (all keys of the sequence, or ``j <= i`` with ``causal=True``; a query
    with fewer than ``r`` allowed keys takes them all). The draw is element-wise (per token,
    not per 64-token block) and deterministic for a given ``generator`` state; each packed
    sequence gets its own draw. With ``causal=True`` and a CPU generator the draw is
    prefix-stable: query i's keys depend only on the seed and i, not on ``n``, so
    ``random(t, r, ...)`` equals the first t rows of ``random(T, r, ...)`` (KV-cache decoding
    sees the pattern it was trained with). Edges: ``n r`` for ``r <= n`` (causal:
    ``n r - r (r - 1) / 2``).
    Zaheer et al., "Big Bird: Transformers for Longer Sequences", NeurIPS 2020 (random part).

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        r: random keys per query, ``>= 0``.
        generator: the ``torch.Generator`` to draw from (default: torch's global one).
        causal: draw only among keys ``j <= i``.
        device: where to put the edges (the draw happens on the generator's device).

    Example:
        >>> from tgattn.builders import draw
        >>> g = torch.Generator().manual_seed(0)
        >>> print(draw(random(6, 2, generator=g, causal=True)))
        x . . . . .
        x x . . . .
        . x x . . .
        x x . . . .
        . x x . . .
        . x x . . .
        >>> random(6, 2, generator=g).shape[1] == 6 * 2
        True
    """
    r = check_count("r", r)
    return _sample_keys(_lengths(n), r, generator, causal).to(device)


def bigbird(
    n: Sizes,
    w: int,
    g: int,
    r: int,
    *,
    generator: Optional[torch.Generator] = None,
    causal: bool = False,
    device=None,
) -> Tensor:
    """BigBird: a sliding window, ``g`` global tokens and ``r`` random keys per query.

    Rows = queries i, columns = keys j; rule: ``|i - j| <= w or i < g or j < g or j in R_i``
    with ``R_i`` as in :func:`random` (``causal=True``: all of it ``and j <= i``, and ``R_i``
    drawn among ``j <= i``). The global tokens are the first ``g`` of each sequence
    (BigBird-ITC). Element-wise, not in 64-token blocks. Random keys are drawn among all
    allowed keys, so some may fall inside the window or on a global token; the union keeps
    one edge, hence the count is a range: ``|window ∪ global| <= E <= |window ∪ global| + n r``.
    Deterministic for a given ``generator`` state: the random part is exactly
    ``random(n, r, generator=..., causal=causal)`` drawn from the same state, so the causal
    pattern is prefix-stable like :func:`random`'s.
    Zaheer et al., "Big Bird: Transformers for Longer Sequences", NeurIPS 2020.

    Args:
        n: sequence length, or the lengths of a packed batch (block-diagonal result).
        w: window radius ``>= 0`` (as in :func:`window`).
        g: number of global tokens ``>= 0`` (the first ``min(g, L)`` of each sequence).
        r: random keys per query ``>= 0``.
        generator: the ``torch.Generator`` to draw from (default: torch's global one).
        causal: keep only keys ``j <= i`` (for decoders).
        device: where to put the edges.

    Example:
        >>> from tgattn.builders import draw
        >>> e = bigbird(6, 1, 1, 0)  # no random keys: window + global, deterministic
        >>> print(draw(e))
        x x x x x x
        x x x . . .
        x x x x . .
        x . x x x .
        x . . x x x
        x . . . x x
        >>> e.shape[1]
        24
        >>> e = bigbird(64, 2, 1, 3, generator=torch.Generator().manual_seed(0), causal=True)
        >>> bool((e[0] <= e[1]).all())
        True
    """
    w, g, r = check_count("w", w), check_count("g", g), check_count("r", r)
    local = packed(n, lambda length: band(length, w, 0 if causal else w))
    first = packed(n, lambda length: global_part(length, torch.arange(min(g, length)), causal))
    lengths = _lengths(n)
    edges = torch.cat([local, first, _sample_keys(lengths, r, generator, causal)], dim=1)
    return sort_unique(edges, sum(lengths)).to(device)
