"""Tile backend: row-blocked dense tiles for banded and block-structured edge sets.

Queries are cut into blocks of ``B`` consecutive rows. Each block meets ``C`` key columns
(padded to the widest block); the engine runs dense GEMMs on the ``[B, C]`` tiles, one head
at a time (several heads per step) in a head-major layout, and masks the cells that are not edges with ``-inf``.
Two layouts give the columns of a block:

* **band**: every edge has ``lo <= j - i <= hi``, so block b meets the keys
  ``b B + lo .. b B + B - 1 + hi``. Tiles are strided views of the keys (no gather) and key
  gradients are an overlap-add of ``C / B`` slices (no scatter). A window of radius w has
  ``C = B + 2w``: dense-GEMM speed at about ``(B + 2w) / (2w + 1)`` times the exact work.
* **union**: block b meets the sorted distinct keys of its edges (block-sparse sets:
  BigBird, packed batches of unequal lengths); tiles gather those keys.

Blocks run a chunk at a time, and the backward pass recomputes scores from ``q``, ``k`` and
the saved log-sum-exp (as FlashAttention does; Dao et al., 2022), so memory stays
O(N·H·d + E·H): no ``[E, H, d]`` tensor, no weights kept from forward to backward.
Exact for any edge order and for bias (``-inf`` included); duplicated edges go to CSR.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from .analysis import Structure, row_spans
from .csr import recompute_exact
from .recompute import all_finite, recompute_grads

BLOCKS = (32, 64, 128)  # candidate query rows per tile
CHUNK_CELLS = 1 << 21  # tile cells per step (all heads): bounds the working set to ~8 MB per buffer
MIN_FILL = 1 / 64  # below this fraction of edge cells no tile layout is built


@dataclass
class TileLayout:
    """Where each sorted edge sits in the tiles of one structure.

    Attributes:
        block: rows per tile ``B``.
        width: columns per tile ``C``.
        mask: ``[nb, B, C]``, True where a cell is an edge.
        cell: flat cell ``b * B * C + r * C + c`` of each sorted edge ``[E]``.
        offset: band layout: block b's columns start at key ``b * B + offset``; else ``None``.
        cols: union layout: key of each tile column ``[nb, C]`` (padding repeats key 0).
    """

    block: int
    width: int
    mask: Tensor
    cell: Tensor
    offset: Optional[int] = None
    cols: Optional[Tensor] = None
    cache: dict = field(default_factory=dict, repr=False)

    @property
    def fill(self) -> float:
        return self.cell.numel() / max(self.mask.numel(), 1)


def _layout(s: Structure, block: int, width: int, pos: Tensor, **where) -> TileLayout:
    nb = -(-s.n_q // block)
    cell = (s.dst // block) * block * width + (s.dst % block) * width + pos  # [E]
    mask = torch.zeros(nb * block * width, dtype=torch.bool, device=s.dst.device)
    mask[cell] = True
    return TileLayout(block, width, mask.view(nb, block, width), cell, **where)


def _too_sparse(s: Structure, block: int, width: int) -> bool:
    return -(-s.n_q // block) * block * width * MIN_FILL > s.num_edges


def band_layout(s: Structure, block: int) -> Optional[TileLayout]:
    """Tiles at a fixed offset from the diagonal (``C`` a multiple of ``B``); ``None`` if too sparse."""
    lo, hi = _band_range(s)
    width = _band_width(block, lo, hi)
    if _too_sparse(s, block, width):
        return None
    pos = s.src - s.dst + s.dst % block - lo  # [E]
    return _layout(s, block, width, pos, offset=lo)


def union_layout(s: Structure, block: int) -> Optional[TileLayout]:
    """Tiles over the distinct keys of each block; ``None`` if too sparse."""
    nb = -(-s.n_q // block)
    blk = s.dst // block
    key, inv = torch.unique(blk * s.n_k + s.src, return_inverse=True)  # sorted (block, key) pairs
    ublk, ucol = key // s.n_k, key % s.n_k
    counts = torch.bincount(ublk, minlength=nb)
    if _too_sparse(s, block, int(counts.max())):
        return None
    pos = torch.arange(key.numel(), device=key.device) - (torch.cumsum(counts, 0) - counts)[ublk]
    cols = torch.zeros(nb, int(counts.max()), dtype=torch.long, device=key.device)
    cols[ublk, pos] = ucol
    return _layout(s, block, cols.shape[1], pos[inv], cols=cols)


def _cost(cells: int, block: int) -> float:
    # Cells to compute, with a penalty for thin GEMMs (measured: B = 32 runs ~1.3x slower per cell than 128).
    return cells * (1.0 + 12.0 / block)


def _band_range(s: Structure):
    """``(lo, hi)``: the extreme ``j - i`` over the edges (:func:`~tgattn.engine.analysis.row_spans`, cached)."""
    return row_spans(s)[:2]


def _band_width(block: int, lo: int, hi: int) -> int:
    return -(-(block + hi - lo) // block) * block  # C, a multiple of B


def fill_bound(s: Structure, threshold: float = 0.0) -> float:
    """The fill of the layout :func:`tile_layout` would return, or an upper bound on it, without
    laying out a tile (cached).

    A band layout's shape (and so its fill and cost) follows from the extreme ``j - i``
    alone, so when a band layout will be chosen (some band is at least half full) its fill is
    exact. Otherwise a union layout's tiles are as wide as the most distinct keys that one
    block of rows meets, over at least ``n_q`` rows: at least the largest row degree (O(1)
    from the analysis), and at least the distinct keys of the rows sampled by
    :func:`_sampled_width` (a few blocks; O(their edges + n_k)), which is what tells a scattered
    set whose rows all have k keys (top-k, a learned selection: tiles 4 % full) from a dense-ish
    one. The sample runs only when the O(1) bound reaches ``threshold`` (it settles the
    comparison otherwise). Dispatch asks this first, so that sets the tiles would not run
    (scattered sets, windows below the measured threshold) never pay for a layout.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> s = analyse(builders.window(512, 16), 512, 512)
        >>> fill_bound(s) == tile_layout(s).fill
        True
        >>> s = analyse(builders.random(512, 16, generator=torch.Generator().manual_seed(0)), 512, 512)
        >>> round(fill_bound(s), 3), round(tile_layout(s).fill, 3)  # 16 scattered keys per row
        (0.048, 0.048)
    """
    if "fill_bound" in s.extras:
        return s.extras["fill_bound"]
    if "fill_bound_rows" not in s.extras:
        s.extras["fill_bound_rows"] = _row_bound(s)
    bound, union = s.extras["fill_bound_rows"]
    if union is None or bound < threshold:  # exact (a band layout), or settled
        return bound
    width = _sampled_width(s)
    s.extras["fill_bound"] = max([min(1.0, s.num_edges / (s.n_q * width))] + union)
    return s.extras["fill_bound"]


def _row_bound(s: Structure):
    """``(bound, union)`` from O(1) facts of the analysis: the exact fill of the band layout
    :func:`tile_layout` picks (``union`` is ``None``), or an upper bound from the largest row
    degree and ``union``, the fills of the band layouts that are not too sparse."""
    if not (s.num_edges and s.n_q):
        return 0.0, None
    lo, hi = _band_range(s)
    bands = []  # (cost, fill) of each band layout that is not too sparse
    for block in BLOCKS:
        width = _band_width(block, lo, hi)
        if not _too_sparse(s, block, width):
            cells = -(-s.n_q // block) * block * width
            bands.append((_cost(cells, block), s.num_edges / cells))
    if bands and max(fill for _, fill in bands) >= 0.5:
        return min(bands)[1], None  # the band layout tile_layout picks
    union = [fill for _, fill in bands]
    return min(1.0, max([s.num_edges / (s.n_q * row_spans(s)[2])] + union)), union


SAMPLE_BLOCKS = 8  # row blocks whose distinct keys fill_bound counts
SAMPLE_EDGES = 1 << 15  # edges it reads from them at most


def _sampled_width(s: Structure) -> int:
    """A lower bound on the width of every union layout: the most distinct keys among the
    first edges (``SAMPLE_EDGES`` in all) of the ``SAMPLE_BLOCKS`` blocks of ``BLOCKS[0]``
    rows with the most edges, at least the largest row degree.

    A block of ``BLOCKS[0]`` rows lies inside one block of every block size (sizes are its
    multiples), and a part of a block's edges meets no more keys than the block, so the count
    bounds every layout's width from below. Counted by marking keys in ``[blocks, n_k]``
    booleans (fewer blocks when ``n_k`` is large against E: O(E + n_k) at most).
    """
    B = BLOCKS[0]
    width = row_spans(s)[2]
    ptr = s.rowptr[::B]  # [nb + 1] where B divides n_q
    if s.n_q % B:
        ptr = torch.cat([ptr, s.rowptr[-1:]])  # the end of the last, partial block
    sizes = ptr[1:] - ptr[:-1]  # [nb] edges per block
    blocks = max(1, min(SAMPLE_BLOCKS, sizes.numel(), s.num_edges // max(s.n_k, 1)))
    top = torch.topk(sizes, blocks).indices
    cap = SAMPLE_EDGES // blocks
    starts, counts = ptr[top].long(), sizes[top].long().clamp_(max=cap)
    # Edge positions of the sample, block after block, and the block each belongs to.
    slot = torch.repeat_interleave(torch.arange(blocks, device=ptr.device), counts)
    offset = torch.cumsum(counts, 0) - counts
    pos = starts[slot] + torch.arange(slot.numel(), device=ptr.device) - offset[slot]
    seen = torch.zeros(blocks * s.n_k, dtype=torch.bool, device=ptr.device)
    seen[slot * s.n_k + s.src[pos]] = True
    return max(width, int(seen.view(blocks, s.n_k).sum(1).max()))


def tile_layout(s: Structure) -> Optional[TileLayout]:
    """The cheapest (cached) tile layout of a structure with at least one edge.

    ``None`` when every layout would be less than ``MIN_FILL`` full (e.g. a few global tokens
    make every block span all keys): such sets never allocate tiles.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> lay = tile_layout(analyse(builders.window(512, 16), 512, 512))
        >>> lay.offset, lay.block, lay.width
        (-16, 32, 64)
    """
    if "tiles" not in s.extras:
        layouts = [lay for lay in (band_layout(s, b) for b in BLOCKS) if lay is not None]
        if not layouts or max(lay.fill for lay in layouts) < 0.5:
            layouts += [lay for lay in (union_layout(s, b) for b in BLOCKS) if lay is not None]
        s.extras["tiles"] = min(layouts, key=lambda lay: _cost(lay.mask.numel(), lay.block)) if layouts else None
    return s.extras["tiles"]


class _Keys:
    """Keys (or values) ``x [N, H, d]`` in head-major tiles: ``window`` reads, ``add`` accumulates."""

    def __init__(self, n: int, h: int, d: int, like: Tensor, lay: TileLayout, nb: int, *, zero: bool):
        self.n, self.h, self.d = n, h, d
        self.lay, self.nb = lay, nb
        if lay.offset is None:
            self.buf = (like.new_zeros if zero else like.new_empty)(h, n, d)  # [H, N, d]
            return
        # Head h's keys sit at rows pad + h * S; windows may run into padding or the next head
        # (those cells are masked). S >= N keeps the heads apart on one flat row axis.
        B, C = lay.block, lay.width
        self.stride = S = max(nb * B, -(-n // B) * B)
        self.pad = max(0, -lay.offset)
        self.start = self.pad + lay.offset
        rows = max(self.pad + h * S, self.start + (h * S // B - 1) * B + C)
        if zero:
            self.buf = like.new_zeros(rows, d)
            return
        # Only the padding needs zeros (masked cells multiply it by 0, so it must be finite).
        self.buf = like.new_empty(rows, d)
        self.buf[: self.pad].zero_()
        self.buf[self.pad + h * S :].zero_()
        self.heads()[:, n:].zero_()

    @classmethod
    def of(cls, x: Tensor, lay: TileLayout, nb: int) -> "_Keys":
        """Tiles holding ``x [N, H, d]``."""
        keys = cls(*x.shape, like=x, lay=lay, nb=nb, zero=False)
        keys.heads()[:, : x.shape[0]] = x.transpose(0, 1)
        return keys

    def heads(self) -> Tensor:
        """The ``[H, S, d]`` head-major view of the buffer (``S >= N`` rows per head)."""
        if self.lay.offset is None:
            return self.buf
        return self.buf[self.pad : self.pad + self.h * self.stride].view(self.h, self.stride, self.d)

    def window(self, h0: int, h1: int, b0: int, b1: int) -> Tensor:
        """``[hc, c, C, d]`` keys of heads ``h0..h1``, blocks ``b0..b1``."""
        lay = self.lay
        if lay.offset is None:
            return self.buf[h0:h1][:, lay.cols[b0:b1]]
        B, C, d = lay.block, lay.width, self.d
        first = self.start + h0 * self.stride + b0 * B
        return self.buf.as_strided((h1 - h0, b1 - b0, C, d), (self.stride * d, B * d, d, 1), first * d)

    def add(self, h0: int, h1: int, b0: int, b1: int, g: Tensor) -> None:
        """Accumulate ``g [hc, c, C, d]`` (gradients of ``window(h0, h1, b0, b1)``) into the keys."""
        lay, d = self.lay, self.d
        if lay.offset is None:
            self.buf[h0:h1].index_add_(1, lay.cols[b0:b1].reshape(-1), g.reshape(h1 - h0, -1, d))
            return
        B = lay.block
        first = self.start + h0 * self.stride + b0 * B
        shape, strides = (h1 - h0, b1 - b0, B, d), (self.stride * d, B * d, d, 1)
        for part in range(lay.width // B):  # overlap-add: slice `part` of the windows never overlaps itself
            rows = self.buf.as_strided(shape, strides, (first + part * B) * d)
            rows.add_(g[:, :, part * B : (part + 1) * B])

    def result(self) -> Tensor:
        """The accumulated ``[N, H, d]``."""
        return self.heads()[:, : self.n].transpose(0, 1)


def _rows(x: Tensor, nb: int, B: int) -> Tensor:
    """``[N, H, d]`` -> zero-padded head-major blocks ``[H, nb, B, d]``."""
    out = x.new_empty(x.shape[1], nb * B, x.shape[2])
    out[:, : x.shape[0]] = x.transpose(0, 1)
    out[:, x.shape[0] :].zero_()
    return out.view(x.shape[1], nb, B, x.shape[2])


def _steps(s: Structure, lay: TileLayout, heads: int):
    """Chunks ``(h0, h1, b0, b1, e0, e1)``: several whole heads, or blocks of one head."""
    nb, B, C = lay.mask.shape
    per_head = nb * B * C
    if per_head <= CHUNK_CELLS:
        step = CHUNK_CELLS // per_head
        for h0 in range(0, heads, step):
            yield h0, min(heads, h0 + step), 0, nb, 0, s.num_edges
        return
    step = max(1, CHUNK_CELLS // (B * C))
    for h in range(heads):
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            yield h, h + 1, b0, b1, int(s.rowptr[min(b0 * B, s.n_q)]), int(s.rowptr[min(b1 * B, s.n_q)])


def _additive_mask(lay: TileLayout, like: Tensor) -> Tensor:
    """``[nb, B, C]``: 0 on edge cells, ``-inf`` elsewhere (cached per dtype)."""
    key = ("additive", like.dtype)
    if key not in lay.cache:
        lay.cache[key] = torch.zeros(lay.mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
            ~lay.mask, float("-inf")
        )
    return lay.cache[key]


def _scores(qs: Tensor, kc: Tensor, bias: Optional[Tensor], lay: TileLayout, h0, h1, b0, b1, e0, e1) -> Tensor:
    """Masked scores ``[hc, c, B, C]`` = ``(scale q) k^T + (bias or mask)`` of one chunk."""
    scores = torch.matmul(qs, kc.transpose(-1, -2))  # [hc, c, B, C]
    if bias is None:
        return scores.add_(_additive_mask(lay, qs)[b0:b1])
    B, C = lay.block, lay.width
    base = qs.new_full((h1 - h0, (b1 - b0) * B * C), float("-inf"))
    cols = bias[e0:e1, h0:h1] if bias.shape[1] > 1 else bias[e0:e1, :1]  # [e, hc or 1]
    base[:, lay.cell[e0:e1] - b0 * B * C] = cols.T
    return scores.add_(base.view(h1 - h0, b1 - b0, B, C))


class TileAttention(torch.autograd.Function):
    """Attention over the tiles of ``lay``; returns ``out [n_q, H, dv]``."""

    @staticmethod
    def forward(ctx, q, k, v, bias, s: Structure, lay: TileLayout, scale: float):
        nb, B, C = lay.mask.shape
        heads, dv = q.shape[1], v.shape[2]
        qs = _rows(q, nb, B).mul_(scale)  # [H, nb, B, d], scaled once
        keys, values = _Keys.of(k, lay, nb), _Keys.of(v, lay, nb)
        out = q.new_empty(heads, nb, B, dv)
        lse = q.new_empty(heads, nb, B, 1)
        for h0, h1, b0, b1, e0, e1 in _steps(s, lay, heads):
            scores = _scores(qs[h0:h1, b0:b1], keys.window(h0, h1, b0, b1), bias, lay, h0, h1, b0, b1, e0, e1)
            m = scores.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            probs = torch.exp_(scores.sub_(m))  # [hc, c, B, C], unnormalised
            denom = probs.sum(-1, keepdim=True)
            o = torch.matmul(probs, values.window(h0, h1, b0, b1))  # [hc, c, B, dv]
            out[h0:h1, b0:b1] = o.div_(torch.where(denom > 0, denom, torch.ones_like(denom)))
            lse[h0:h1, b0:b1] = m + torch.log(denom)  # empty rows: -inf
        out = out.view(heads, nb * B, dv)[:, : s.n_q].transpose(0, 1)  # [n_q, H, dv]
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.s, ctx.lay, ctx.scale = s, lay, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        s, lay, scale = ctx.s, ctx.lay, ctx.scale
        if torch.is_grad_enabled() or not all_finite(grad_out):
            # A double backward, or a NaN / inf upstream gradient that the masked cells of the
            # tiles would spread to keys outside each query's edges (0 * nan): edge-wise recompute.
            exact = recompute_exact(s, scale, create_graph=torch.is_grad_enabled())
            grads = recompute_grads(exact, (q, k, v, bias), (grad_out,), ctx.needs_input_grad[:4])
            return (*grads, None, None, None)
        nb, B, C = lay.mask.shape
        heads = q.shape[1]
        qs, gob = _rows(q, nb, B).mul_(scale), _rows(grad_out, nb, B)  # [H, nb, B, d]
        delta = _rows((grad_out * out).sum(-1, keepdim=True), nb, B)  # [H, nb, B, 1]
        # Empty rows have lse = -inf: shift them by +inf so that all their probabilities are 0.
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))
        keys, values = _Keys.of(k, lay, nb), _Keys.of(v, lay, nb)
        grad_keys = _Keys(*k.shape, like=k, lay=lay, nb=nb, zero=True)
        grad_values = _Keys(*v.shape, like=v, lay=lay, nb=nb, zero=True)
        grad_q = torch.empty_like(qs)
        grad_bias = None if bias is None else torch.zeros_like(bias)
        for h0, h1, b0, b1, e0, e1 in _steps(s, lay, heads):
            kc, vc = keys.window(h0, h1, b0, b1), values.window(h0, h1, b0, b1)  # [hc, c, C, d | dv]
            q_c, go_c = qs[h0:h1, b0:b1], gob[h0:h1, b0:b1]
            scores = _scores(q_c, kc, bias, lay, h0, h1, b0, b1, e0, e1)
            probs = torch.exp_(scores.sub_(lse[h0:h1, b0:b1]))  # [hc, c, B, C]
            grad_values.add(h0, h1, b0, b1, torch.matmul(probs.transpose(-1, -2), go_c))
            d_probs = torch.matmul(go_c, vc.transpose(-1, -2))  # [hc, c, B, C]
            d_scores = probs.mul_(d_probs.sub_(delta[h0:h1, b0:b1]))  # [hc, c, B, C]
            grad_q[h0:h1, b0:b1] = torch.matmul(d_scores, kc).mul_(scale)
            grad_keys.add(h0, h1, b0, b1, torch.matmul(d_scores.transpose(-1, -2), q_c))
            if grad_bias is not None:
                cells = d_scores.reshape(h1 - h0, -1)[:, lay.cell[e0:e1] - b0 * B * C]  # [hc, e]
                if bias.shape[1] > 1:
                    grad_bias[e0:e1, h0:h1] += cells.T
                else:
                    grad_bias[e0:e1, 0] += cells.sum(0)
        grad_q = grad_q.view(heads, nb * B, -1)[:, : s.n_q].transpose(0, 1)
        return grad_q, grad_keys.result(), grad_values.result(), grad_bias, None, None, None


def tile_attention(q, k, v, s: Structure, bias: Optional[Tensor], scale: float) -> Tensor:
    """Run :class:`TileAttention`; ``bias`` is ``[E, 1 or H]`` in sorted edge order.

    ``s`` must have a tile layout (:func:`tile_layout` is not ``None``).
    """
    return TileAttention.apply(q, k, v, bias, s, tile_layout(s), scale)
