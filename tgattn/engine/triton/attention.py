"""Autograd around the Triton kernels, and the entry the engine calls.

Nothing here imports ``triton``: :func:`kernels_module` imports the kernels on first use, so
``import tgattn`` stays light and works without Triton.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..analysis import Structure
from ..csr import transpose_pattern

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Elements of one gathered [BLOCK_M, BLOCK_N, d] chunk of float32 (half as many of float64): 16
# a thread at Triton's 4 warps. Compiled for sm_90 (tgattn.engine.triton.aot), 8192 spilled up to
# 3 KB a thread (dq, float64, d = 32) and 4096 up to 408 bytes (dk / dv, float32, d = 16); 2048
# spills nothing on sm_80 or sm_90 (data/gpu/compiled.md).
CHUNK_ELEMENTS = 2048
BLOCK_N = 16  # edge slots per row and chunk (fewer when one row's chunk would exceed the budget)


def available() -> bool:
    """Whether ``triton`` can be imported (and ``TGATTN_NO_TRITON`` does not turn it off).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if os.environ.get("TGATTN_NO_TRITON", "") not in ("", "0"):
        return False
    return _installed()


@functools.lru_cache(maxsize=None)
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET=1`` asks for Triton's interpreter (kernels on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_ready() -> bool:
    """Whether the interpreter can run the kernels: ``TRITON_INTERPRET=1`` is set and was set
    when ``triton`` was imported (Triton defines its own jit library then), or triton is not
    imported yet.

    Example:
        >>> interpreter_ready() <= interpreting()  # ready implies asked for
        True
    """
    if not interpreting():
        return False
    language = sys.modules.get("triton.language")
    return language is None or type(language.zeros).__name__ == "InterpretedFunction"


def usable(q: Tensor, *, named: bool = False) -> bool:
    """Whether the kernels can run on inputs like ``q``: CUDA tensors of a float dtype, or
    (only when the backend is named) CPU tensors under Triton's interpreter.

    Example:
        >>> usable(torch.zeros(2, 1, 4))  # a CPU tensor: only the interpreter runs it
        False
    """
    if q.dtype not in DTYPES:
        return False
    if q.device.type == "cuda":
        return available()
    return named and q.device.type == "cpu" and interpreter_ready() and available()


def kernels_module():
    """The kernel module, imported on first use (re-imported when ``TRITON_INTERPRET`` changed)."""
    from . import kernels

    if kernels.INTERPRETED != interpreting():
        kernels = importlib.reload(kernels)
    return kernels


def blocks_for(dk: int, dv: int, dtype: torch.dtype = torch.float32, softcap: bool = False) -> Tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: rows per program and edge slots per chunk for head dims ``dk, dv``
    and inputs of ``dtype`` (float64 accumulates in float64: half the elements; with a
    ``softcap``, whose tanh the backward keeps per slot, half again: the dq kernel with every
    option spilled 8-12 bytes on sm_90 at float64, d = 16, otherwise). float32 with a softcap
    from d = 64 takes half the rows: the dk-dv kernel with every option held 254 of 255
    registers on sm_90 under triton 3.7 at 2 rows, and spilled 16 bytes under triton 3.9.

    Example:
        >>> blocks_for(64, 64), blocks_for(16, 16), blocks_for(128, 128, torch.float64)
        ((2, 16), (8, 16), (1, 8))
        >>> blocks_for(16, 16, torch.float64), blocks_for(16, 16, torch.float64, softcap=True)
        ((4, 16), (2, 16))
        >>> blocks_for(64, 64, softcap=True), blocks_for(64, 64, torch.bfloat16, softcap=True)
        ((1, 16), (2, 16))
    """
    d = 1 << (max(dk, dv, 1) - 1).bit_length()  # next power of two
    chunk = CHUNK_ELEMENTS // (2 if dtype == torch.float64 else 1) // (2 if softcap and dtype == torch.float64 else 1)
    block_n = max(1, min(BLOCK_N, chunk // d))
    rows = max(1, min(16, chunk // (block_n * d)))
    return (max(1, rows // 2) if softcap and dtype == torch.float32 and d >= 64 else rows), block_n


def walks(s: Structure):
    """``((rowptr, src, row_order), (colptr, row_t, perm_t, col_order))``, cached on ``s``.

    The orders list query rows (key columns) by decreasing degree, so that the rows of one
    program have about as many edges each. The pointers are int64 here (the analysis's may be
    int32): the kernels form edge offsets from them, ``e * H`` among them. With as many queries
    as keys, both pointers are one tensor and both orders come from one sort (on a new edge set,
    3 kernels where they would take 5).
    """
    cached = s.extras.get("triton")
    if cached is None:
        colptr, row_t, perm_t = transpose_pattern(s)
        if s.n_q == s.n_k:
            rowptr, colptr = ptrs = torch.stack([s.rowptr, colptr]).long()  # [2, n + 1]
            row_order, col_order = _by_degree(ptrs)
        else:
            rowptr, colptr = s.rowptr.long(), colptr.long()
            row_order, col_order = _by_degree(rowptr), _by_degree(colptr)
        rows = (rowptr, s.src, row_order)
        cached = s.extras["triton"] = (rows, (colptr, row_t, perm_t, col_order))
    return cached


def _by_degree(ptr: Tensor) -> Tensor:
    """Row ids by decreasing degree (stable: rows of equal degree keep their order), per pointer ``[..., n + 1]``."""
    return torch.argsort(ptr[..., :-1] - ptr[..., 1:], dim=-1, stable=True)


def draw_seed() -> int:
    """The dropout seed of one call, drawn from torch's CPU generator (no device sync)."""
    return int(torch.randint(0, 2**31 - 1, ()))


def dropout_keep(seed: int, num_edges: int, heads: int, p: float, device="cpu") -> Tensor:
    """The dropout mask ``[E, H]`` (True = kept, sorted edge order) of a call drawing ``seed``.

    Example (under ``TRITON_INTERPRET=1`` on CPU)::

        torch.manual_seed(0); seed = draw_seed()
        torch.manual_seed(0); out = triton_attention(q, k, v, s, None, scale, 0.5, False)
        keep = dropout_keep(seed, s.num_edges, q.shape[1], 0.5)
    """
    return kernels_module().keep(num_edges, heads, p, seed, device)


def _unit_stride(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttention(torch.autograd.Function):
    """Sorted-edge attention on the Triton kernels: ``(out [n_q, H, dv], weights [E, H] or [0, H])``."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, s: Structure, scale: float, p: float, weights: bool, blocks, softcap):
        kern = kernels_module()
        q, k, v = (_unit_stride(t) for t in (q, k, v))
        sinks = None if sinks is None else sinks.contiguous()
        rows, cols = walks(s)
        seed = draw_seed() if p > 0 else 0
        out, lse, w, _ = kern.forward(q, k, v, bias, *rows, scale, p, seed, weights, blocks, softcap, sinks)
        if not weights:
            ctx.mark_non_differentiable(w)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, bias, sinks, out, lse, w)
        ctx.s, ctx.scale, ctx.p, ctx.seed, ctx.blocks, ctx.softcap = s, scale, p, seed, blocks, softcap
        return out, w

    @staticmethod
    def backward(ctx, grad_out, grad_w):
        if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients carry no graph
            raise RuntimeError(
                "the Triton attention kernels have no second derivative; "
                "pass backend='csr' to graph_attention (or GraphAttention) for double backward"
            )
        q, k, v, bias, sinks, out, lse, w = ctx.saved_tensors
        s = ctx.s
        grad_out = torch.zeros_like(out) if grad_out is None else _unit_stride(grad_out)
        delta, grad_w = softmax_delta(grad_out, out, lse, w, grad_w, s)
        rows, cols = walks(s)
        bias_grad = bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, d_scores, *_ = kernels_module().backward(
            q, k, v, bias, grad_out, lse, delta, grad_w, rows, cols,
            ctx.scale, ctx.p, ctx.seed, bias_grad, ctx.blocks, ctx.softcap,
        )
        grad_bias, grad_sinks = bias_and_sink_grads(bias, sinks, d_scores, lse, delta, bias_grad, ctx.needs_input_grad[4])
        return dq, dk, dv, grad_bias, grad_sinks, None, None, None, None, None, None


def softmax_delta(grad_out: Tensor, out: Tensor, lse: Tensor, w: Tensor, grad_w: Optional[Tensor], s: Structure):
    """``(delta [H, n_q], grad_w contiguous or None)``: ``delta_i = <dO_i, O_i>`` (plus the returned weights'
    share ``sum_j a_ij dW_ij``), in the layout the backward kernels read."""
    delta = lse.new_empty(lse.shape)  # [H, n_q] as the kernels read it, summed into in place (no transposed copy)
    torch.sum(grad_out.to(lse.dtype) * out.to(lse.dtype), -1, out=delta.T)  # <dO_i, O_i>
    if grad_w is not None:  # the returned weights' gradient joins each row's softmax backward
        grad_w = grad_w.contiguous()
        delta.T.index_add_(0, s.dst, w.to(lse.dtype) * grad_w.to(lse.dtype))
    return delta, grad_w


def bias_and_sink_grads(bias, sinks, d_scores, lse, delta, bias_grad: bool, sinks_grad: bool):
    """``(grad_bias [E, 1 or H] or None, grad_sinks [H] or None)`` from the kernels' score gradients."""
    grad_bias = grad_sinks = None
    if bias_grad:
        grad_bias = (d_scores if bias.shape[1] > 1 else d_scores.sum(1, keepdim=True)).to(bias.dtype)
    if sinks is not None and sinks_grad:
        # The sink's weight in row i is exp(sink - lse_i); as a score without a value its
        # gradient is that weight times (0 - delta_i). Rows without a logit have lse = +inf.
        grad_sinks = -(torch.exp(sinks.to(lse.dtype)[:, None] - lse) * delta).sum(1).to(sinks.dtype)
    return grad_bias, grad_sinks


def triton_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    s: Structure,
    bias: Optional[Tensor],
    scale: float,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    *,
    blocks: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """``(out [n_q, H, dv], weights [E, H] or None)`` on sorted edges; ``bias`` is ``[E, 1 or H]``
    in sorted order. ``blocks = (BLOCK_M, BLOCK_N)`` overrides :func:`blocks_for`.

    Accumulates in float32 (float64 for float64 inputs); dropout draws its seed from torch's
    CPU generator (:func:`dropout_keep` regenerates the mask). ``softcap`` caps the scaled
    scores before the bias (``c * tanh(s / c)``); ``sinks [H]`` adds one logit per head to
    each softmax, without a value; both with gradients.
    """
    blocks = blocks or blocks_for(q.shape[2], v.shape[2], q.dtype, softcap is not None)
    out, w = TritonAttention.apply(q, k, v, bias, sinks, s, scale, dropout_p, return_weights, blocks, softcap)
    return out, (w if return_weights else None)
