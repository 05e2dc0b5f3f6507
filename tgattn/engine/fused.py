"""Fused backend: a C++ kernel that walks each query's CSR row once per direction.

The kernel (``fused.cpp``) computes scores, softmax and aggregation for a block of query rows
in one pass, reading each key and value row for all heads while it is in cache, and skips the
dot products of edges whose bias is ``-inf``. The backward pass recomputes nothing it saved:
it reads the weights ``[E, H]`` and walks the transposed pattern for ``dk`` / ``dv``, so no
``[E, H, d]`` tensor exists in either direction. A double backward (``create_graph=True``)
recomputes the gradients on the textbook per-edge path, which is twice differentiable.
The kernels check the CSR structure they are given (one pass over the indices), so a
malformed structure raises instead of reading out of bounds.

The extension is compiled on first use with :func:`torch.utils.cpp_extension.load` (about
half a minute, cached under ``~/.cache/torch_extensions``). Without a C++ compiler or
``ninja``, or with ``TGATTN_NO_FUSED=1`` in the environment, :func:`available` is false and
the engine runs the CSR backend instead: same results, slower.
"""
from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from .analysis import Structure
from .csr import transpose_pattern
from .recompute import gather_attention, recompute_grads

_SOURCE = Path(__file__).with_name("fused.cpp")
_state = {"tried": False, "ok": False, "fakes": False}


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the build uses ``-march=native``."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


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
        try:
            from torch.utils import cpp_extension

            cpp_extension.load(
                name=f"tgattn_fused_{_cpu_tag()}",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
            _state["ok"] = True
        except Exception as err:  # no compiler, no ninja, a read-only cache: fall back, loudly once
            warnings.warn(f"tgattn: fused kernel unavailable ({type(err).__name__}: {err}); using the CSR backend")
    return _state["ok"]


def _register_fake_kernels() -> None:
    """Shapes of the C++ ops' outputs, so that ``torch.compile`` can trace calls to them."""

    @torch.library.register_fake("tgattn_fused::forward")
    def _(q, k, v, rowptr, col, bias, scale):
        return [q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[0], col.shape[0])]

    @torch.library.register_fake("tgattn_fused::backward")
    def _(grad_out, q, k, v, weights, grad_weights, rowptr, col, colptr, row_t, perm_t, scale):
        return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(weights)]

    @torch.library.register_fake("tgattn_fused::gather_rows")
    def _(a, b, ptr, idx):
        return a.new_empty(a.shape[0], ptr.shape[0] - 1, a.shape[2])


class FusedAttention(torch.autograd.Function):
    """Head-major attention on the fused kernel: ``(out [H, n_q, dv], weights [H, E])``."""

    @staticmethod
    def forward(ctx, qh, kh, vh, bias, s: Structure, scale: float):
        out, weights = torch.ops.tgattn_fused.forward(qh, kh, vh, s.rowptr, s.src, bias, scale)
        ctx.save_for_backward(qh, kh, vh, bias, weights)
        ctx.s, ctx.scale = s, scale
        return out, weights

    @staticmethod
    def backward(ctx, grad_out, grad_weights):
        qh, kh, vh, bias, weights = ctx.saved_tensors
        s = ctx.s
        if torch.is_grad_enabled():  # create_graph=True: recompute on a twice-differentiable path
            heads = lambda t: t.transpose(0, 1)  # noqa: E731  # [H, N, d] <-> [N, H, d]

            def attend(qh, kh, vh, bias):
                out, w = gather_attention(heads(qh), heads(kh), heads(vh), s.src, s.dst, s.n_q, bias, ctx.scale)
                return heads(out), w.T

            grads = recompute_grads(attend, (qh, kh, vh, bias), (grad_out, grad_weights), ctx.needs_input_grad[:4])
            return (*grads, None, None)
        colptr, row_t, perm_t = transpose_pattern(s)
        grad_q, grad_k, grad_v, d_scores = torch.ops.tgattn_fused.backward(
            grad_out, qh, kh, vh, weights, grad_weights, s.rowptr, s.src, colptr, row_t, perm_t, ctx.scale
        )
        grad_bias = None
        if ctx.needs_input_grad[3]:
            grad_bias = d_scores.T if bias.shape[1] > 1 else d_scores.sum(0).unsqueeze(1)  # [E, 1 or H]
        return grad_q, grad_k, grad_v, grad_bias, None, None


def fused_attention(q: Tensor, k: Tensor, v: Tensor, s: Structure, bias: Optional[Tensor], scale: float):
    """``(out [n_q, H, dv], weights [E, H])`` on sorted edges; ``bias`` is ``[E, 1 or H]`` in sorted order."""
    if not _state["fakes"]:
        _register_fake_kernels()
        _state["fakes"] = True
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
