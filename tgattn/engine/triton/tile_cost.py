"""The cost model of the ``tc`` backend: predicted seconds of a :class:`~.tile_plan.TilePlan` on a GPU.

The numbers are the cards' published peaks times the efficiencies that the first GPU run of the
suite measured (``python -m tgattn.bench.gpu --suite``, one H100, 2026-11-28,
data/gpu/h100_suite): :data:`FORWARD_EFFICIENCY`, :data:`BACKWARD_EFFICIENCY`, and from them
:data:`~.tile_plan.MIN_FILL`. The gathered edge's bytes needed no correction (measured 72-90 ps
an edge-head forward in bfloat16 at d = 64, predicted 79).

* A tile costs, per head, its arithmetic (``4 d`` FLOP a cell forward: ``Q K^T`` and ``P V``;
  ``10 d`` backward: five products, FlashAttention-2's count) at the tensor-core rate (float32
  in IEEE precision: the FMA rate), plus the mask words of a partial tile from HBM. Its key and
  value rows (and backward its query and output-gradient rows) are assumed to come from L2 and
  to overlap the products, as in dense FlashAttention, which is bound by its arithmetic: each
  key block is read by every query block that meets it.
* A gathered edge costs, per head, its reads: its key and value rows and its key id
  (forward); the backward reads them again and the query and output-gradient rows.
* float32 and float64 calls run wholly on the gather kernels (:func:`~.tile_plan.choose_blocks`):
  their prediction counts every edge gathered, whatever the plan.
* The roofline of the call: the larger of reading q, k, v and writing the output once, and the
  edges' own FLOP at the tensor-core peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .tile_plan import TILE_DTYPES, WORD_BITS, TilePlan


@dataclass(frozen=True)
class Card:
    """A GPU's published peaks (NVIDIA data sheets, SXM parts, dense tensor-core rates)."""

    name: str
    bandwidth: float  # bytes / s of HBM
    half_flops: float  # float16 / bfloat16 tensor-core FLOP / s
    fp32_flops: float  # float32 FMA FLOP / s (no TF32)


CARDS = {
    "a100": Card("A100 SXM 80GB", 2.039e12, 312e12, 19.5e12),
    "h100": Card("H100 SXM", 3.35e12, 989e12, 67e12),
    "h200": Card("H200 SXM", 4.8e12, 989e12, 67e12),
}
# The share of the tensor-core peak the tile kernels reached on the H100 once the card was full:
# random 1 % at n = 65,536 (1.03 million 64 x 64 tiles, 8 heads, d = 64, bfloat16) took 8.9 ns a
# tile and head forward (1.06 ns at the peak: 0.12) and 30 ns backward (2.65 ns: 0.09). Fewer
# tiles than about 40,000 tile-heads leave the card part idle (window 64 at n = 16,384: 52 ns).
# FlashAttention-2 reports 50-73 % on dense A100 blocks; these kernels walk per-block tile lists.
FORWARD_EFFICIENCY = 0.12
BACKWARD_EFFICIENCY = 0.09
# Predicted, not measured: what the pipelined kernels (issue 56) are expected to reach. Those
# measured above ran 8 warps on 64-row tiles (each score computed twice on sm_90: 1.5-1.67x the
# tensor work, 2x the exponentials) and waited for every copy at the top of each tile; one copy
# of each score alone gives about 0.18 / 0.14, the next two tiles' copies in flight during the
# products the rest. The planner keeps the measured ones (MIN_FILL) until a GPU run says more.
PIPELINED_FORWARD_EFFICIENCY = 0.25
PIPELINED_BACKWARD_EFFICIENCY = 0.20
INDEX_BYTES = 8  # one int64 key id per gathered edge


def _card(card: str) -> Card:
    if card not in CARDS:
        raise ValueError(f"card must be one of {sorted(CARDS)} (got {card!r})")
    return CARDS[card]


def _peak(dtype: torch.dtype, card: Card) -> float:
    return card.half_flops if dtype in TILE_DTYPES else card.fp32_flops


def tile_seconds(block_m: int, block_n: int, head_dim: int, dtype: torch.dtype, card: str = "h100", *,
                 backward: bool = False, partial: bool = False, pipelined: bool = False) -> float:
    """Predicted seconds of one tile and one head: its FLOP, and its mask's bytes if ``partial``; at the
    measured efficiencies, or with ``pipelined`` at those predicted for the pipelined kernels.

    Example:
        >>> round(tile_seconds(64, 64, 64, torch.bfloat16) * 1e9, 2)  # ns: 1 MFLOP at 12 % of 989 TFLOP/s
        8.84
        >>> round(tile_seconds(64, 64, 64, torch.bfloat16, pipelined=True) * 1e9, 2)  # at 25 %
        4.24
    """
    c = _card(card)
    flop = (10 if backward else 4) * head_dim * block_m * block_n
    mask = block_m * -(-block_n // WORD_BITS) * 4 if partial else 0
    if pipelined:
        efficiency = PIPELINED_BACKWARD_EFFICIENCY if backward else PIPELINED_FORWARD_EFFICIENCY
    else:
        efficiency = BACKWARD_EFFICIENCY if backward else FORWARD_EFFICIENCY
    return flop / (_peak(dtype, c) * efficiency) + mask / c.bandwidth


def edge_seconds(head_dim: int, dtype: torch.dtype, card: str = "h100", *, backward: bool = False) -> float:
    """Predicted seconds of one gathered edge and head (its bytes: 264 B in bfloat16 at d = 64).

    Example:
        >>> round(edge_seconds(64, torch.bfloat16) * 1e12, 1)  # ps
        78.8
    """
    c, size = _card(card), torch.finfo(dtype).bits // 8
    rows = 4 if backward else 2
    return (rows * head_dim * size + INDEX_BYTES) / c.bandwidth


def break_even_fill(block_m: int, block_n: int, head_dim: int, dtype: torch.dtype, card: str = "h100") -> float:
    """The fill (edges / cells) at which a partial tile costs what gathering its edges costs.

    Example:
        >>> round(break_even_fill(64, 64, 64, torch.bfloat16), 4)  # tile_plan.MIN_FILL is 1 / 32 = 0.031
        0.0278
    """
    return tile_seconds(block_m, block_n, head_dim, dtype, card, partial=True) / (
        block_m * block_n * edge_seconds(head_dim, dtype, card))


def predict(plan: TilePlan, *, heads: int, head_dim: int, dtype: torch.dtype, backward: bool = False,
            card: str = "h100", pipelined: bool = False) -> dict:
    """Predicted seconds of ``plan`` (forward, or backward alone): ``tiles_s``, ``gather_s``,
    ``total_s`` and ``roofline_s`` (see the module's docstring); a prediction, not a measurement.
    ``pipelined``: tiles at :data:`PIPELINED_FORWARD_EFFICIENCY` / :data:`PIPELINED_BACKWARD_EFFICIENCY`.

    Example:
        >>> from tgattn.engine.triton.tile_plan import plan_tiles
        >>> n = 1024; ptr = torch.arange(n + 1) * n; col = torch.arange(n).repeat(n)  # all pairs
        >>> p = predict(plan_tiles(ptr, col, n, n, block_m=64, block_n=64), heads=8, head_dim=64, dtype=torch.bfloat16)
        >>> p["gather_s"], round(p["total_s"] / p["roofline_s"], 2)  # the roofline at the peak, tiles at 12 %
        (0.0, 8.33)
        >>> p = predict(plan_tiles(ptr, col, n, n, block_m=64, block_n=64), heads=8, head_dim=64, dtype=torch.bfloat16,
        ...             pipelined=True)
        >>> round(p["total_s"] / p["roofline_s"], 2)  # predicted for the pipelined kernels
        4.0
    """
    size = torch.finfo(dtype).bits // 8
    c = _card(card)
    on_tiles = dtype in TILE_DTYPES
    tiles = on_tiles * heads * (
        plan.n_full * tile_seconds(plan.block_m, plan.block_n, head_dim, dtype, card, backward=backward,
                                   pipelined=pipelined)
        + plan.n_partial * tile_seconds(plan.block_m, plan.block_n, head_dim, dtype, card, backward=backward,
                                        partial=True, pipelined=pipelined))
    gathered = plan.num_edges - plan.tc_edges * on_tiles
    gather = heads * gathered * edge_seconds(head_dim, dtype, card, backward=backward)
    passes = 3 if backward else 2  # rows read and written once: q, k, v, out (and their gradients)
    rows = passes * (plan.num_queries + plan.num_keys) * heads * head_dim * size
    flop = (10 if backward else 4) * head_dim * plan.num_edges * heads
    roofline = max(rows / c.bandwidth, flop / _peak(dtype, c))
    return {"tiles_s": tiles, "gather_s": gather, "total_s": tiles + gather, "roofline_s": roofline}
