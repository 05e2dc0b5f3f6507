"""Fused backend: a C++ kernel that walks each query's CSR row once per direction.

The kernel (``fused.cpp``) computes scores, softmax and aggregation for a block of query rows
in one pass, reading each key and value row for all heads while it is in cache, and skips the
dot products of edges whose bias is ``-inf``. The backward pass recomputes nothing it saved:
it reads the weights ``[E, H]`` and walks the transposed pattern for ``dk`` / ``dv``, so no
``[E, H, d]`` tensor exists in either direction.

The extension is compiled on first use with :func:`torch.utils.cpp_extension.load` (about
half a minute, cached under ``~/.cache/torch_extensions``). Without a C++ compiler or
``ninja``, or with ``TGATTN_NO_FUSED=1`` in the environment, :func:`available` is false and
the engine runs the CSR backend instead: same results, slower.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .analysis import Structure
from .build import load_extension
from .csr import transpose_pattern

_SOURCE = Path(__file__).with_name("fused.cpp")
_state = {"tried": False, "ok": False}


def available() -> bool:
    """Whether the fused kernel is compiled and loaded (compiles it on the first call).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("TGATTN_NO_FUSED", "") not in ("", "0"):
            return False
        _state["ok"] = load_extension(
            "tgattn_fused",
            _SOURCE,
            cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
            ldflags=["-fopenmp"],
            fallback="the CSR backend",
        )
    return _state["ok"]


class FusedAttention(torch.autograd.Function):
    """Head-major attention on the fused kernel: ``(out [H, n_q, dv], weights [H, E])``."""

    @staticmethod
    def forward(ctx, qh, kh, vh, bias, s: Structure, scale: float):
        out, weights = torch.ops.tgattn_fused.forward(qh, kh, vh, s.rowptr, s.src, bias, scale)
        ctx.save_for_backward(qh, kh, vh, weights)
        ctx.s, ctx.scale, ctx.bias_heads = s, scale, None if bias is None else bias.shape[1]
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        if torch.is_grad_enabled():  # create_graph=True: the kernel's gradients would carry no graph
            raise RuntimeError(
                "the fused attention kernel has no second derivative; "
                "pass backend='csr' to graph_attention (or GraphAttention) for double backward"
            )
        qh, kh, vh, weights = ctx.saved_tensors
        s = ctx.s
        colptr, row_t, perm_t = transpose_pattern(s)
        grad_q, grad_k, grad_v, d_scores = torch.ops.tgattn_fused.backward(
            grad_out, qh, kh, vh, weights, grad_weights, s.rowptr, s.src, colptr, row_t, perm_t, ctx.scale
        )
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_bias = d_scores.T if ctx.bias_heads > 1 else d_scores.sum(0).unsqueeze(1)  # [E, 1 or H]
        return grad_q, grad_k, grad_v, grad_bias, None, None


def fused_attention(q: Tensor, k: Tensor, v: Tensor, s: Structure, bias: Optional[Tensor], scale: float):
    """``(out [n_q, H, dv], weights [E, H])`` on sorted edges; ``bias`` is ``[E, 1 or H]`` in sorted order."""
    qh, kh, vh = (t.transpose(0, 1).contiguous() for t in (q, k, v))  # [H, N, d]
    bias = None if bias is None else bias.to(q.dtype)
    out, weights = FusedAttention.apply(qh, kh, vh, bias, s, scale)
    return out.transpose(0, 1), weights.T


class ReadsOnly(torch.autograd.Function):
    """The benchmark's ``floor``: reads the rows the fused kernel gathers, computes nothing else.

    Forward reads every edge's key and value rows; backward the value and key rows of the
    row pass and the query and output-gradient rows of the key pass, in the kernel's order.
    ``heads`` are head-major copies of ``(q, k, v)`` made outside the timed region; the
    inputs only connect the graph. Outputs and gradients are sums of rows, not attention.
    """

    @staticmethod
    def forward(ctx, q, k, v, heads, s: Structure):
        ctx.heads, ctx.s = heads, s
        _, kh, vh = heads
        return torch.ops.tgattn_fused.gather_rows(kh, vh, s.rowptr, s.src)  # [H, n_q, d]

    @staticmethod
    def backward(ctx, grad):
        qh, kh, vh = ctx.heads
        s = ctx.s
        colptr, row_t, _ = transpose_pattern(s)
        rows = torch.ops.tgattn_fused.gather_rows(vh, kh, s.rowptr, s.src).transpose(0, 1)
        keys = torch.ops.tgattn_fused.gather_rows(qh, grad.contiguous(), colptr, row_t).transpose(0, 1)
        return rows, keys, keys, None, None
