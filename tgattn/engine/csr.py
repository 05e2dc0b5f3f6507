"""CSR backend: per-head sparse kernels on the edge pattern, for scattered edge sets.

Scores come from ``torch.sparse.sampled_addmm`` (``<q_i, k_j>`` only where an edge exists),
the softmax runs over ``[E, H]`` edge scores, and aggregation is a sparse CSR x dense
product. The backward pass uses the same three kernels (and the transposed pattern), so
neither direction ever holds an ``[E, H, d]`` tensor: the largest saved tensor is the
weights ``[E, H]``.

This backend honours everything the contract allows: bias (with ``-inf``), dropout, a
multiplicative edge scale (an explainer's edge mask), logit soft-capping and attention sinks,
returned (differentiable) weights, duplicated edges, any edge order and a double backward
(recomputed on the textbook path).
"""
from __future__ import annotations

import warnings
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from . import native
from .analysis import Structure, row_pointer
from .recompute import dropout_factor, gather_attention, recompute_grads
from .softmax import edge_softmax


def _csr(rowptr: Tensor, col: Tensor, values: Tensor, shape: Tuple[int, int]) -> Tensor:
    col = col.to(rowptr.dtype)  # torch's CSR wants one index dtype; the row pointer may be int32 (O(E), not O(n))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta" / invariant-check notices
        return torch.sparse_csr_tensor(rowptr, col, values, shape, check_invariants=False)


def transpose_pattern(s: Structure) -> Tuple[Tensor, Tensor, Tensor]:
    """``(colptr [n_k + 1], row [E], perm [E])``: the pattern sorted by (source, target), cached.

    The edges are sorted by (target, source), so a stable sort by source alone suffices: a
    counting sort in the fused extension on the CPU (O(E + n_k)), else a stable sort whose sorted
    sources give the pointer in one search (int64: three kernels on a GPU where a count and its
    prefix sum take five, and the pointer the Triton kernels and torch's CSR take as it is).
    """
    cached = s.extras.get("transpose")
    if cached is None:
        if s.src.device.type == "cpu" and native.available():
            colptr, perm = torch.ops.tgattn_fused.transpose(s.src, s.n_k)
        else:
            by_source, perm = torch.sort(s.src, stable=True)
            colptr = torch.searchsorted(by_source, torch.arange(s.n_k + 1, device=s.src.device))
        cached = s.extras["transpose"] = (colptr, s.dst[perm], perm)
    return cached


def unique_pattern(s: Structure) -> Tuple[Tensor, Tensor, Tensor]:
    """``(rowptr, col, inverse [E])``: the pattern with each duplicated edge once, cached.

    ``sampled_addmm`` rejects a CSR pattern with repeated entries, so duplicated edges are
    scored once and the score is copied to every copy (``scores[inverse]``).
    """
    cached = s.extras.get("unique")
    if cached is None:
        key = s.dst * max(s.n_k, 1) + s.src  # sorted
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]
        cached = s.extras["unique"] = (row_pointer(s.dst[first], s.n_q), s.src[first], torch.cumsum(first, 0) - 1)
    return cached


def _sampled_dot(s: Structure, a: Tensor, b: Tensor) -> Tensor:
    """``[E, H]`` with entry ``<a[dst, h], b[src, h]>``; ``a`` is ``[H, n_q, d]``, ``b`` ``[H, n_k, d]``."""
    rowptr, col, inverse = unique_pattern(s) if s.duplicates else (s.rowptr, s.src, None)
    pattern = _csr(rowptr, col, a.new_zeros(col.numel()), (s.n_q, s.n_k))
    cols = [torch.sparse.sampled_addmm(pattern, a[h], b[h].T, beta=0.0).values() for h in range(a.shape[0])]
    scores = torch.stack(cols, dim=1)  # [E_unique, H]
    return scores if inverse is None else scores[inverse]  # [E, H]


def _spmm(rowptr: Tensor, col: Tensor, values: Tensor, dense: Tensor, shape: Tuple[int, int]) -> Tensor:
    """``[n_rows, H, d]``: per head, the CSR matrix with ``values[:, h]`` times ``dense[h]``."""
    outs = [_csr(rowptr, col, values[:, h].contiguous(), shape) @ dense[h] for h in range(dense.shape[0])]
    return torch.stack(outs, dim=1)


class CsrAttention(torch.autograd.Function):
    """Sorted-edge attention: returns ``(out [n_q, H, dv], weights [E, H])``.

    ``mult`` (``[E, 1 or H]`` or ``None``) multiplies the weights after the softmax: dropout's
    ``keep / (1 - p)`` and an explainer's edge mask; it receives a gradient. ``softcap`` caps the
    scaled scores before the bias (``c * tanh(s / c)``); ``sinks`` (``[H]`` or ``None``) joins each
    softmax's denominator and receives a gradient.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, mult, sinks, s: Structure, scale: float, softcap: Optional[float]):
        qh, kh, vh = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [H, N, d]
        scores = _sampled_dot(s, qh, kh) * scale  # [E, H]
        capped = None
        if softcap is not None:
            capped = torch.tanh(scores / softcap)  # [E, H], kept for the cap's derivative 1 - tanh^2
            scores = capped * softcap
        if bias is not None:
            scores = scores + bias
        weights = edge_softmax(scores, s.dst, s.n_q, sinks)  # [E, H]
        used = weights if mult is None else weights * mult
        out = _spmm(s.rowptr, s.src, used, vh, (s.n_q, s.n_k))  # [n_q, H, dv]
        ctx.save_for_backward(q, k, v, bias, mult, sinks, weights, capped)
        ctx.s, ctx.scale, ctx.softcap = s, scale, softcap
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        q, k, v, bias, mult, sinks, weights, capped = ctx.saved_tensors
        s, scale, softcap = ctx.s, ctx.scale, ctx.softcap
        if torch.is_grad_enabled():  # create_graph=True: recompute on a twice-differentiable path

            def attend(q, k, v, bias, mult, sinks):
                return gather_attention(q, k, v, s.src, s.dst, s.n_q, bias, scale, mult, softcap, sinks)

            inputs = (q, k, v, bias, mult, sinks)
            grads = recompute_grads(attend, inputs, (grad_out, grad_weights), ctx.needs_input_grad[:6])
            return (*grads, None, None, None)
        qh, kh, vh = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [H, N, d]
        colptr, row_t, perm_t = transpose_pattern(s)
        used = weights if mult is None else weights * mult
        grad_q = grad_k = grad_v = grad_bias = grad_mult = None
        go = grad_out.transpose(0, 1).contiguous()  # [H, n_q, dv]
        d_used = _sampled_dot(s, go, vh)  # [E, H]
        d_weights = d_used if mult is None else d_used * mult
        if grad_weights is not None:
            d_weights = d_weights + grad_weights
        delta = weights.new_zeros(s.n_q, weights.shape[1]).index_add_(0, s.dst, weights * d_weights)
        d_scores = weights * (d_weights - delta[s.dst])  # [E, H]
        d_dots = d_scores if capped is None else d_scores * (1 - capped * capped)  # through the cap
        if ctx.needs_input_grad[0]:
            grad_q = _spmm(s.rowptr, s.src, d_dots, kh, (s.n_q, s.n_k)) * scale
        if ctx.needs_input_grad[1]:
            grad_k = _spmm(colptr, row_t, d_dots[perm_t], qh, (s.n_k, s.n_q)) * scale
        if ctx.needs_input_grad[2]:
            grad_v = _spmm(colptr, row_t, used[perm_t], go, (s.n_k, s.n_q))
        if ctx.needs_input_grad[3]:
            grad_bias = d_scores if bias.shape[1] > 1 else d_scores.sum(1, keepdim=True)
        if ctx.needs_input_grad[4]:
            grad_mult = d_used * weights
            grad_mult = grad_mult if mult.shape[1] > 1 else grad_mult.sum(1, keepdim=True)
        grad_sinks = None
        if ctx.needs_input_grad[5]:
            # The sink's weight is what the edges leave, 1 - sum_j a_ij; its gradient -a_sink * delta_i.
            left = 1 - weights.new_zeros(s.n_q, weights.shape[1]).index_add_(0, s.dst, weights)  # [n_q, H]
            grad_sinks = -(left * delta).sum(0)  # [H]
        return grad_q, grad_k, grad_v, grad_bias, grad_mult, grad_sinks, None, None, None


def csr_attention(
    q,
    k,
    v,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float,
    edge_scale: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
):
    """Run :class:`CsrAttention` on sorted edges; ``bias`` and ``edge_scale`` are ``[E, 1 or H]`` in sorted order."""
    mult = edge_scale
    if dropout_p > 0:
        dropped = dropout_factor(s.num_edges, q.shape[1], dropout_p, q, generator)  # [E, H]
        mult = dropped if mult is None else dropped * mult
    return CsrAttention.apply(q, k, v, bias, mult, sinks, s, scale, softcap)


def recompute_exact(s: Structure, scale: float, *, create_graph: bool) -> Callable[..., Tuple[Tensor]]:
    """``fn(q, k, v, bias) -> (out,)`` on structure ``s`` for :func:`recompute_grads`: the
    textbook path for a double backward, else the CSR kernels (both touch only the edges)."""
    if create_graph:
        return lambda q, k, v, bias: gather_attention(q, k, v, s.src, s.dst, s.n_q, bias, scale)[:1]
    return lambda q, k, v, bias: csr_attention(q, k, v, s, bias, scale, 0.0)[:1]
