"""Data-dependent selection: per query and per head, keep the ``k_top`` best-scoring keys."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..functional import check_edge_index
from ._common import check_count, sort_unique
from .cross import cross


class HeadPattern(NamedTuple):
    """Per-head patterns as one edge set: heads share ``edge_index``; ``bias [E, H]`` is 0 where
    head h keeps edge e and ``-inf`` where it drops it. Pass both to the layer / functional:
    ``graph_attention(q, k, v, p.edge_index, bias=p.bias)``."""

    edge_index: Tensor
    bias: Tensor


def head_pattern(edge_index: Tensor, keep: Tensor, dtype: torch.dtype) -> HeadPattern:
    """The union of the per-head edge sets ``keep [E, H]`` over ``edge_index``, with its bias."""
    used = keep.any(dim=1)  # [E]
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    bias = torch.where(keep[used], zero, torch.full_like(zero, float("-inf")))  # [E', H]
    return HeadPattern(edge_index[:, used], bias)


def edge_scores(q: Tensor, k: Tensor, src: Tensor, dst: Tensor, *, chunk: int = 1 << 22) -> Tensor:
    """Per-edge, per-head dot products ``<q_dst, k_src>``: ``[E, H]``, gathered ``chunk`` floats at a time."""
    scores = q.new_empty(src.numel(), q.shape[1])  # [E, H]
    step = max(1, chunk // max(q.shape[1] * q.shape[2], 1))
    for start in range(0, src.numel(), step):
        part = slice(start, start + step)
        scores[part] = torch.einsum("ehd,ehd->eh", q[dst[part]], k[src[part]])
    return scores


def head_masks(pattern: HeadPattern, n_q: int, n_k: int) -> Tensor:
    """The dense per-head twin ``[H, Nq, Nk]`` of a :class:`HeadPattern` (True = attended)."""
    src, dst = pattern.edge_index
    h = pattern.bias.shape[1]
    mask = torch.zeros(h, n_q, n_k, dtype=torch.bool, device=pattern.bias.device)
    heads, edges = (pattern.bias == 0).T.nonzero(as_tuple=True)
    mask[heads, dst[edges], src[edges]] = True
    return mask


def topk(q: Tensor, k: Tensor, k_top: int, *, base: Optional[Tensor] = None) -> HeadPattern:
    """Per query i and per head h, keep the ``k_top`` keys of ``base`` with the largest ``<q_i, k_j>``.

    Heads choose different keys, so the result is a :class:`HeadPattern`: the union edge
    set (sorted by (target, source)) plus a bias ``[E, H]`` of 0 (kept by this head) or
    ``-inf`` (dropped); attention with that bias equals dense attention under the per-head
    mask :func:`head_masks` (the layer's softmax gives ``-inf`` scores weight 0).
    Rows = queries i, columns = keys j; rule per head: ``j`` among the ``k_top`` largest
    ``q_i . k_j`` over ``base``'s keys of i (a query with fewer keys keeps them all; ties go
    to the smaller j). Edges: at most ``n_q * min(k_top * H, n_k)``; ``n_q * k_top`` per head.

    The selection is not differentiable (it is computed without gradient, and changing
    which keys win is a step function); the kept scores are: gradients flow to ``q``, ``k``
    and ``v`` through the softmax over the selected keys, as in dense attention under a
    fixed mask. Cost: one score per base edge and head (``O(E H d)``, chunked) and two
    stable sorts of ``[E, H]``; the default base (all pairs) makes that ``O(Nq Nk)``.
    Cf. Gupta et al., "Memory-efficient Transformers via Top-k Attention", 2021;
    Zhao et al., "Explicit Sparse Transformer", 2019.

    Args:
        q: queries ``[Nq, H, d]`` (e.g. from ``GraphAttention.project``).
        k: keys ``[Nk, H, d]``.
        k_top: keys kept per query and head, ``0 <= k_top <= Nk``.
        base: candidate edges ``[2, E]`` (default: all ``Nq x Nk`` pairs). For a packed
            batch pass ``builders.full(lengths)`` (or any builder) so that no query picks a
            key of another sequence; ``builders.causal(n)`` gives causal top-k.

    Example:
        >>> from tgattn import builders
        >>> from tgattn.functional import graph_attention
        >>> q = torch.ones(5, 1, 1)  # one head, scores q_i . k_j = k_j = 3 1 4 1 5
        >>> k = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0]).view(5, 1, 1)
        >>> print(builders.draw(topk(q, k, 2, base=builders.causal(5)).edge_index))
        x . . . .
        x x . . .
        x . x . .
        x . x . .
        . . x . x
        >>> q, k, v = torch.randn(6, 2, 4), torch.randn(6, 2, 4), torch.randn(6, 2, 4)
        >>> sel = topk(q, k, 2, base=builders.causal(6))
        >>> bool((sel.bias == 0).sum(0).eq(1 + 2 * 5).all())  # per head: 1 + 2 + 2 + ... keys
        True
        >>> out = graph_attention(q, k, v, sel.edge_index, bias=sel.bias)
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must have shapes [Nq, H, d] and [Nk, H, d] (got {list(q.shape)} and {list(k.shape)})")
    n_q, n_k = q.shape[0], k.shape[0]
    k_top = check_count("k_top", k_top)
    if k_top > n_k:
        raise ValueError(f"k_top must be <= the number of keys {n_k} (got {k_top})")
    if base is None:
        base = cross(n_q, n_k, device=q.device)
    else:
        base = sort_unique(check_edge_index(base, n_k, n_q), n_k)
    src, dst = base
    with torch.no_grad():
        keep = best_per_target(edge_scores(q, k, src, dst), dst, n_q, k_top)
    return head_pattern(base, keep, q.dtype)


def best_per_target(scores: Tensor, dst: Tensor, n_q: int, k_top: int) -> Tensor:
    """Which edges are among the ``k_top`` best-scoring of their target, per column: ``keep [E, H]``.

    ``scores [E, H]``; ``dst [E]`` sorted (each target's edges together); ties go to the earlier
    edge (the smaller key when edges are sorted by (target, key)). A target with at most
    ``k_top`` edges keeps them all.

    Example:
        >>> scores = torch.tensor([[1.0], [3.0], [2.0], [5.0]])
        >>> best_per_target(scores, torch.tensor([0, 0, 0, 1]), 2, 2).view(-1)
        tensor([False,  True,  True,  True])
    """
    if scores.shape[1] > 1 and scores.device.type == "cpu":
        # One column at a time: sorting the columns of [E, H] in place walks strided memory (measured
        # E = 1.04M, H = 8, one thread: 1.8-1.9 s by columns against 2.8-3.3 s at once, the same keep).
        return torch.stack([best_per_target(col.unsqueeze(1), dst, n_q, k_top)[:, 0] for col in scores.unbind(1)], 1)
    by_score = torch.sort(scores, dim=0, descending=True, stable=True).indices  # [E, H]
    by_target = torch.sort(dst[by_score], dim=0, stable=True).indices  # [E, H]
    order = by_score.gather(0, by_target)  # [E, H]: edges by (target, score desc)
    first = torch.zeros(n_q + 1, dtype=torch.long, device=dst.device)
    first[1:] = torch.bincount(dst, minlength=n_q).cumsum(0)  # where each target starts
    position = torch.arange(dst.shape[0], device=dst.device)
    rank = position - first[dst]  # dst is sorted, so this is the rank at each sorted position
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(0, order, (rank < k_top).unsqueeze(1).expand_as(order))
