"""Attention over an edge set, as a function of per-node queries, keys and values.

Edge convention (the same everywhere in tgattn): ``edge_index[0]`` = source = key/value
node j, ``edge_index[1]`` = target = query node i. The dense twin of an edge set is
``mask[i, j] = True`` (rows = queries i, columns = keys j).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import engine
from .engine.analysis import on_host
from .engine.softmax import edge_softmax  # noqa: F401  (public: the layer's message path uses it)
from .engine.validate import check_edge_index  # noqa: F401  (public: builders and analysis use it)

BACKENDS = ("auto", "gather", "dense", "tile", "fused", "csr", "triton")
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [N, H, d] (got {list(t.shape)})")
        if t.dtype not in FLOATS:
            raise ValueError(f"{name} must be a floating-point tensor (got {t.dtype})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k, v must have the same number of heads (got {q.shape[1]}, {k.shape[1]}, {v.shape[1]})")
    if q.shape[1] == 0 or q.shape[2] == 0:
        raise ValueError(f"q must have at least one head and a head dim >= 1 (got {list(q.shape)})")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim (got {q.shape[2]} and {k.shape[2]})")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of nodes (got {k.shape[0]} and {v.shape[0]})")


def _check_edge_tensor(name: str, t: Tensor, num_edges: int, num_heads: int) -> Tensor:
    """A per-edge tensor ``[E]`` or ``[E, 1 or H]`` of floats, returned as ``[E, 1 or H]``."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
    if t.dtype not in FLOATS:
        raise ValueError(f"{name} must be a floating-point tensor (got {t.dtype})")
    if t.dim() == 1:
        t = t.unsqueeze(-1)
    if t.dim() != 2 or t.shape[0] != num_edges or t.shape[1] not in (1, num_heads):
        raise ValueError(f"{name} must have shape [E] or [E, H] = [{num_edges}, {num_heads}] (got {list(t.shape)})")
    return t


def _check_bias(bias: Tensor, num_edges: int, num_heads: int) -> Tensor:
    bias = _check_edge_tensor("bias", bias, num_edges, num_heads)
    # On a GPU the check would make the host wait for the device: there +inf gives NaN instead.
    if on_host(bias) and torch.isposinf(bias).any():
        raise ValueError("bias holds +inf, which has no softmax; use -inf to remove an edge")
    return bias


def graph_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    edge_index: Tensor,
    *,
    bias: Optional[Tensor] = None,
    scale: Optional[float] = None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    backend: str = "auto",
    edge_scale: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Scaled-dot-product attention restricted to an edge set.

    For query i with in-neighbourhood :math:`N(i) = \{j : (j, i) \in E\}` and each head:

    .. math::
        s_{ij} = \text{scale}\,\langle q_i, k_j\rangle + b_{ij}, \quad
        a_{ij} = \operatorname{softmax}_{j \in N(i)}(s_{ij}), \quad
        o_i = \sum_{j \in N(i)} a_{ij} v_j

    Equal to :func:`tgattn.reference.dense_attention` with ``mask = builders.to_mask(edge_index)``.

    * A query without incoming edges (or whose edges all have bias ``-inf``) outputs 0.
    * Edges may come in any order. A duplicated edge counts once per copy: m copies of
      ``(j, i)`` weigh like one edge with ``log(m)`` added to its score (PyG's convention).
    * NaN in ``q``, ``k``, ``v`` or ``bias`` propagates to the outputs of the queries it
      touches (and, in backward, to the keys and values of their edges only); ``-inf`` in
      ``bias`` removes an edge; ``+inf`` in ``bias`` is an error (on a GPU, where the check
      would make the host wait for the device, it makes its query's output NaN).
    * float16 / bfloat16 inputs are computed in float32 and returned in their own dtype;
      autocast is off inside. Works under ``torch.no_grad``, ``torch.inference_mode`` and
      ``torch.compile`` (as one custom op, ``torch.ops.tgattn.graph_attention``).
    * Double backward (``create_graph=True``) is exact on every backend: the gradients are
      recomputed on the textbook edge-wise path.
    * The analysis of ``edge_index`` is cached per tensor and checked against its contents on
      every call, so an edge set modified in place is never served a stale result (on a GPU
      against its version counter instead, which sees every in-place write made through
      PyTorch: :func:`tgattn.engine.analysis.device_stamp`).

    Args:
        q: queries ``[Nq, H, dk]``.
        k: keys ``[Nk, H, dk]``.
        v: values ``[Nk, H, dv]``.
        edge_index: ``LongTensor[2, E]``; row 0 = key j, row 1 = query i.
        bias: additive edge scores ``[E]`` (shared by heads) or ``[E, H]``.
        scale: score scale (default: ``1 / sqrt(dk)``); must be finite.
        dropout_p: dropout probability on the attention weights (apply only in training).
        return_weights: also return the weights ``[E, H]`` (before dropout), in the order
            of ``edge_index``.
        backend: ``"auto"`` (default) lets :mod:`tgattn.engine` pick from a cached analysis
            of ``edge_index``; ``"dense"`` (SDPA on provably full / causal sets), ``"tile"``
            (row-blocked dense tiles), ``"fused"`` (a compiled C++ kernel over CSR rows) and
            ``"csr"`` (PyTorch sparse kernels) name an engine backend, which falls back along
            dense -> tile -> fused -> csr when it cannot honour the call
            (see :func:`tgattn.engine.plan`); ``"triton"`` (Triton kernels, CUDA) falls back
            like ``"fused"``; ``"gather"`` is the textbook per-edge path
            (it materializes ``[E, H, d]`` copies; use it as a reference).
        edge_scale: a factor ``[E]`` or ``[E, H]`` on each edge's weight after the softmax
            (``o_i = sum_j m_ij a_ij v_j``), differentiable: what PyG's explainers apply as
            their edge mask (default: None).

    Returns:
        ``out [Nq, H, dv]``, or ``(out, weights [E, H])`` with ``return_weights=True``.

    Example:
        >>> from tgattn import builders
        >>> q = k = v = torch.randn(5, 2, 4)
        >>> out = graph_attention(q, k, v, builders.causal(5))
        >>> out.shape
        torch.Size([5, 2, 4])
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (got {dropout_p})")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (got {backend!r})")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number (got {scale})")
    if torch.compiler.is_compiling():
        from .custom_op import compiled_graph_attention

        out, weights = compiled_graph_attention(q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend)
    else:
        out, weights = eager_graph_attention(q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend)
    return (out, weights) if return_weights else out


def eager_graph_attention(q, k, v, edge_index, bias, edge_scale, scale, dropout_p, return_weights, backend, generator=None):
    """:func:`graph_attention` outside ``torch.compile``: checks, cached analysis, engine.

    Returns ``(out, weights or None)``; ``generator`` draws the dropout mask of the ``csr``
    backend and of ``gather``.
    """
    _check_qkv(q, k, v)
    if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.shape[0] != 2:
        check_edge_index(edge_index, k.shape[0], q.shape[0])  # raises, naming what is wrong
    num_edges = edge_index.shape[1]
    if bias is not None:
        bias = _check_bias(bias, num_edges, q.shape[1])
    if edge_scale is not None:
        edge_scale = _check_edge_tensor("edge_scale", edge_scale, num_edges, q.shape[1])
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "gather" or num_edges == 0:
        ei = check_edge_index(edge_index, k.shape[0], q.shape[0])
        work = engine.dispatch.compute_dtype(q.dtype)
        cast = (lambda t: t) if work == q.dtype else (lambda t: None if t is None else t.to(work))  # noqa: E731
        mult = edge_scale
        if dropout_p > 0:
            dropped = engine.recompute.dropout_factor(num_edges, q.shape[1], dropout_p, cast(q), generator)  # [E, H]
            mult = dropped if mult is None else mult * dropped
        out, weights = engine.recompute.gather_attention(
            cast(q), cast(k), cast(v), ei[0], ei[1], q.shape[0], cast(bias), scale, cast(mult)
        )
        return out.to(q.dtype), weights.to(q.dtype) if return_weights else None
    s = engine.structure_of(edge_index, q.shape[0], k.shape[0])
    return engine.run(
        q, k, v, s, bias, scale, dropout_p, return_weights, backend, edge_scale=edge_scale, generator=generator
    )
