"""The fused C++ extension (``csrc/``): loading it, and its cache of freed buffers.

The extension (:data:`~tgattn.engine.build.FUSED`) is compiled on first use, or ahead of it by
``python -m tgattn build``, with :func:`torch.utils.cpp_extension.load` (its units side by
side on every core, with progress; cached under ``~/.cache/torch_extensions``); its float16 /
bfloat16 kernels (:data:`~tgattn.engine.build.FUSED_HALF`) when a float16 / bfloat16 call first
needs them (:func:`half_available`), or ahead by ``python -m tgattn build --half``. Without a C++ compiler or
``ninja``, or with ``TGATTN_NO_FUSED=1`` in the environment, :func:`available` is false (one
warning says why) and the engine runs the CSR backend instead: same results, slower.

Outputs, gradients and scratch of 1 MB or more come from a cache of freed blocks (as PyTorch's
CUDA caching allocator does on the GPU): a training step reuses the pages of the step before
instead of asking the system for fresh ones, whose first touch cost up to a third of a step at
n = 1M. Free blocks never add up to more than the cache's blocks ever held in use at once (one
step's worth), nor to more than half of the machine's memory or ``TGATTN_CPU_CACHE`` bytes
(``0`` turns the cache off; ``512M``, ``8G``); :func:`empty_cache` hands them back and
:func:`cache_info` counts them.

The engine's modules that call the extension's ops (sorting and transposing edges in
:mod:`~tgattn.engine.analysis` and :mod:`~tgattn.engine.csr`, the attention in
:mod:`~tgattn.engine.fused`) import this module, which imports none of them.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from .build import FUSED, FUSED_HALF
from .precision import compute_dtype

_state = {"tried": False, "ok": False, "fakes": False, "half": None}


def available() -> bool:
    """Whether the fused kernel is compiled and loaded (compiles it on the first call).

    Example:
        >>> isinstance(available(), bool)
        True
    """
    if not _state["tried"]:
        limit = cache_limit_from_env(os.environ.get("TGATTN_CPU_CACHE"))  # a bad value raises on every call
        _state["tried"] = True
        if os.environ.get("TGATTN_NO_FUSED", "") not in ("", "0"):
            warnings.warn(f"tgattn: TGATTN_NO_FUSED={os.environ['TGATTN_NO_FUSED']} turns the fused C++ kernel off; "
                          "using the CSR backend (same results, slower)")
            return False
        _state["ok"] = FUSED.load()
        if _state["ok"] and limit is not None:
            torch.ops.tgattn_fused.cache_limit(limit)
    return _state["ok"]


def half_available() -> bool:
    """Whether the fused kernel's float16 / bfloat16 part is compiled and loaded: a library of its own
    (:data:`~tgattn.engine.build.FUSED_HALF`), which the first float16 / bfloat16 call compiles, so that a
    float32 user's first build leaves it out (its units were half the kernel's compile time).

    Example:
        >>> half_available() == available()  # where the kernel builds, its half part does too
        True
    """
    if _state["half"] is None:
        _state["half"] = available() and FUSED_HALF.load()
    return _state["half"]


def cache_limit_from_env(raw: Optional[str]) -> Optional[int]:
    """Bytes from ``TGATTN_CPU_CACHE`` (a count, or with a ``K`` / ``M`` / ``G`` suffix, powers
    of 1024); None when unset or empty.

    Example:
        >>> cache_limit_from_env("512M"), cache_limit_from_env("0"), cache_limit_from_env(None)
        (536870912, 0, None)
    """
    if raw is None or not raw.strip():
        return None
    text = raw.strip().upper()
    power = "KMG".find(text[-1]) + 1 if text[-1] in "KMG" else 0
    number = text[:-1] if power else text
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"TGATTN_CPU_CACHE={raw!r}: expected a number of bytes >= 0, such as 0, 512M or 8G")
    return int(value * 1024**power)


def takes(*tensors: Optional[Tensor]) -> bool:
    """Whether the extension's float ops (the per-head maps, the ``beta`` gate) take these tensors:
    float32 / float64 CPU tensors of one dtype (``None`` skipped), outside ``torch.compile``, with the
    extension built.

    Example:
        >>> takes(torch.zeros(2), None) == available(), takes(torch.zeros(2, dtype=torch.bfloat16))
        (True, False)
    """
    given = [t for t in tensors if t is not None]
    dtype = given[0].dtype
    if torch.compiler.is_compiling() or dtype not in (torch.float32, torch.float64):
        return False
    return all(t.device.type == "cpu" and t.dtype == dtype for t in given) and available()


def cache_info() -> dict:
    """The fused kernels' cache of freed buffers: ``held`` (bytes of free blocks kept), ``live``
    (bytes of its blocks in use), ``peak`` (the most ever in use at once, which bounds
    ``held``), ``hits`` and ``misses`` (requests of 1 MB or more served from it or not) and
    ``limit``.

    Example:
        >>> import torch
        >>> from tgattn import builders
        >>> from tgattn.functional import graph_attention
        >>> q = torch.randn(4096, 8, 64)
        >>> edges = builders.window(4096, 4)
        >>> out = graph_attention(q, q, q, edges, backend="fused")  # out: 8 MB
        >>> del out
        >>> hits = cache_info()["hits"]
        >>> out = graph_attention(q, q, q, edges, backend="fused")  # the same 8 MB again
        >>> cache_info()["hits"] > hits
        True
    """
    if not available():
        return dict(held=0, live=0, peak=0, hits=0, misses=0, limit=0)
    return dict(zip(("held", "live", "peak", "hits", "misses", "limit"), torch.ops.tgattn_fused.cache_info()))


def empty_cache() -> None:
    """Hands the fused kernels' free buffers back to the system (tensors in use are untouched)
    and restarts ``peak`` (see :func:`cache_info`) from the bytes in use now.

    Example:
        >>> empty_cache()
        >>> cache_info()["held"]
        0
    """
    if available():
        torch.ops.tgattn_fused.empty_cache()


def register_fake_kernels() -> None:
    """Shapes of the C++ ops' outputs, so that ``torch.compile`` can trace calls to them (once)."""
    if _state["fakes"]:
        return
    _state["fakes"] = True

    @torch.library.register_fake("tgattn_fused::forward")
    def _(q, k, v, rowptr, col, bias, scale, dropout_p, seed, weights, softcap=0.0, sinks=None, edge_q=None,
          edge_features=None, edge_sums=False, edge_perm=None):
        w = q.new_empty(q.shape[1], col.shape[0]) if weights else q.new_empty(0)
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=compute_dtype(q.dtype))
        outs = [q.new_empty(q.shape[0], q.shape[1], v.shape[2]), lse, w]
        if edge_sums:  # the value term's sums [n_q, H, F]
            outs.append(lse.new_empty(q.shape[0], q.shape[1], edge_features.shape[1]))
        return outs

    @torch.library.register_fake("tgattn_fused::backward")
    def _(grad_out, q, k, v, out, lse, weights, grad_weights, bias, rowptr, colptr, row_t, perm_t, scale, dropout_p,
          seed, grad_bias, softcap=0.0, sinks=None, edge_q=None, edge_features=None, edge_sums=None, grad_sums=None,
          edge_perm=None, col=None):
        ds = q.new_empty(q.shape[1], row_t.shape[0] if grad_bias else 0, dtype=compute_dtype(q.dtype))
        grads = [q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), ds]
        if sinks is not None:
            grads.append(sinks.new_empty(sinks.shape))  # the sinks' gradient
        if edge_features is not None:  # the gradients of edge_q (empty without it) and of the features
            grads += [ds.new_empty(edge_q.shape if edge_q is not None else (0,)), ds.new_empty(edge_features.shape)]
        return grads

    @torch.library.register_fake("tgattn_fused::transpose_rows")
    def _(rowptr, col, n_k, with_perm, narrow):
        dtype = torch.int32 if narrow else torch.int64
        perm = col.new_empty(col.shape[0] if with_perm else 0, dtype=dtype)
        return [col.new_empty(n_k + 1, dtype=dtype), col.new_empty(col.shape, dtype=dtype), perm]

    @torch.library.register_fake("tgattn_fused::transpose")
    def _(col, n_k):
        return [col.new_empty(n_k + 1), torch.empty_like(col)]

    @torch.library.register_fake("tgattn_fused::sort_edges")
    def _(src, dst, n_q, n_k):
        rowptr = src.new_empty(n_q + 1, dtype=torch.int32 if src.shape[0] < 2**31 else torch.int64)
        return [torch.empty_like(src), torch.empty_like(src), torch.empty_like(dst), src.new_empty((), dtype=torch.bool), rowptr,
                src.new_empty(7)]

    @torch.library.register_fake("tgattn_fused::gather_rows")
    def _(a, b, ptr, idx):
        return a.new_empty(ptr.shape[0] - 1, a.shape[1], a.shape[2])


def dropout_keep(heads: int, edges: int, dropout_p: float, seed: int) -> Tensor:
    """The edges ``[H, E]`` (sorted order) that the kernels keep under dropout with this seed."""
    return torch.ops.tgattn_fused.dropout_keep(heads, edges, dropout_p, seed)
