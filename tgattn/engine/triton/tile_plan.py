"""The tile plan of the ``tc`` backend: which (query block, key block) tiles run on tensor cores.

The (query, key) plane is cut into tiles of ``block_m`` query rows by ``block_n`` keys. Each
tile that holds an edge is one of

* **full**: every one of its ``block_m * block_n`` cells is an edge (no mask at all; a tile cut
  by the last row or key block is never full, so full tiles need no bounds checks either);
* **partial**: run on tensor cores with a packed bitmask, ``block_m`` rows of
  ``ceil(block_n / 32)`` int32 words, bit ``c % 32`` of word ``c // 32`` set when key ``c`` of
  the tile is an edge of the row;
* **scattered**: its edges stay in a CSR remainder that the gather kernels run
  (:mod:`tgattn.engine.triton.kernels`).

A tile runs on tensor cores when its fill (edges / cells) reaches ``min_fill`` (the cost
model's break-even, :func:`tgattn.engine.triton.tile_cost.break_even_fill`) and it holds no
duplicated edge: the engine counts an edge present m times as m terms of the softmax (log m
added to its score), which a bitmask cannot say, so such tiles stay scattered and the gather
kernels take each copy.

:func:`plan_tiles` is a pure function of the sorted CSR form: O(E) work in elementwise passes
and one sort of E integer tile keys (a radix sort on the GPU), nothing of size n^2 and no
value that a kernel is compiled for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from .tile_config import tuned_shape

WORD_BITS = 32  # bits of one mask word (int32)
TILE_DTYPES = (torch.float16, torch.bfloat16)  # the dtypes whose tiles run on tensor cores
# The fill below which a tile's edges are gathered, when the caller gives none: the break-even
# the first GPU run measured (one H100, bfloat16, d = 64, 64 x 64 tiles, data/gpu/h100_suite):
# random and top-k 1 % at n = 16,384 and 65,536, 1 % full tiles, ran 2.9-3.2x slower on tiles
# than gathered, forward and forward + backward alike, so tiles pay from about 3 % full. The
# prediction before the run (0.70 %, and the 0.5-1 %) assumed half the tensor-core peak.
MIN_FILL = 1 / 32


def _int32_bits(words: Tensor) -> Tensor:
    """int64 values in [0, 2**32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def choose_blocks(dtype: torch.dtype, head_dim: int, *, card: Optional[str] = None) -> Tuple[int, int]:
    """``(block_m, block_n)``: tile rows (queries x grouped heads) and keys per tile for inputs of
    ``dtype``, head dim ``head_dim``, on ``card`` (default: this process's device).

    float16 / bfloat16 take the shape the tuning table in force names for the card, dtype and head
    dim (:func:`~.tile_config.tuned_shape`: one of :data:`~.tile_config.SHAPES`, tried by
    ``python -m tgattn.bench.gpu --tune``), else 64 x 64 tiles at every head dim up to 128:
    compiled for sm_80 and sm_90, none of the tile kernels spills there (data/gpu/compiled.md). float32 and
    float64 calls run on the gather kernels (``tl.dot`` in IEEE precision is FMA work, not tensor
    cores', and its operand layouts spilled 8-1,240 bytes a thread in the dk / dv kernel at
    16 x 16 to 32 x 32 tiles, sm_90): their plan at these blocks says what a half-precision call
    would put on tensor cores, and :func:`~.tile_cost.predict` counts all their edges gathered.

    Example:
        >>> choose_blocks(torch.bfloat16, 64), choose_blocks(torch.float32, 128)
        ((64, 64), (64, 64))
    """
    if head_dim < 1 or head_dim > 128:
        raise ValueError(f"head_dim must be 1..128 for the tensor-core tiles (got {head_dim})")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a float dtype (got {dtype})")
    return tuned_shape(dtype, head_dim, card=card) or (64, 64)


@dataclass(frozen=True)
class TilePlan:
    """Where the edges of one set run: tiles on tensor cores, the rest gathered.

    Tiles are listed twice, each list grouped by block with its full tiles first:

    * query-major (forward, dq): query block ``b`` owns ``q_ptr[b] .. q_ptr[b + 1]`` of
      ``q_tile_kb`` (key block ids) and ``q_tile_mask`` (row of ``masks``, -1 for a full tile);
      its partial tiles start at ``q_split[b]``;
    * key-major (dk, dv): key block ``c`` owns ``k_ptr[c] .. k_ptr[c + 1]`` of ``k_tile_qb`` and
      ``k_tile_mask``, partial ones from ``k_split[c]``.

    ``masks [n_partial, block_m, words]`` (int32) holds the partial tiles' bits; ``rest_ptr
    [num_queries + 1]`` and ``rest_col`` the scattered edges as CSR (sorted by (query, key)).
    """

    block_m: int
    block_n: int
    num_queries: int
    num_keys: int
    num_edges: int
    n_full: int
    n_partial: int
    tc_edges: int
    q_ptr: Tensor
    q_split: Tensor
    q_tile_kb: Tensor
    q_tile_mask: Tensor
    k_ptr: Tensor
    k_split: Tensor
    k_tile_qb: Tensor
    k_tile_mask: Tensor
    masks: Tensor
    rest_ptr: Tensor
    rest_col: Tensor

    @property
    def tc_share(self) -> float:
        """The share of edges computed on tensor cores (0.0 for no edges)."""
        return self.tc_edges / self.num_edges if self.num_edges else 0.0

    @property
    def words(self) -> int:
        """int32 words per mask row."""
        return -(-self.block_n // WORD_BITS)


def _check_blocks(block_m: int, block_n: int) -> None:
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two (got {b})")


def _check(ptr: Tensor, col: Tensor, num_queries: int, num_keys: int, block_m: int, block_n: int) -> None:
    _check_blocks(block_m, block_n)
    if ptr.dim() != 1 or ptr.numel() != num_queries + 1:
        raise ValueError(f"ptr must be [num_queries + 1] = [{num_queries + 1}] (got {list(ptr.shape)})")
    if col.dim() != 1 or int(ptr[-1]) != col.numel():
        raise ValueError(f"ptr[-1] must equal the number of edges in col ({col.numel()}), got {int(ptr[-1])}")
    if col.numel() and not 0 <= int(col.min()) <= int(col.max()) < num_keys:
        raise ValueError(f"col holds key ids outside 0..{num_keys - 1} (got {int(col.min())}..{int(col.max())})")


def _grouped(block: Tensor, partial: Tensor, other: Tensor, n_blocks: int, n_other: int):
    """Tiles ordered by (block, partial, other): ``(ptr [n_blocks + 1], split [n_blocks], order)``."""
    order = torch.argsort((block * 2 + partial.long()) * n_other + other)
    counts = torch.bincount(block, minlength=n_blocks)
    fulls = torch.bincount(block[~partial], minlength=n_blocks)
    ptr = torch.zeros(n_blocks + 1, dtype=torch.long, device=block.device)
    torch.cumsum(counts, 0, out=ptr[1:])
    return ptr, ptr[:-1] + fulls, order


def plan_tiles(
    ptr: Tensor, col: Tensor, num_queries: int, num_keys: int, *, block_m: int, block_n: int,
    min_fill: Optional[float] = None,
) -> TilePlan:
    """The :class:`TilePlan` of the edge set in CSR form ``ptr [num_queries + 1]``, ``col [E]``
    (edges sorted by (query, key); rows = queries i, columns = keys j).

    A tile goes to tensor cores when it holds at least ``min_fill * block_m * block_n`` edges
    and no duplicated edge (default :data:`MIN_FILL`); ``min_fill=0`` sends every tile without
    duplicates, ``min_fill > 1`` none.

    Example (a causal set of 8 queries in tiles of 4 x 4: one full tile, two partial)::

        >>> ptr = torch.tensor([r * (r + 1) // 2 for r in range(9)])
        >>> col = torch.cat([torch.arange(r + 1) for r in range(8)])
        >>> p = plan_tiles(ptr, col, 8, 8, block_m=4, block_n=4, min_fill=0)
        >>> p.n_full, p.n_partial, p.tc_edges, p.q_tile_kb.tolist(), p.q_tile_mask.tolist()
        (1, 2, 36, [0, 0, 1], [0, -1, 1])
        >>> p.masks[1, :2, 0].tolist()  # rows 4 and 5 of key block 1: key 4, keys 4 and 5
        [1, 3]
    """
    _check(ptr, col, num_queries, num_keys, block_m, block_n)
    min_fill = MIN_FILL if min_fill is None else float(min_fill)
    device, n_edges = col.device, col.numel()
    ptr, col = ptr.long(), col.long()
    n_qb, n_kb = -(-num_queries // block_m), -(-num_keys // block_n)
    row = torch.repeat_interleave(torch.arange(num_queries, device=device), ptr[1:] - ptr[:-1])  # [E]
    tile = (row // block_m) * n_kb + col // block_n  # [E] tile key, (query block, key block)
    dup = torch.zeros(n_edges, dtype=torch.bool, device=device)
    if n_edges > 1:
        same = (row[1:] == row[:-1]) & (col[1:] == col[:-1])
        dup[1:] |= same
        dup[:-1] |= same
    keys, order = torch.sort(tile)
    tiles, edges_per_tile = torch.unique_consecutive(keys, return_counts=True)  # [T]
    tile_of = torch.empty_like(tile)
    tile_of[order] = torch.repeat_interleave(torch.arange(tiles.numel(), device=device), edges_per_tile)
    has_dup = torch.zeros(tiles.numel(), dtype=torch.long, device=device).index_add_(0, tile_of, dup.long()) > 0
    cells = block_m * block_n
    on_tc = ~has_dup & (edges_per_tile >= min_fill * cells)
    full = on_tc & (edges_per_tile == cells)
    partial = on_tc & ~full

    # Query-major lists, then key-major, of the tiles on tensor cores.
    tc_tiles = tiles[on_tc]
    qb, kb, is_partial = tc_tiles // n_kb, tc_tiles % n_kb, partial[on_tc]
    mask_row = torch.full_like(tc_tiles, -1)
    mask_row[is_partial] = torch.arange(int(is_partial.sum()), device=device)
    q_ptr, q_split, q_order = _grouped(qb, is_partial, kb, n_qb, n_kb)
    k_ptr, k_split, k_order = _grouped(kb, is_partial, qb, n_kb, n_qb)

    # The partial tiles' bits: one word per (tile, row, 32 keys); no duplicates, so a sum is an OR.
    slot = torch.full((tiles.numel(),), -1, dtype=torch.long, device=device)
    slot[on_tc] = mask_row
    edge_slot = slot[tile_of]  # [E] mask row of each edge's tile, -1 if none
    in_mask = edge_slot >= 0
    words = -(-block_n // WORD_BITS)
    c = col[in_mask] % block_n
    word = (edge_slot[in_mask] * block_m + row[in_mask] % block_m) * words + c // WORD_BITS
    bits = torch.zeros(int(is_partial.sum()) * block_m * words, dtype=torch.long, device=device)
    bits.index_add_(0, word, torch.ones_like(word) << (c % WORD_BITS))
    bits = _int32_bits(bits)

    rest = ~on_tc[tile_of]  # [E] edges left to the gather kernels
    rest_ptr = torch.zeros(num_queries + 1, dtype=torch.long, device=device)
    torch.cumsum(torch.bincount(row[rest], minlength=num_queries), 0, out=rest_ptr[1:])
    rest_col = col[rest]
    return TilePlan(
        block_m=block_m, block_n=block_n, num_queries=num_queries, num_keys=num_keys, num_edges=n_edges,
        n_full=int(full.sum()), n_partial=int(partial.sum()), tc_edges=n_edges - rest_col.numel(),
        q_ptr=q_ptr, q_split=q_split, q_tile_kb=kb[q_order], q_tile_mask=mask_row[q_order],
        k_ptr=k_ptr, k_split=k_split, k_tile_qb=qb[k_order], k_tile_mask=mask_row[k_order],
        masks=bits.view(-1, block_m, words), rest_ptr=rest_ptr, rest_col=rest_col,
    )
