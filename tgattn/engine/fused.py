"""Fused backend: a C++ kernel that walks each query's CSR row once per direction.

The kernel (``csrc/``: forward.h, backward.h) computes scores, softmax and aggregation for a block of query rows
in one pass, reading the caller's ``[N, H, d]`` tensors in place, and skips the
dot products of edges whose bias is ``-inf``. As in FlashAttention-2 (Dao, 2023), the forward
saves the log-sum-exp per query and head and the backward recomputes the weights from it,
walking each key's edges once for ``dq``, ``dk`` and ``dv`` together (float16 / bfloat16: ``dk``
and ``dv``, then ``dq`` over query rows from the score gradients the key pass wrote per edge): no
``[E, H, d]`` tensor in either direction and no ``[E, H]`` tensor kept between them unless the
weights are returned.
A double backward (``create_graph=True``) recomputes the gradients on the textbook per-edge
path, which is twice differentiable. The kernels check the CSR structure they are given (one
pass over the indices), so a malformed structure raises instead of reading out of bounds.

The extension itself (building, loading, its cache of freed buffers) is :mod:`tgattn.engine.native`;
:func:`available`, :func:`cache_info` and :func:`empty_cache` are read from there.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .analysis import Structure
from .csr import transpose_pattern
from .native import (available, cache_info, cache_limit_from_env, dropout_keep, empty_cache, half_available,
                     register_fake_kernels)
from .precision import compute_dtype
from .recompute import gather_attention, recompute_grads

__all__ = ["available", "backward_pattern", "cache_info", "cache_limit_from_env", "dropout_keep", "empty_cache",
           "fused_attention", "FusedAttention", "ReadsOnly"]


def backward_pattern(s: Structure, with_perm: bool) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """``(colptr [n_k + 1], row_t [E], perm_t [E] or None)``: the transposed pattern the backward
    kernel walks, all int32 where the indices fit (cached; ``perm_t`` only when ``with_perm``)."""
    cached = s.extras.get(("fused_transpose", True)) or s.extras.get(("fused_transpose", with_perm))
    if cached is None:
        narrow = max(s.num_edges, s.n_q) < 2**31
        colptr, row_t, perm_t = torch.ops.tgattn_fused.transpose_rows(s.rowptr, s.src, s.n_k, with_perm, narrow)
        cached = s.extras[("fused_transpose", with_perm)] = (colptr, row_t, perm_t if with_perm else None)
    return cached


def textbook(s: Structure, scale: float, softcap: Optional[float], p: float, seed: int, sums: bool):
    """The fused kernel's forward on plain autograd ops (per-edge gathers), twice differentiable: what a
    double backward (``create_graph=True``) differentiates. Returns ``attend(q, k, v, bias, sinks, edge_q,
    features) -> (out, weights [H, E], sums [n_q, H, F] or None)`` with the kernel's own dropout mask
    (``seed``); float16 / bfloat16 computed in float32, as the kernels do."""

    def attend(q, k, v, bias, sinks, edge_q, features):
        work = compute_dtype(q.dtype)
        used = None
        if p > 0:  # the kernel's mask, keep / (1 - p)
            used = (dropout_keep(q.shape[1], s.num_edges, p, seed).T.to(q.dtype) / (1.0 - p)).to(work)  # [E, H]
        e = None if features is None else features.to(work)
        if e is not None and s.perm is not None:
            e = e[s.perm]  # sorted order
        if edge_q is not None:  # the key term as a bias, scale <W_h^T q_i, e_ij>
            key = (edge_q[s.dst] * e.unsqueeze(1)).sum(-1) * scale  # [E, H]
            bias = key if bias is None else key + bias
        out, w = gather_attention(q.to(work), k.to(work), v.to(work), s.src, s.dst, s.n_q, bias, scale, used,
                                  softcap, sinks)
        summed = None
        if sums:  # s_i = sum_j a_ij e_ij, the weights as applied to the values
            applied = w if used is None else w * used
            per_edge = applied.unsqueeze(-1) * e.unsqueeze(1)  # [E, H, F]
            summed = w.new_zeros(s.n_q, w.shape[1], e.shape[1]).index_add(0, s.dst, per_edge)
        return out.to(q.dtype), w.T.to(q.dtype), summed

    return attend


class FusedAttention(torch.autograd.Function):
    """Attention on the fused kernel: ``(out [n_q, H, dv], weights [H, E] or an empty tensor)``.

    The kernels read ``q``, ``k``, ``v`` ``[N, H, d]`` through their strides (any row and head
    strides, a contiguous feature dimension) and write ``[N, H, d]`` results. The forward
    saves the output and the log-sum-exp ``[H, n_q]``; the backward recomputes the weights
    from them (FlashAttention-2), so nothing of size ``[H, E]`` is kept unless the weights
    were asked for (``weights=True``).
    Dropout (probability ``p``) draws no mask: the kernels hash ``(seed, head, edge)``, in
    backward as in forward. The returned weights are those before dropout.
    ``softcap`` (a float or ``None``) caps the scaled scores before the bias, ``c * tanh(s / c)``;
    ``sinks`` (``[H]`` or ``None``) joins each softmax's denominator without a value. The saved
    log-sum-exp includes the sink, so the backward recomputes the weights with it; the kernel
    forms the sinks' gradient from it and its deltas.
    Per-edge terms in factored form (``features [E, F]`` in the caller's edge order, read through
    ``s.perm``; see ``EdgeTerms`` in ``csrc/terms.h``): ``edge_q [n_q, H, F]`` (``W_h^T q_i``, compute dtype) adds ``scale <edge_q_i, e_ij>``
    to each score, and ``sums=True`` returns ``s_i = sum_j a_ij e_ij`` ``[n_q, H, F]`` (compute dtype,
    the weights as applied to the values) as a third output (else an empty tensor); the backward
    returns the gradients of ``edge_q`` and the features.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, edge_q, features, s: Structure, scale: float, p: float, seed: int,
                weights: bool, softcap: Optional[float], sums: bool):
        cap = 0.0 if softcap is None else softcap
        perm = s.perm if features is not None else None
        out, lse, w, *rest = torch.ops.tgattn_fused.forward(q, k, v, s.rowptr, s.src, bias, scale, p, seed, weights,
                                                            cap, sinks, edge_q, features, sums, perm)
        edge_sums = rest[0] if sums else out.new_empty(0)
        ctx.set_materialize_grads(False)  # no zeros for an unused output
        for unused in ([] if weights else [w]) + ([] if sums else [edge_sums]):
            ctx.mark_non_differentiable(unused)
        ctx.save_for_backward(q, k, v, bias, sinks, edge_q, features, out, lse, w if weights else None,
                              edge_sums if sums else None)
        ctx.s, ctx.scale, ctx.p, ctx.seed, ctx.softcap = s, scale, p, seed, softcap
        return out, w, edge_sums

    @staticmethod
    def backward(ctx, grad_out, grad_weights, grad_sums):
        q, k, v, bias, sinks, edge_q, features, out, lse, weights, edge_sums = ctx.saved_tensors
        s, needs = ctx.s, ctx.needs_input_grad
        unused = (None,) * 7  # s, scale, p, seed, weights, softcap, sums
        if grad_out is None and grad_weights is None and grad_sums is None:
            return (None,) * 7 + unused
        if torch.is_grad_enabled():  # create_graph=True: recompute on a twice-differentiable path
            attend = textbook(s, ctx.scale, ctx.softcap, ctx.p, ctx.seed, edge_sums is not None)
            grads = recompute_grads(attend, (q, k, v, bias, sinks, edge_q, features), (grad_out, grad_weights, grad_sums),
                                    needs[:7])
            return (*grads, *unused)
        if grad_out is None:  # only the returned weights or the value sums got a gradient
            grad_out = torch.zeros_like(out)
        # float16 / bfloat16: the kernel sums dq in a pass over query rows (see query_pass in csrc/ops.cpp),
        # which needs perm_t and col.
        query_pass = q.dtype in (torch.float16, torch.bfloat16)
        with_perm = bias is not None or ctx.p > 0 or grad_weights is not None or features is not None or query_pass
        colptr, row_t, perm_t = backward_pattern(s, with_perm)
        sinks_grad = sinks is not None and needs[4]
        grads = torch.ops.tgattn_fused.backward(
            grad_out, q, k, v, out, lse, weights, grad_weights, bias, s.rowptr, colptr, row_t, perm_t,
            ctx.scale, ctx.p, ctx.seed, needs[3], 0.0 if ctx.softcap is None else ctx.softcap,
            sinks if sinks_grad else None, edge_q, features, edge_sums,
            None if grad_sums is None else grad_sums.contiguous(), s.perm if features is not None else None,
            s.src if query_pass else None,
        )
        grad_q, grad_k, grad_v, d_scores = grads[:4]
        grad_bias = grad_edge_q = grad_features = None
        if needs[3]:
            grad_bias = d_scores.T if bias.shape[1] > 1 else d_scores.sum(0).unsqueeze(1)  # [E, 1 or H]
        grad_sinks = grads[4] if sinks_grad else None
        if features is not None:
            d_edge_q, d_features = grads[-2:]
            grad_edge_q = d_edge_q if needs[5] else None
            grad_features = d_features.to(features.dtype) if needs[6] else None
        return grad_q, grad_k, grad_v, grad_bias, grad_sinks, grad_edge_q, grad_features, *unused


def fused_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    return_weights: bool = False,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    edge_q: Optional[Tensor] = None,
    edge_features: Optional[Tensor] = None,
    edge_sums: bool = False,
):
    """``(out [n_q, H, dv], weights [E, H] or None)`` on sorted edges; ``bias`` is ``[E, 1 or H]`` in sorted order.
    ``softcap`` caps the scaled scores before the bias (``c * tanh(s / c)``); ``sinks [H]`` adds one
    logit per head to each softmax, without a value; both with gradients.

    Per-edge terms in factored form, with gradients: ``edge_features [E, F]`` (the caller's order, q's
    dtype) with ``edge_q [n_q, H, F]`` (``W_h^T q_i``) adds ``scale <edge_q_i, e_ij>`` to the scores,
    and ``edge_sums=True`` also computes the value term's ``s_i = sum_j a_ij e_ij`` ``[n_q, H, F]``
    (after dropout, float32 for float16 / bfloat16 q); with ``edge_features`` the result is
    ``(out, weights or None, sums or None)``.

    ``q``, ``k``, ``v`` may have any strides (a feature dimension that is not contiguous is copied).
    float16 / bfloat16 inputs are read as they are and computed in float32 (the bias too, and
    its gradient); the output, the weights and the gradients of ``q``, ``k``, ``v`` come in the
    input dtype.

    The dropout seed comes from ``generator`` (default: torch's global generator), so
    ``torch.manual_seed`` reproduces the dropped edges.
    """
    if not available():
        raise RuntimeError("tgattn: the fused kernel is unavailable here (see the warning of its build)")
    if q.dtype in (torch.float16, torch.bfloat16) and not half_available():
        raise RuntimeError(f"tgattn: the fused kernel's {q.dtype} part is unavailable here (see the warning of its build)")
    register_fake_kernels()

    seed = int(torch.randint(0, 2**62, (), generator=generator)) if dropout_p > 0 else 0
    bias = None if bias is None else bias.to(compute_dtype(q.dtype))
    sinks = None if sinks is None else sinks.to(compute_dtype(q.dtype))
    edge_q = None if edge_q is None else edge_q.to(compute_dtype(q.dtype)).contiguous()
    edge_features = None if edge_features is None else edge_features.contiguous()
    # The kernels read rows through any row and head strides, but a row's features must be contiguous.
    q, k, v = (t if t.shape[2] <= 1 or t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    out, weights, sums = FusedAttention.apply(q, k, v, bias, sinks, edge_q, edge_features, s, scale, dropout_p, seed,
                                              return_weights, softcap, edge_sums)
    weights = weights.T if return_weights else None
    if edge_features is None:
        return out, weights
    return out, weights, (sums if edge_sums else None)


class ReadsOnly(torch.autograd.Function):
    """The benchmark's ``floor``: reads the rows the fused kernel gathers, computes nothing else.

    Forward reads every edge's key and value rows, as the kernel does. Backward reads four
    rows per edge, as many as the kernel's key pass moves (it reads the query and
    output-gradient rows of each key's edges and reads and writes their ``dq`` rows): the
    value and key rows by query, and the query and output-gradient rows by key.
    ``rows`` are detached ``(q, k, v)`` ``[N, H, d]``; the inputs only connect the graph.
    Outputs and gradients are sums of rows, not attention.
    """

    @staticmethod
    def forward(ctx, q, k, v, rows, s: Structure):
        ctx.rows, ctx.s = rows, s
        _, k_rows, v_rows = rows
        return torch.ops.tgattn_fused.gather_rows(k_rows, v_rows, s.rowptr, s.src)  # [n_q, H, d]

    @staticmethod
    def backward(ctx, grad):
        q_rows, k_rows, v_rows = ctx.rows
        s = ctx.s
        colptr, row_t, _ = transpose_pattern(s)
        by_query = torch.ops.tgattn_fused.gather_rows(v_rows, k_rows, s.rowptr, s.src)  # [n_q, H, d]
        by_key = torch.ops.tgattn_fused.gather_rows(q_rows, grad.contiguous(), colptr, row_t)  # [n_k, H, d]
        return by_query, by_key, by_key, None, None
