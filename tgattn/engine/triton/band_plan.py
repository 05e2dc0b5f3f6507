"""The tile plan of a set known by its shape (:class:`~tgattn.engine.bands.Band`: full, causal,
windows, packed documents), from its rows' key ranges instead of its edges.

:func:`plan_band` returns the very :class:`~.tile_plan.TilePlan` that :func:`~.tile_plan.plan_tiles`
makes of the same edges, in O(n + tiles x block_m) work and memory with no tensor of E entries:
a tile's edge count is, over its rows, the overlap of the row's range with the tile's keys; a
partial tile's mask words are each row's range cut to 32 keys; the scattered remainder (tiles
under the break-even) is cut from the same ranges. Causal at n = 65,536 in 64 x 64 tiles: 2.1
billion edges, 528,896 tiles. :func:`plan_structure` plans any analysed set, from its band where
it has one (:func:`~tgattn.engine.bands.band_of`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..analysis import Structure
from ..bands import Band, band_of, row_ranges
from .tile_plan import MIN_FILL, WORD_BITS, TilePlan, _check_blocks, _grouped, _int32_bits, plan_tiles

CHUNK_CELLS = 1 << 20  # (tile, row) pairs counted at once: bounds the planner's temporaries to ~8 MB each


def _blocked(first: Tensor, last: Tensor, n_qb: int, block_m: int, n_k: int) -> Tuple[Tensor, Tensor]:
    """``first``, ``last`` padded to ``[n_qb, block_m]`` with empty rows (first ``n_k``, last -1)."""
    pad = n_qb * block_m - first.numel()
    return (torch.cat([first, first.new_full((pad,), n_k)]).view(n_qb, block_m),
            torch.cat([last, last.new_full((pad,), -1)]).view(n_qb, block_m))


def _overlaps(first: Tensor, last: Tensor, qb: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """``[T, block_m]``: keys of each row of query block ``qb[t]`` within ``lo[t] .. hi[t]``."""
    return (torch.minimum(last[qb], hi[:, None]) - torch.maximum(first[qb], lo[:, None]) + 1).clamp_(min=0)


def _chunks(count: int, block_m: int):
    step = max(1, CHUNK_CELLS // block_m)
    return ((t0, min(count, t0 + step)) for t0 in range(0, count, step))


def _mask_words(first: Tensor, last: Tensor, qb: Tensor, kb: Tensor, block_m: int, block_n: int) -> Tensor:
    """``[P, block_m, words]`` int32: the bits of each partial tile's rows (bit ``c % 32`` of word
    ``c // 32``: key ``c`` of the tile), from each row's range cut to the word's 32 keys."""
    words, top = -(-block_n // WORD_BITS), min(WORD_BITS, block_n) - 1
    parts = []
    for t0, t1 in _chunks(qb.numel(), block_m * words):
        base = kb[t0:t1, None] * block_n + torch.arange(words, device=kb.device) * WORD_BITS  # [p, words]
        lo = (first[qb[t0:t1], :, None] - base[:, None]).clamp_(min=0)  # [p, block_m, words] first bit
        hi = (last[qb[t0:t1], :, None] - base[:, None]).clamp_(max=top)  # last bit
        width = (hi - lo + 1).clamp_(min=0)
        parts.append(_int32_bits(((1 << width) - 1) << lo.clamp_(max=top)))  # (an empty word's lo may be far off)
    return torch.cat(parts) if parts else torch.zeros(0, block_m, words, dtype=torch.int32, device=kb.device)


def _scattered(first: Tensor, last: Tensor, qb: Tensor, kb: Tensor, block_m: int, block_n: int, n_q: int,
               n_kb: int) -> Tuple[Tensor, Tensor]:
    """``(rest_ptr [n_q + 1], rest_col)``: the edges of the tiles ``(qb, kb)`` left to the gather
    kernels as CSR, sorted by (query, key): O(their edges + tiles x block_m)."""
    lo, hi = kb * block_n, kb * block_n + block_n - 1
    x = torch.maximum(first[qb], lo[:, None])  # [R, block_m] first key of each row in its tile
    count = _overlaps(first, last, qb, lo, hi)
    row = qb[:, None] * block_m + torch.arange(block_m, device=qb.device)  # [R, block_m]
    keep = count > 0
    row, x, count, order_key = row[keep], x[keep], count[keep], (row * n_kb + kb[:, None])[keep]
    order = torch.argsort(order_key)  # row segments by (query, key block)
    row, x, count = row[order], x[order], count[order]
    rest_ptr = torch.zeros(n_q + 1, dtype=torch.long, device=qb.device)
    rest_ptr[1:].index_add_(0, row, count)
    rest_ptr.cumsum_(0)
    starts = torch.cumsum(count, 0) - count
    total = int(count.sum())
    rest_col = torch.repeat_interleave(x - starts, count) + torch.arange(total, device=qb.device)
    return rest_ptr, rest_col


def plan_band(band: Band, num_queries: int, num_keys: int, *, block_m: int, block_n: int,
              min_fill: Optional[float] = None, device=None) -> TilePlan:
    """The :class:`~.tile_plan.TilePlan` of ``band``'s edges (what :func:`~.tile_plan.plan_tiles`
    makes of them, field for field), planned from the rows' key ranges: nothing of E entries.

    Example (causal over 8 queries in tiles of 4 x 4, as :func:`~.tile_plan.plan_tiles`'s example)::

        >>> p = plan_band(Band(hi=0), 8, 8, block_m=4, block_n=4, min_fill=0)
        >>> p.n_full, p.n_partial, p.tc_edges, p.q_tile_kb.tolist(), p.masks[1, :2, 0].tolist()
        (1, 2, 36, [0, 0, 1], [1, 3])
    """
    _check_blocks(block_m, block_n)
    min_fill = MIN_FILL if min_fill is None else float(min_fill)
    first, last = row_ranges(band, num_queries, num_keys, device)
    n_edges = int((last - first + 1).clamp(min=0).sum())
    n_qb, n_kb = -(-num_queries // block_m), -(-num_keys // block_n)
    first, last = _blocked(first, last, n_qb, block_m, num_keys)
    dev = first.device

    # Candidate tiles: every key block between a query block's first and last key, in (qb, kb) order.
    kb_lo, kb_hi = first.amin(1) // block_n, last.amax(1) // block_n  # an empty block: kb_hi < kb_lo
    per = (kb_hi - kb_lo + 1).clamp_(min=0)  # [n_qb]
    qb = torch.repeat_interleave(torch.arange(n_qb, device=dev), per)  # [T]
    kb = kb_lo[qb] + torch.arange(qb.numel(), device=dev) - (torch.cumsum(per, 0) - per)[qb]
    edges_per_tile = torch.cat([
        _overlaps(first, last, qb[t0:t1], kb[t0:t1] * block_n, kb[t0:t1] * block_n + block_n - 1).sum(1)
        for t0, t1 in _chunks(qb.numel(), block_m)] or [qb.new_zeros(0)])
    held = edges_per_tile > 0
    qb, kb, edges_per_tile = qb[held], kb[held], edges_per_tile[held]

    cells = block_m * block_n
    on_tc = edges_per_tile >= min_fill * cells  # a band has no duplicated edge
    is_partial = edges_per_tile[on_tc] < cells
    qb_tc, kb_tc = qb[on_tc], kb[on_tc]
    mask_row = torch.full_like(qb_tc, -1)
    mask_row[is_partial] = torch.arange(int(is_partial.sum()), device=dev)
    q_ptr, q_split, q_order = _grouped(qb_tc, is_partial, kb_tc, n_qb, n_kb)
    k_ptr, k_split, k_order = _grouped(kb_tc, is_partial, qb_tc, n_kb, n_qb)
    masks = _mask_words(first, last, qb_tc[is_partial], kb_tc[is_partial], block_m, block_n)
    rest_ptr, rest_col = _scattered(first, last, qb[~on_tc], kb[~on_tc], block_m, block_n, num_queries, n_kb)
    return TilePlan(
        block_m=block_m, block_n=block_n, num_queries=num_queries, num_keys=num_keys, num_edges=n_edges,
        n_full=int((~is_partial).sum()), n_partial=int(is_partial.sum()), tc_edges=n_edges - rest_col.numel(),
        q_ptr=q_ptr, q_split=q_split, q_tile_kb=kb_tc[q_order], q_tile_mask=mask_row[q_order],
        k_ptr=k_ptr, k_split=k_split, k_tile_qb=qb_tc[k_order], k_tile_mask=mask_row[k_order],
        masks=masks, rest_ptr=rest_ptr, rest_col=rest_col,
    )


def plan_structure(s: Structure, *, block_m: int, block_n: int, min_fill: Optional[float] = None) -> TilePlan:
    """The tile plan of an analysed set: from its band where it has one (:func:`plan_band`, O(tiles)
    memory, its edges never read), else from its edges (:func:`~.tile_plan.plan_tiles`).

    Example:
        >>> from tgattn.engine.bands import band_structure
        >>> s = band_structure(Band(hi=0), 16384, 16384)  # causal: 134 million edges, none made
        >>> p = plan_structure(s, block_m=64, block_n=64)
        >>> p.n_full, p.n_partial, p.tc_share, "edges" in s.extras
        (32640, 256, 1.0, False)
    """
    band = band_of(s)
    if band is None:
        return plan_tiles(s.rowptr, s.src, s.n_q, s.n_k, block_m=block_m, block_n=block_n, min_fill=min_fill)
    return plan_band(band, s.n_q, s.n_k, block_m=block_m, block_n=block_n, min_fill=min_fill, device=s.rowptr.device)
