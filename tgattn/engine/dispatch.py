"""Choosing and running a backend for one call of :func:`tgattn.functional.graph_attention`.

``auto`` decides from the cached :class:`~tgattn.engine.analysis.Structure` and the options
of the call, never from the values of ``q``, ``k``, ``v``:

1. ``dense`` (SDPA) when the set is provably full / causal / packed full or causal and the
   call does not ask for weights (bias and dropout included);
2. ``tile`` when the row-blocked tiles are at least ``TILE_FILL`` full (banded, block
   structured and dense-ish sets) and the call has no dropout, no returned weights and no
   duplicated edges;
3. ``csr`` otherwise; it honours every option.

Inputs holding NaN or infinity always run on ``csr``, which touches nothing but the edges, so
that a bad key or value reaches exactly the queries that attend to it. (The check is one sum
per tensor; sums that overflow to infinity also send the call to ``csr``: slower, still exact.)

A named backend that cannot honour a call falls back along dense -> tile -> csr, so that
every backend name is always exact; :func:`plan` tells which one will run.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .analysis import DENSE_KINDS, Structure
from .csr import csr_attention
from .dense import dense_attention
from .tiles import tile_attention, tile_layout

ENGINE_BACKENDS = ("dense", "tile", "csr")
TILE_FILL = 0.3  # below this fraction of edge cells per tile the CSR kernels win (measured)


def plan(s: Structure, backend: str = "auto", *, bias: bool = False, dropout: bool = False, weights: bool = False) -> str:
    """The backend that runs a call with these options on structure ``s``.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.engine.analysis import analyse
        >>> s = analyse(builders.causal(64), 64, 64)
        >>> plan(s), plan(s, bias=True, dropout=True), plan(s, weights=True)
        ('dense', 'dense', 'csr')
    """
    if backend not in ("auto",) + ENGINE_BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}")
    dense_ok = s.kind in DENSE_KINDS and not weights
    if backend == "auto" and dense_ok:
        return "dense"
    if backend == "dense" and dense_ok:
        return "dense"
    # Tiles are laid out (and cached) only when they may be used.
    tile_ok = s.num_edges > 0 and not (dropout or weights or s.duplicates) and tile_layout(s) is not None
    if backend == "auto":
        return "tile" if tile_ok and tile_layout(s).fill >= TILE_FILL else "csr"
    if backend in ("dense", "tile") and tile_ok:
        return "tile"
    return "csr"


def run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    return_weights: bool,
    backend: str = "auto",
) -> Tuple[Tensor, Optional[Tensor]]:
    """Attention on structure ``s``; ``bias`` is ``[E, 1 or H]`` in the caller's edge order.

    Returns ``(out, weights)`` with weights ``[E, H]`` in the caller's edge order, or ``None``.
    """
    chosen = plan(s, backend, bias=bias is not None, dropout=dropout_p > 0, weights=return_weights)
    if chosen != "csr" and not bool(torch.isfinite(q.sum() + k.sum() + v.sum())):
        # Dense tiles multiply masked cells by 0; 0 * nan would leak NaN into queries that never
        # touch the bad key. The CSR kernels only ever touch edges.
        chosen = "csr"
    if s.perm is not None and bias is not None:
        bias = bias[s.perm]  # sorted edge order
    if chosen == "dense":
        return dense_attention(q, k, v, s, scale, bias, dropout_p), None
    if chosen == "tile":
        return tile_attention(q, k, v, s, bias, scale), None
    out, weights = csr_attention(q, k, v, s, bias, scale, dropout_p)
    if not return_weights:
        return out, None
    if s.perm is not None:
        weights = torch.empty_like(weights).index_copy(0, s.perm, weights)  # caller's order
    return out, weights
