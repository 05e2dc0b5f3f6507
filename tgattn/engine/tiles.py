"""Tile backend: row-blocked dense tiles for banded and block-structured edge sets.

Queries are cut into blocks of ``B`` consecutive rows. For each block the engine lists the
union of the key columns its edges touch (``C`` columns, padded to the widest block), runs
dense GEMMs on the ``[B, C]`` tile, and masks the cells that are not edges with ``-inf``.
A sliding window of radius w gives ``C = B + 2w``: dense-GEMM speed at ``(B + 2w) / (2w + 1)``
times the exact work. Blocks are processed a chunk at a time, and the backward pass
recomputes scores from ``q``, ``k`` and the saved log-sum-exp (as FlashAttention does,
Dao et al., 2022), so memory stays O(N·H·d + E·H): no ``[E, H, d]`` tensor, no ``[E, H]``
weights kept between forward and backward.

Exact for sorted or unsorted edges and for bias (including ``-inf``); duplicated edges are
left to the CSR backend.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from .analysis import Structure

BLOCK = 64  # query rows per tile
CHUNK_CELLS = 1 << 20  # tile cells (x heads) per chunk: bounds the working set of one step


@dataclass
class TileLayout:
    """Where each edge sits in the tiles of one structure.

    Attributes:
        block: rows per tile ``B``.
        cols: key column of each tile column ``[nb, C]`` (padding repeats a valid column).
        cell: flat tile cell ``b * B * C + r * C + c`` of each sorted edge ``[E]``.
        mask: ``[nb, B, C]`` True where a cell is an edge.
    """

    block: int
    cols: Tensor
    cell: Tensor
    mask: Tensor

    @property
    def width(self) -> int:
        return self.cols.shape[1]

    @property
    def fill(self) -> float:
        return self.cell.numel() / max(self.mask.numel(), 1)


def _interval_columns(s: Structure, blk: Tensor, nb: int):
    """Banded rows: each block's columns are the hull ``[min lo, max hi]`` of its rows."""
    first = torch.full((nb,), s.n_k, dtype=torch.long).scatter_reduce_(0, blk, s.src, "amin")
    last = torch.full((nb,), -1, dtype=torch.long).scatter_reduce_(0, blk, s.src, "amax")
    first = torch.where(last >= 0, first, torch.zeros_like(first))
    width = int((last - first).max()) + 1
    cols = (first.unsqueeze(1) + torch.arange(width)).clamp_(max=s.n_k - 1)  # [nb, C]
    return cols, s.src - first[blk]


def _union_columns(s: Structure, blk: Tensor, nb: int):
    """General sets: each block's columns are the sorted distinct keys of its edges."""
    key, inv = torch.unique(blk * s.n_k + s.src, return_inverse=True)  # sorted (block, key) pairs
    ublk, ucol = key // s.n_k, key % s.n_k
    counts = torch.bincount(ublk, minlength=nb)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(key.numel()) - start[ublk]
    cols = torch.zeros(nb, int(counts.max()), dtype=torch.long)
    cols[ublk, pos] = ucol
    return cols, pos[inv]


def tile_layout(s: Structure, block: int = BLOCK) -> TileLayout:
    """The (cached) tile layout of a structure with at least one edge.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> lay = tile_layout(analyse(builders.window(256, 16), 256, 256), block=32)
        >>> lay.width, round(lay.fill, 2)
        (64, 0.5)
    """
    key = ("tiles", block)
    if key not in s.extras:
        nb = -(-s.n_q // block)
        blk = s.dst // block
        make = _interval_columns if s.intervals else _union_columns
        cols, pos = make(s, blk, nb)
        width = cols.shape[1]
        cell = blk * block * width + (s.dst % block) * width + pos  # [E]
        mask = torch.zeros(nb * block * width, dtype=torch.bool)
        mask[cell] = True
        s.extras[key] = TileLayout(block, cols, cell, mask.view(nb, block, width))
    return s.extras[key]


def _chunks(lay: TileLayout, s: Structure, heads: int):
    nb, B, C = lay.mask.shape
    step = max(1, CHUNK_CELLS // (B * C * heads))
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        e0, e1 = int(s.rowptr[min(b0 * B, s.n_q)]), int(s.rowptr[min(b1 * B, s.n_q)])
        yield b0, b1, e0, e1


def _scores(q4, k, bias, lay, s, scale, b0, b1, e0, e1):
    """Masked scores ``[c, H, B, C]`` and the gathered keys ``[c, H, C, d]`` of blocks b0..b1."""
    B, C = lay.block, lay.width
    kc = k[lay.cols[b0:b1]].permute(0, 2, 1, 3)  # [c, H, C, d]
    scores = torch.matmul(q4[b0:b1], kc.transpose(-1, -2)) * scale  # [c, H, B, C]
    if bias is None:
        scores.masked_fill_(~lay.mask[b0:b1].unsqueeze(1), float("-inf"))
    else:
        cells = scores.new_full(((b1 - b0) * B * C, bias.shape[1]), float("-inf"))
        cells[lay.cell[e0:e1] - b0 * B * C] = bias[e0:e1]
        scores += cells.view(b1 - b0, B, C, -1).permute(0, 3, 1, 2)
    return scores, kc


def _blocked(x: Tensor, nb: int, B: int) -> Tensor:
    """``[N, H, d]`` -> zero-padded ``[nb, H, B, d]``."""
    pad = x.new_zeros(nb * B - x.shape[0], *x.shape[1:])
    return torch.cat([x, pad]).view(nb, B, *x.shape[1:]).transpose(1, 2)


class TileAttention(torch.autograd.Function):
    """Attention over the tiles of ``lay``; returns ``out [n_q, H, dv]``."""

    @staticmethod
    def forward(ctx, q, k, v, bias, s: Structure, lay: TileLayout, scale: float):
        nb, B, C = lay.mask.shape
        h, dv = q.shape[1], v.shape[2]
        q4 = _blocked(q, nb, B)  # [nb, H, B, d]
        out4 = q.new_empty(nb, h, B, dv)
        lse = q.new_empty(nb, h, B)
        for b0, b1, e0, e1 in _chunks(lay, s, h):
            scores, _ = _scores(q4, k, bias, lay, s, scale, b0, b1, e0, e1)
            m = scores.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            probs = torch.exp_(scores.sub_(m))  # [c, H, B, C], unnormalised
            denom = probs.sum(-1, keepdim=True)
            vc = v[lay.cols[b0:b1]].permute(0, 2, 1, 3)  # [c, H, C, dv]
            out4[b0:b1] = torch.matmul(probs, vc) / torch.where(denom > 0, denom, torch.ones_like(denom))
            lse[b0:b1] = (m + torch.log(denom)).squeeze(-1)  # +inf-free: empty rows give -inf
        out = out4.transpose(1, 2).reshape(nb * B, h, dv)[: s.n_q]
        ctx.save_for_backward(q, k, v, bias, out, lse)
        ctx.s, ctx.lay, ctx.scale = s, lay, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, bias, out, lse = ctx.saved_tensors
        s, lay, scale = ctx.s, ctx.lay, ctx.scale
        nb, B, C = lay.mask.shape
        h = q.shape[1]
        q4, go4 = _blocked(q, nb, B), _blocked(grad_out, nb, B)  # [nb, H, B, d]
        delta = (grad_out * out).sum(-1)  # [n_q, H]
        delta4 = _blocked(delta.unsqueeze(-1), nb, B)  # [nb, H, B, 1]
        # Empty rows have lse = -inf: shift them by +inf so that every probability is 0.
        lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf"))).unsqueeze(-1)
        grad_q4 = torch.empty_like(q4)
        grad_k, grad_v = torch.zeros_like(k), torch.zeros_like(v)
        grad_bias = None if bias is None else torch.empty_like(bias)
        for b0, b1, e0, e1 in _chunks(lay, s, h):
            scores, kc = _scores(q4, k, bias, lay, s, scale, b0, b1, e0, e1)
            probs = torch.exp_(scores.sub_(lse[b0:b1]))  # [c, H, B, C]
            vc = v[lay.cols[b0:b1]].permute(0, 2, 1, 3)  # [c, H, C, dv]
            cols = lay.cols[b0:b1].reshape(-1)  # [c * C]
            gv = torch.matmul(probs.transpose(-1, -2), go4[b0:b1])  # [c, H, C, dv]
            grad_v.index_add_(0, cols, gv.transpose(1, 2).reshape(-1, h, v.shape[2]))
            d_probs = torch.matmul(go4[b0:b1], vc.transpose(-1, -2))  # [c, H, B, C]
            d_scores = probs.mul_(d_probs.sub_(delta4[b0:b1]))  # [c, H, B, C]
            grad_q4[b0:b1] = torch.matmul(d_scores, kc) * scale
            gk = torch.matmul(d_scores.transpose(-1, -2), q4[b0:b1]) * scale  # [c, H, C, d]
            grad_k.index_add_(0, cols, gk.transpose(1, 2).reshape(-1, h, k.shape[2]))
            if grad_bias is not None:
                cells = d_scores.permute(0, 2, 3, 1).reshape(-1, h)[lay.cell[e0:e1] - b0 * B * C]  # [e, H]
                grad_bias[e0:e1] = cells if bias.shape[1] == h else cells.sum(1, keepdim=True)
        grad_q = grad_q4.transpose(1, 2).reshape(nb * B, h, -1)[: s.n_q]
        return grad_q, grad_k, grad_v, grad_bias, None, None, None


def tile_attention(q, k, v, s: Structure, bias: Optional[Tensor], scale: float, *, block: int = BLOCK) -> Tensor:
    """Run :class:`TileAttention`; ``bias`` is ``[E, 1 or H]`` in sorted edge order."""
    return TileAttention.apply(q, k, v, bias, s, tile_layout(s, block), scale)
