"""One call of the engine outside ``torch.compile``: the inputs checked, then the backend run.

:func:`tgattn.functional.graph_attention` calls it in eager mode, and the custom op
(:mod:`tgattn.engine.custom_op`) calls it inside its kernels, so both check alike.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import recompute
from .analysis import on_host
from .dispatch import compute_dtype, query_heads, run
from .edgeset import EdgeSet, structure_of
from .touched import on_touched_keys
from .validate import check_device, check_edge_index

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [N, H, d] (got {list(t.shape)})")
        if t.dtype not in FLOATS:
            raise ValueError(f"{name} must be a floating-point tensor (got {t.dtype})")
    if q.device.type == "meta":
        raise ValueError("q is on the meta device, which holds no values: attention needs them (the edges' analysis, "
                         "the softmax)")
    check_device("k", k, q)
    check_device("v", v, q)
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if q.shape[1] == 0 or q.shape[2] == 0:
        raise ValueError(f"q must have at least one head and a head dim >= 1 (got {list(q.shape)})")
    if k.shape[1] != v.shape[1] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:  # grouped-query heads: H = G * Hkv
        raise ValueError(f"q's number of heads must be a multiple of k's, and v must have k's (grouped-query "
                         f"attention; got q {q.shape[1]}, k {k.shape[1]} and v {v.shape[1]} heads)")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim (got {q.shape[2]} and {k.shape[2]})")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of nodes (got {k.shape[0]} and {v.shape[0]})")


def check_edge_tensor(name: str, t: Tensor, num_edges: int, q: Tensor) -> Tensor:
    """A per-edge tensor ``[E]`` or ``[E, 1 or H]`` of floats, returned as ``[E, 1 or H]``.

    Its dtype follows scaled_dot_product_attention's rule for a float ``attn_mask``: q's dtype
    or float32 (the kernels compute in one dtype; any other would be a silent cast or a crash).
    """
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in FLOATS:
        raise ValueError(f"{name} must be a floating-point tensor (got {t.dtype})")
    check_device(name, t, q)
    if t.dtype not in (q.dtype, torch.float32):
        raise ValueError(f"{name} must have q's dtype or float32 (got {name} {t.dtype} with q {q.dtype})")
    if t.dim() == 1:
        t = t.unsqueeze(-1)
    num_heads = q.shape[1]
    if t.dim() != 2 or t.shape[0] != num_edges or t.shape[1] not in (1, num_heads):
        raise ValueError(f"{name} must have shape [E] or [E, H] = [{num_edges}, {num_heads}] (got {list(t.shape)})")
    return t


def check_bias(bias: Tensor, num_edges: int, q: Tensor) -> Tensor:
    bias = check_edge_tensor("bias", bias, num_edges, q)
    # On a GPU the check would make the host wait for the device: there +inf gives NaN instead.
    if on_host(bias) and torch.isposinf(bias).any():
        raise ValueError("bias holds +inf, which has no softmax; use -inf to remove an edge")
    return bias


def check_softcap(softcap, dtype=None) -> None:
    """A positive finite number; with ``dtype`` (q's) also a normal number of the dtype the scores are
    computed in (float32 for half precision): a cap that rounds to 0 or to infinity there has no
    meaning the kernels could honour (0 reads as "no cap" in the fused kernel, infinity gives NaN).

    Example:
        >>> check_softcap(1e-46, torch.bfloat16)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: softcap must be within [1.1754943508222875e-38, 3.4028234663852886e+38] for ... (got 1e-46)
    """
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap must be a positive finite number or None (got {type(softcap).__name__} {softcap!r})")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a positive finite number (got {softcap})")
    if dtype is not None:
        info = torch.finfo(compute_dtype(dtype))
        if not info.tiny <= softcap <= info.max:
            raise ValueError(f"softcap must be within [{info.tiny}, {info.max}] for {dtype} inputs, whose scores are "
                             f"computed in {compute_dtype(dtype)} (got {softcap})")


def check_sinks(sinks: Tensor, q: Tensor) -> Tensor:
    """One sink logit per head ``[H]``, of q's dtype or float32 (the rule of ``bias``)."""
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks must be a torch.Tensor (got {type(sinks).__name__})")
    if sinks.dtype not in (q.dtype, torch.float32) or not sinks.is_floating_point():
        raise ValueError(f"sinks must have q's dtype or float32 (got sinks {sinks.dtype} with q {q.dtype})")
    check_device("sinks", sinks, q)
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must have shape [H] = [{q.shape[1]}] (got {list(sinks.shape)})")
    if on_host(sinks) and torch.isposinf(sinks).any():  # on a GPU: NaN outputs instead of a host sync
        raise ValueError("sinks holds +inf, which has no softmax; use -inf for a head without a sink")
    return sinks


def eager_graph_attention(
    q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, generator=None, *,
    softcap=None, sinks=None,
):
    """:func:`tgattn.functional.graph_attention` outside ``torch.compile``: checks, analysis, engine.

    ``edge_index``: a prepared :class:`~tgattn.engine.edgeset.EdgeSet` (its node counts checked, its
    edges not again), or a tensor, prepared through the engine's cache (validated on a miss only).
    Returns ``(out, weights or None)``; ``generator`` draws the dropout mask of the ``csr``
    backend and of ``gather``.
    """
    check_qkv(q, k, v)
    prepared = isinstance(edge_index, EdgeSet)
    if prepared:
        num_edges = edge_index.check_sizes(q.shape[0], k.shape[0], q.device).num_edges
    else:
        if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
            check_edge_index(edge_index, k.shape[0], q.shape[0])  # raises, naming what is wrong
        check_device("edge_index", edge_index, q)
        num_edges = edge_index.shape[1]
    if bias is not None:
        bias = check_bias(bias, num_edges, q)
    if edge_scale is not None:
        edge_scale = check_edge_tensor("edge_scale", edge_scale, num_edges, q)
    if softcap is not None:
        check_softcap(softcap, q.dtype)
    if sinks is not None:
        sinks = check_sinks(sinks, q)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "gather" or num_edges == 0:
        ei = edge_index.edge_index if prepared else check_edge_index(edge_index, k.shape[0], q.shape[0])
        k, v = query_heads(k, v, q.shape[1])
        work = compute_dtype(q.dtype)
        cast = (lambda t: t) if work == q.dtype else (lambda t: None if t is None else t.to(work))  # noqa: E731
        mult = edge_scale
        if dropout_p > 0:
            dropped = recompute.dropout_factor(num_edges, q.shape[1], dropout_p, cast(q), generator)  # [E, H]
            mult = dropped if mult is None else mult * dropped
        out, weights = recompute.gather_attention(
            cast(q), cast(k), cast(v), ei[0], ei[1], q.shape[0], cast(bias), scale, cast(mult), softcap, cast(sinks)
        )
        return nan_sink_heads(out.to(q.dtype), sinks), weights.to(q.dtype) if return_weights else None
    s = edge_index.structure if prepared else structure_of(edge_index, q.shape[0], k.shape[0])
    s, k, v = on_touched_keys(s, k, v)
    out, weights = run(
        q, k, v, s, bias, scale, dropout_p, return_weights, backend, edge_scale=edge_scale, generator=generator,
        softcap=softcap, sinks=sinks,
    )
    return nan_sink_heads(out, sinks), weights


def nan_sink_heads(out: Tensor, sinks) -> Tensor:
    """``out [Nq, H, dv]`` NaN in every head whose sink is NaN, the same on every backend.

    A NaN sink is in every softmax of its head: the edges' weights are NaN (the edge-wise softmax
    keeps a NaN denominator; the fused kernel's max would drop the sink, so :func:`run` sends such
    a call to ``csr``), and so is the output of a query without edges, whose softmax holds the sink
    alone (Triton's kernel gives that NaN by itself; the edge-wise sums would give 0). On a GPU the
    NaN is added without reading the sinks back (no host sync).
    """
    if sinks is None or (on_host(sinks) and not bool(torch.isnan(sinks).any())):
        return out
    return out + torch.where(torch.isnan(sinks), sinks, 0).to(out.dtype).view(1, -1, 1)
