"""Attention over an edge set, as a function of per-node queries, keys and values.

Edge convention (the same everywhere in tgattn): ``edge_index[0]`` = source = key/value
node j, ``edge_index[1]`` = target = query node i. The dense twin of an edge set is
``mask[i, j] = True`` (rows = queries i, columns = keys j).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from . import engine
from .engine.softmax import edge_softmax  # noqa: F401  (public: the layer's message path uses it)

BACKENDS = ("auto", "gather", "dense", "tile", "fused", "csr", "triton")


def check_edge_index(edge_index: Tensor, num_keys: int, num_queries: int) -> Tensor:
    """Validate an edge set against node counts and return it as ``torch.long``.

    Raises:
        ValueError: naming the bad shape, dtype or node id.
    """
    if not isinstance(edge_index, Tensor):
        raise TypeError(f"edge_index must be a torch.Tensor (got {type(edge_index).__name__})")
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise ValueError(f"edge_index must have shape [2, E] (got {list(edge_index.shape)})")
    if edge_index.dtype not in (torch.long, torch.int32):
        raise ValueError(f"edge_index must be an integer tensor of dtype torch.long (got {edge_index.dtype})")
    edge_index = edge_index.long()
    if edge_index.numel():
        lo = int(edge_index.min())
        if lo < 0:
            raise ValueError(f"edge_index holds the negative node id {lo}")
        src_max, dst_max = (int(m) for m in edge_index.max(dim=1).values)
        if src_max >= num_keys:
            raise ValueError(f"edge_index refers to key/source node {src_max}, but there are {num_keys} key nodes")
        if dst_max >= num_queries:
            raise ValueError(f"edge_index refers to query/target node {dst_max}, but there are {num_queries} query nodes")
    return edge_index


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must have shape [N, H, d] (got {list(t.shape)})")
    if not (q.shape[1] == k.shape[1] == v.shape[1]):
        raise ValueError(f"q, k, v must have the same number of heads (got {q.shape[1]}, {k.shape[1]}, {v.shape[1]})")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"q and k must have the same head dim (got {q.shape[2]} and {k.shape[2]})")
    if k.shape[0] != v.shape[0]:
        raise ValueError(f"k and v must have the same number of nodes (got {k.shape[0]} and {v.shape[0]})")


def _check_bias(bias: Tensor, num_edges: int, num_heads: int) -> Tensor:
    if bias.dim() == 1:
        bias = bias.unsqueeze(-1)
    if bias.dim() != 2 or bias.shape[0] != num_edges or bias.shape[1] not in (1, num_heads):
        raise ValueError(f"bias must have shape [E] or [E, H] = [{num_edges}, {num_heads}] (got {list(bias.shape)})")
    if torch.isposinf(bias).any():
        raise ValueError("bias holds +inf, which has no softmax; use -inf to remove an edge")
    return bias


def _gather_attention(q, k, v, edge_index, bias, scale, dropout_p):
    """The textbook path: gather q_i, k_j, v_j per edge, softmax per target, sum at i."""
    src, dst = edge_index
    scores = (q[dst] * k[src]).sum(-1) * scale  # [E, H]
    if bias is not None:
        scores = scores + bias
    weights = edge_softmax(scores, dst, q.shape[0])  # [E, H]
    used = F.dropout(weights, dropout_p) if dropout_p > 0 else weights
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])  # [Nq, H, dv]
    out = out.index_add(0, dst, used.unsqueeze(-1) * v[src])
    return out, weights


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
      touches; ``-inf`` in ``bias`` removes an edge; ``+inf`` in ``bias`` is an error.

    Args:
        q: queries ``[Nq, H, dk]``.
        k: keys ``[Nk, H, dk]``.
        v: values ``[Nk, H, dv]``.
        edge_index: ``LongTensor[2, E]``; row 0 = key j, row 1 = query i.
        bias: additive edge scores ``[E]`` (shared by heads) or ``[E, H]``.
        scale: score scale (default: ``1 / sqrt(dk)``).
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

    Returns:
        ``out [Nq, H, dv]``, or ``(out, weights [E, H])`` with ``return_weights=True``.

    Example:
        >>> from tgattn import builders
        >>> q = k = v = torch.randn(5, 2, 4)
        >>> out = graph_attention(q, k, v, builders.causal(5))
        >>> out.shape
        torch.Size([5, 2, 4])
    """
    _check_qkv(q, k, v)
    original = edge_index
    known = None if backend == "gather" else engine.CACHE.get(edge_index, q.shape[0], k.shape[0])
    # An analysed edge set (same tensor, same version, same sizes) was validated when analysed.
    edge_index = check_edge_index(edge_index, k.shape[0], q.shape[0]) if known is None else edge_index.long()
    if bias is not None:
        bias = _check_bias(bias, edge_index.shape[1], q.shape[1])
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1) (got {dropout_p})")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (got {backend!r})")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if backend == "gather" or edge_index.shape[1] == 0:
        out, weights = _gather_attention(q, k, v, edge_index, bias, scale, dropout_p)
    else:
        s = known or engine.structure_of(edge_index, q.shape[0], k.shape[0], original=original)
        out, weights = engine.run(q, k, v, s, bias, scale, dropout_p, return_weights, backend)
    return (out, weights) if return_weights else out
