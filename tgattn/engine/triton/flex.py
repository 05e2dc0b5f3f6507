"""FlexAttention over an analysed edge set, with a ``BlockMask`` built from its CSR structure.

:func:`block_mask` never forms an ``n x n`` mask: it counts the edges of each
``[BLOCK, BLOCK]`` tile (the ``tc`` backend's planner, :func:`~.tile_plan.plan_tiles`, with every
tile kept) and hands FlexAttention (Dong et al., 2024) the tiles that hold any
(``BlockMask.from_kv_blocks``). A tile whose cells are all edges is *full* and runs without a
mask check; the others are *partial* and run through a ``mask_mod`` that reads one bit per cell
from the plan's compact per-tile bitmask (``[partial tiles, BLOCK, BLOCK / 32]`` int32 words),
found through an ``[n_q / BLOCK, n_k / BLOCK]`` table of tile ids. (The ``mask_mod`` is exact on
every cell, full tiles included, as FlexAttention's contract asks.)

For block-structured sets (packed sequences, block-local, BigBird) most visited tiles are full
and FlexAttention does little more than the edges' work; for scattered sets every tile is
partial and it does dense work. The route takes no bias, dropout, returned weights or
duplicated edges (:func:`flex_attention` says so with a ``ValueError``); it is not part of
``auto``'s choices until a GPU benchmark shows where it wins (``python -m tgattn.bench --device
cuda`` runs it as the ``flex_csr`` peer).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..analysis import Structure
from .tile_plan import plan_tiles

BLOCK = 128  # FlexAttention's default tile


def block_mask(s: Structure, block: int = BLOCK):
    """The ``BlockMask`` of structure ``s`` (B = H = 1, broadcast), cached on ``s``.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> bm = block_mask(analyse(builders.causal([128, 128]), 256, 256))
        >>> bm.to_dense()[0, 0].tolist()  # two sequences: two diagonal tiles, partial (causal)
        [[1, 0], [0, 1]]
        >>> bm.full_kv_num_blocks.flatten().tolist()
        [0, 0]
    """
    if s.duplicates:
        raise ValueError("FlexAttention counts a duplicated edge once; this edge set has duplicates")
    cached = s.extras.get(("flex", block))
    if cached is not None:
        return cached
    from torch.nn.attention.flex_attention import BlockMask

    dev = s.src.device
    plan = plan_tiles(s.rowptr, s.src, s.n_q, s.n_k, block_m=block, block_n=block, min_fill=0)
    nqb, nkb = plan.q_ptr.numel() - 1, -(-s.n_k // block)
    per_block = plan.q_ptr[1:] - plan.q_ptr[:-1]
    qb = torch.repeat_interleave(torch.arange(nqb, device=dev), per_block)  # [T] query block of each tile
    kb, partial = plan.q_tile_kb, plan.q_tile_mask >= 0
    tile_id = torch.full((nqb * nkb,), -1, dtype=torch.int32, device=dev)  # -1: no edge, -2: full
    tile_id[qb * nkb + kb] = torch.where(partial, plan.q_tile_mask, -2).to(torch.int32)
    tile_id = tile_id.view(nqb, nkb)
    # at least one tile of words: the mask_mod reads tile max(t, 0) even where no tile is partial
    words = plan.masks if plan.n_partial else plan.masks.new_zeros(1, block, plan.words)

    def ordered(keep: Tensor):
        """Per query-block count and kv-block indices ``[1, 1, nqb]``, ``[1, 1, nqb, nkb]``."""
        num = torch.bincount(qb[keep], minlength=nqb)
        starts = torch.cumsum(num, 0) - num
        slot = torch.arange(int(keep.sum()), device=dev) - starts[qb[keep]]
        idx = torch.zeros(nqb, nkb, dtype=torch.int32, device=dev)
        idx[qb[keep], slot] = kb[keep].to(torch.int32)
        return num.to(torch.int32).view(1, 1, nqb), idx.view(1, 1, nqb, nkb)

    def mask_mod(b, h, q_idx, kv_idx):
        t = tile_id[q_idx // block, kv_idx // block]
        col = kv_idx % block
        w = words[t.clamp(min=0), q_idx % block, col // 32]
        return (t == -2) | ((t >= 0) & (((w >> (col % 32)) & 1) == 1))

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(~partial)
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                  seq_lengths=(s.n_q, s.n_k))
    s.extras[("flex", block)] = bm
    return bm


def flex_attention(q: Tensor, k: Tensor, v: Tensor, s: Structure, scale: float, *, compiled: Optional[object] = None) -> Tensor:
    """``out [n_q, H, dv]`` through FlexAttention with :func:`block_mask` (``compiled``: a
    ``torch.compile``'d ``flex_attention``; default: the eager one, slow, for checks).

    Rows without edges output 0.
    """
    if compiled is None:
        from torch.nn.attention.flex_attention import flex_attention as compiled
    heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # [1, H, N, d]
    out = compiled(*heads, block_mask=block_mask(s), scale=scale)  # [1, H, n_q, dv]
    return out[0].transpose(0, 1)
