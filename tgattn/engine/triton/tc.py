"""The ``tc`` backend: tiles of the edge set on tensor cores, the scattered rest on the gather kernels.

:func:`tc_attention` plans the tiles once per edge set and block shape
(:func:`~.band_plan.plan_structure`: from the rows' key ranges of a set known by its shape, else
from the edges; cached on the :class:`~tgattn.engine.analysis.Structure`), runs
the scattered remainder through the gather forward (:mod:`.kernels`) and then the tiles
(:mod:`.tile_kernels`), whose online softmax takes in the remainder's output and log-sum-exp:
one exact softmax over all of a row's edges. The backward runs both with the call's
log-sum-exp and ``delta`` (one pass over ``dO`` and ``O``); the tile kernels write ``dq``, ``dk``,
``dv`` in the inputs' dtype, ``dq`` with the remainder's added in float32; where a remainder
exists, ``dk`` and ``dv`` take its share in one pass each, in their dtype.

The tiles take float16 and bfloat16, a scale, soft-capping, sinks (in the remainder's softmax:
it runs for every row when there are sinks) and rows without edges; grouped-query heads (``k``
and ``v`` with ``H / G`` heads, ``G`` a power of two) share each tile's key rows. A call with a
bias, dropout, returned weights, or in float32 or float64 runs wholly on the gather kernels
(:func:`tiles_take`): the per-edge options need each tile cell's edge id, which the plan does
not keep, and float32's IEEE products would not run on tensor cores
(:func:`~.tile_plan.choose_blocks`). :class:`TileAttention` itself also takes float32 (IEEE
products): the interpreter tests check the tiles' arithmetic against the float64 oracle there.
"""
from __future__ import annotations

import importlib
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..analysis import Structure
from .attention import _unit_stride, blocks_for, interpreting, kernels_module, triton_attention, walks
from .tile_cost import break_even_fill
from .band_plan import plan_structure
from .tile_plan import TILE_DTYPES, TilePlan, choose_blocks


def tile_kernels_module():
    """The tile kernel module, imported on first use (re-imported when ``TRITON_INTERPRET`` changed)."""
    from . import tile_kernels

    if tile_kernels.INTERPRETED != interpreting():
        tile_kernels = importlib.reload(tile_kernels)
    return tile_kernels


def tiles_take(q: Tensor, v: Tensor, bias: Optional[Tensor], dropout_p: float, return_weights: bool,
               group: int = 1) -> bool:
    """Whether a call with these options runs its tiles on tensor cores (else wholly on the gather kernels).

    Example:
        >>> q = torch.zeros(4, 2, 16, dtype=torch.bfloat16)
        >>> tiles_take(q, q, None, 0.0, False), tiles_take(q, q, None, 0.1, False), tiles_take(q.float(), q, None, 0.0, False)
        (True, False, False)
    """
    return (q.dtype in TILE_DTYPES and bias is None and dropout_p == 0 and not return_weights
            and group & (group - 1) == 0 and max(q.shape[2], v.shape[2]) <= 128)


def plan_for(s: Structure, blocks: Tuple[int, int], min_fill: float) -> Tuple[TilePlan, Structure]:
    """``(plan, rest)``: the tile plan of ``s`` and its scattered remainder as a structure, made once
    per set, block shape and threshold and kept in the set (:meth:`Structure.memo`, thread-safe), so
    that a prepared :class:`~tgattn.engine.edgeset.EdgeSet` carries its plan from call to call."""

    def make() -> Tuple[TilePlan, Structure]:
        plan = plan_structure(s, block_m=blocks[0], block_n=blocks[1], min_fill=min_fill)  # a band: from its rows
        counts = plan.rest_ptr[1:] - plan.rest_ptr[:-1]
        rest = Structure(
            n_q=s.n_q, n_k=s.n_k, num_edges=plan.rest_col.numel(), perm=None, src=plan.rest_col,
            dst=torch.repeat_interleave(torch.arange(s.n_q, device=counts.device), counts), rowptr=plan.rest_ptr,
            duplicates=s.duplicates,
        )
        return plan, rest

    return s.memo(("tc", blocks, min_fill), make)


def plan_for_inputs(s: Structure, dtype: torch.dtype, head_dim: int, group: int = 1,
                    blocks: Optional[Tuple[int, int]] = None, min_fill: Optional[float] = None
                    ) -> Tuple[TilePlan, Structure]:
    """:func:`plan_for` at the blocks (:func:`~.tile_plan.choose_blocks`) and break-even
    (:func:`~.tile_cost.break_even_fill`) of inputs of ``dtype`` and ``head_dim`` (the larger of
    the key and value dims), tile rows holding queries x ``group`` heads that share a key head."""
    blocks = blocks or choose_blocks(dtype, head_dim)
    min_fill = break_even_fill(*blocks, head_dim, dtype) if min_fill is None else min_fill
    return plan_for(s, (max(1, blocks[0] // group), blocks[1]), min_fill)


def tiles_pay(q: Tensor, v: Tensor, s: Structure, bias: Optional[Tensor], dropout_p: float, return_weights: bool, *,
              named: bool = False) -> bool:
    """Whether ``tc`` runs this call: the tiles take its options (:func:`tiles_take`) and, unless
    the backend is named, its tile plan (planned here, cached on ``s``) puts edges on tensor cores.
    ``v`` may have ``H / G`` heads (grouped-query attention): the plan is then the one of ``G`` heads per tile."""
    group = q.shape[1] // v.shape[1]
    if not tiles_take(q, v, bias, dropout_p, return_weights, group):
        return False
    return named or (s.num_edges > 0
                     and plan_for_inputs(s, q.dtype, max(q.shape[2], v.shape[2]), group)[0].tc_edges > 0)


def _groups(x: Tensor, group: int):
    """The ``group`` views ``[n, H / G, d]`` of ``x [n, H, d]``: heads ``hk * G + g`` for ``g`` in order."""
    return x.unflatten(1, (-1, group)).unbind(2)


def _gather_forward(q, k, v, rest, scale, softcap, sinks, group):
    """The remainder's ``(out [n_q, H, dv], lse [H, n_q])``, one gather launch per head of a group."""
    kern = kernels_module()
    blocks = blocks_for(q.shape[2], v.shape[2], q.dtype, softcap is not None)
    rows, _ = walks(rest)
    sinks = [None] * group if sinks is None else sinks.view(-1, group).unbind(1)  # [H / G] each
    outs, lses = zip(*(
        kern.forward(qg, k, v, None, *rows, scale, 0.0, 0, False, blocks, softcap,
                     None if sg is None else sg.contiguous())[:2]
        for qg, sg in zip(_groups(q, group), sinks)))
    if group == 1:
        return outs[0], lses[0]
    return torch.stack(outs, 2).flatten(1, 2), torch.stack(lses, 1).flatten(0, 1)


def _gather_backward(q, k, v, grad_out, lse, delta, rest, scale, softcap, group):
    """The remainder's ``(dq [n_q, H, dk], dk [n_k, H, dk], dv [n_k, H, dv])`` in the inputs' dtype,
    ``dk`` / ``dv`` per query head (heads ``hk * G + g``), one gather launch per head of a group."""
    kern = kernels_module()
    blocks = blocks_for(q.shape[2], v.shape[2], q.dtype, softcap is not None)
    rows, cols = walks(rest)
    parts = zip(_groups(q, group), _groups(grad_out, group), lse.unflatten(0, (-1, group)).unbind(1),
                delta.unflatten(0, (-1, group)).unbind(1))
    grads = [kern.backward(qg, k, v, None, dog, lg.contiguous(), deltag.contiguous(), None, rows, cols, scale, 0.0, 0,
                           False, blocks, softcap)[:3] for qg, dog, lg, deltag in parts]
    if group == 1:
        return grads[0]
    return tuple(torch.stack(g, 2).flatten(1, 2) for g in zip(*grads))  # head hk * G + g, as in q


class TileAttention(torch.autograd.Function):
    """Tiles plus gathered remainder: ``out [n_q, H, dv]``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, plan: TilePlan, rest: Structure, scale: float, softcap: Optional[float]):
        q, k, v = (_unit_stride(t) for t in (q, k, v))
        group = q.shape[1] // k.shape[1]
        init = None
        if rest.num_edges or sinks is not None:
            init = _gather_forward(q, k, v, rest, scale, softcap, sinks, group)
        launch, (out, lse) = tile_kernels_module().forward_launch(q, k, v, plan, scale, softcap, init)
        launch()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.plan, ctx.rest, ctx.scale, ctx.softcap = plan, rest, scale, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "the tensor-core attention kernels have no second derivative; "
                "pass backend='csr' to graph_attention (or GraphAttention) for double backward"
            )
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if grad_out is None:
            return None, None, None, None, None, None, None, None
        grad_out = _unit_stride(grad_out)
        group = q.shape[1] // k.shape[1]
        tk = tile_kernels_module()
        launch, delta = tk.delta_launch(grad_out, out)  # [H, n_q]: <dO_i, O_i>, one pass in the inputs' dtype
        launch()
        rest = None
        if ctx.rest.num_edges:
            rest = _gather_backward(q, k, v, grad_out, lse, delta, ctx.rest, ctx.scale, ctx.softcap, group)
        launches, (dq, dk, dv) = tk.backward_launches(q, k, v, grad_out, lse, delta, ctx.plan, ctx.scale, ctx.softcap,
                                                      None if rest is None else rest[0])
        for launch in launches:
            launch()
        if rest is not None:  # plus the remainder's share (per query head: summed over each group), in their dtype
            dk, dv = (g + r.unflatten(1, (-1, group)).sum(2) for g, r in zip((dk, dv), rest[1:]))
        grad_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:  # as in TritonAttention.backward
            grad_sinks = -(torch.exp(sinks.float()[:, None] - lse) * delta).sum(1).to(sinks.dtype)
        return dq, dk, dv, grad_sinks, None, None, None, None


def tc_attention(q: Tensor, k: Tensor, v: Tensor, s: Structure, bias: Optional[Tensor], scale: float,
                 dropout_p: float = 0.0, return_weights: bool = False, *, softcap: Optional[float] = None,
                 sinks: Optional[Tensor] = None, blocks: Optional[Tuple[int, int]] = None,
                 min_fill: Optional[float] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """``(out [n_q, H, dv], weights [E, H] or None)`` on structure ``s``; ``k``, ``v`` may have
    ``H / G`` heads (query heads ``hk * G .. hk * G + G - 1`` share key/value head ``hk``).

    ``blocks = (block_m, block_n)`` overrides :func:`~.tile_plan.choose_blocks`, ``min_fill`` the
    cost model's break-even (:func:`~.tile_cost.break_even_fill`). Calls the tiles do not take
    (:func:`tiles_take`) run on :func:`~.attention.triton_attention` (grouped heads repeated).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads or v.shape[1] != kv_heads:
        raise ValueError(f"q's heads ({heads}) must be a multiple of k's and v's ({kv_heads}, {v.shape[1]})")
    group = heads // kv_heads
    plan, rest = plan_for_inputs(s, q.dtype, max(q.shape[2], v.shape[2]), group, blocks, min_fill) if tiles_take(q, v, bias, dropout_p, return_weights, group) \
        else (None, None)
    # Nothing on tiles runs on the gather path alone: through the tile kernels' empty launches and
    # merge, a set with no tile ran 1.13-1.22x slower on the H100 (data/gpu/h100_suite, graph16).
    if plan is None or plan.n_full + plan.n_partial == 0:
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return triton_attention(q, k, v, s, bias, scale, dropout_p, return_weights, softcap=softcap, sinks=sinks)
    if sinks is not None:
        sinks = sinks.float()
    return TileAttention.apply(q, k, v, sinks, plan, rest, scale, softcap), None
