"""Informer's ProbSparse attention: which queries get full attention, per head (:func:`probsparse`),
and the attention itself (:func:`probsparse_attention`: the active queries on their edges, the
lazy ones on :func:`lazy_values`)."""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..functional import graph_attention
from ._common import as_lengths, check_count
from .scored import edge_scores, head_pattern


class ProbSparsePattern(NamedTuple):
    """Result of :func:`probsparse`.

    Attributes:
        edge_index: ``[2, E]`` all keys of every query that is active in at least one head.
        bias: ``[E, H]``, 0 where the query is active in that head, ``-inf`` elsewhere.
        active: ``[Nq, H]`` bool, the ``u`` selected ("active") queries of each head.
        sample: ``[Nq, U]`` the key (node id) sampled for each query to score it (packed
            batches: ``U`` of the longest sequence, rows of shorter ones padded with -1).
    """

    edge_index: Tensor
    bias: Tensor
    active: Tensor
    sample: Tensor


def budget(length: int, factor: int) -> int:
    """Informer's ``c * ceil(ln L)``, at most ``L`` (0 for ``L <= 1``)."""
    return min(factor * math.ceil(math.log(length)), length) if length > 1 else 0


def sample_keys(n_q: int, n_k: int, factor: int, *, causal: bool = False, generator=None, device=None) -> Tensor:
    """``U = c * ceil(ln n_k)`` keys per query, uniform with replacement: ``[n_q, U]``.

    As ``torch.randint(n_k, (n_q, U))`` in the Informer code; ``causal=True`` draws query
    i's keys among ``0 .. i`` only, so that no future key influences which queries are active.
    """
    u = budget(n_k, factor)
    gen_device = generator.device if generator is not None else torch.device("cpu")
    if u == 0:
        return torch.empty(n_q, 0, dtype=torch.long, device=device)
    if not causal:
        return torch.randint(n_k, (n_q, u), generator=generator, device=gen_device).to(device)
    r = torch.rand(n_q, u, generator=generator, dtype=torch.float64, device=gen_device).to(device)
    top = torch.arange(n_q, device=device).unsqueeze(1)  # [Nq, 1]
    return torch.minimum((r * (top + 1)).long(), top)


def sparsity(q: Tensor, k: Tensor, sample: Tensor) -> Tensor:
    """Informer's query sparsity measurement ``M = max - mean`` of the sampled scores: ``[Nq, H]``."""
    n_q, u = sample.shape
    queries = torch.arange(n_q, device=q.device).repeat_interleave(u)
    scores = edge_scores(q, k, sample.reshape(-1), queries).view(n_q, u, -1) * q.shape[-1] ** -0.5  # [Nq, U, H]
    return scores.amax(dim=1) - scores.mean(dim=1)


def _rows(rows: Tensor, start: Tensor, count: Tensor) -> Tensor:
    """Edges from keys ``start[i] .. start[i] + count[i] - 1`` to each query i in sorted ``rows``."""
    counts = count[rows]
    dst = rows.repeat_interleave(counts)
    first = torch.repeat_interleave(counts.cumsum(0) - counts, counts)  # [E] where my row begins
    src = start[dst] + torch.arange(dst.numel(), device=rows.device) - first
    return torch.stack([src, dst])


def _select(q: Tensor, k: Tensor, factor: int, causal: bool, generator, sample: Optional[Tensor]):
    n_q, n_k = q.shape[0], k.shape[0]
    if sample is None:
        sample = sample_keys(n_q, n_k, factor, causal=causal, generator=generator, device=q.device)
    elif sample.dim() != 2 or sample.shape[0] != n_q or (sample.numel() and (int(sample.min()) < 0 or int(sample.max()) >= n_k)):
        raise ValueError(f"sample must be [Nq={n_q}, U] with key ids in [0, {n_k}) (got shape {list(sample.shape)})")
    active = torch.zeros(n_q, q.shape[1], dtype=torch.bool, device=q.device)  # [Nq, H]
    u = budget(n_q, factor)
    if u and sample.shape[1]:
        with torch.no_grad():
            top = sparsity(q, k, sample).topk(u, dim=0).indices  # [u, H]
        active.scatter_(0, top, True)
    return active, sample


def probsparse(
    q: Tensor,
    k: Tensor,
    factor: int = 5,
    *,
    causal: bool = False,
    generator: Optional[torch.Generator] = None,
    sample: Optional[Tensor] = None,
    lengths: Optional[Sequence[int]] = None,
) -> ProbSparsePattern:
    """Informer's ProbSparse self-attention: per head, the ``u`` most "peaked" queries attend to all keys.

    Per head, each query i is scored on ``U = c ceil(ln L_K)`` keys sampled uniformly (with
    replacement) by the sparsity measurement ``M_i = max_u s_iu - mean_u s_iu`` of its sampled
    scores ``s = q k^T / sqrt(d)``; the ``u = c ceil(ln L_Q)`` queries with the largest M are
    *active* and attend to every key (``j <= i`` with ``causal=True``). The other, *lazy*
    queries get no edges here; :func:`probsparse_attention` gives them the
    mean of V (running mean when causal). Heads choose different queries: the result is the
    union edge set with a per-head bias, as for :func:`topk`.
    Edges: ``a * L_K`` for ``a`` queries active in some head (``u <= a <= u H``); causal:
    ``sum (i + 1)`` over those queries.

    Differences from the Informer code, on purpose: ``M`` uses the mean of the sampled scores
    (the code divides their sum by ``L_K``, i.e. shrinks the mean by ``U / L_K``, so for
    ``U << L_K`` it ranks queries mostly by their maximum); with ``causal=True`` keys are
    sampled among ``j <= i`` (the code samples future keys too). Pass ``sample=`` to score
    on your own indices. The selection is not differentiable; the active queries' scores are.
    Zhou et al., "Informer: Beyond Efficient Transformer for Long Sequence Time-Series
    Forecasting", AAAI 2021, section 3.1 (Eq. 4 and "ProbSparse Self-attention").

    Args:
        q: queries ``[Nq, H, d]``.
        k: keys ``[Nk, H, d]`` (``Nk == Nq`` when causal or packed).
        factor: the sampling factor ``c >= 1`` (Informer's default is 5).
        causal: active queries see only keys ``j <= i``; lazy keys are sampled among them.
        generator: the ``torch.Generator`` for the key samples.
        sample: ``[Nq, U]`` key ids to use instead of drawing them (one sequence only).
        lengths: lengths of a packed batch; each sequence is selected on its own.

    Example:
        >>> from tgattn.builders import draw
        >>> g = torch.Generator().manual_seed(0)
        >>> q, k = torch.randn(8, 1, 4, generator=g), torch.randn(8, 1, 4, generator=g)
        >>> p = probsparse(q, k, 1, causal=True, generator=g)  # u = ceil(ln 8) = 3 active queries
        >>> print(draw(p.edge_index, 8))
        . . . . . . . .
        . . . . . . . .
        x x x . . . . .
        . . . . . . . .
        x x x x x . . .
        . . . . . . . .
        . . . . . . . .
        x x x x x x x x
        >>> q, k = torch.randn(50, 2, 8), torch.randn(50, 2, 8)
        >>> p = probsparse(q, k, 2, generator=torch.Generator().manual_seed(0))
        >>> p.active.sum(0).tolist()  # u = 2 * ceil(ln 50) = 8 active queries per head
        [8, 8]
        >>> p.sample.shape  # U = 8 sampled keys per query
        torch.Size([50, 8])
    """
    if q.dim() != 3 or k.dim() != 3 or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"q and k must have shapes [Nq, H, d] and [Nk, H, d] (got {list(q.shape)} and {list(k.shape)})")
    factor = check_count("factor", factor, 1)
    n_q, n_k = q.shape[0], k.shape[0]
    seq_lengths = as_lengths(lengths) if lengths is not None else None
    if (causal or seq_lengths is not None) and n_q != n_k:
        raise ValueError(f"causal or packed ProbSparse needs as many queries as keys (got {n_q} and {n_k})")
    if seq_lengths is not None and sum(seq_lengths) != n_q:
        raise ValueError(f"lengths sum to {sum(seq_lengths)}, but q has {n_q} nodes")
    if seq_lengths is None:
        active, sample = _select(q, k, factor, causal, generator, sample)
        start = torch.zeros(n_q, dtype=torch.long, device=q.device)  # keys of query i: 0 .. count_i - 1
        count = torch.arange(1, n_q + 1, device=q.device) if causal else torch.full_like(start, n_k)
    else:
        if sample is not None:
            raise ValueError("sample= works on one sequence; call probsparse per sequence to give samples")
        active = torch.zeros(n_q, q.shape[1], dtype=torch.bool, device=q.device)  # [Nq, H]
        width = budget(max(seq_lengths, default=0), factor)
        sample = torch.full((n_q, width), -1, dtype=torch.long, device=q.device)  # -1 pads a smaller U
        offset = 0
        for length in seq_lengths:
            part = slice(offset, offset + length)
            active[part], own = _select(q[part], k[part], factor, causal, generator, None)
            sample[part, : own.shape[1]] = own + offset
            offset += length
        sizes = torch.tensor(seq_lengths, device=q.device)
        start = torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)  # [N] first node of my sequence
        count = torch.arange(n_q, device=q.device) - start + 1 if causal else torch.repeat_interleave(sizes, sizes)
    edges = _rows(active.any(dim=1).nonzero().view(-1), start, count)  # all allowed keys of active rows
    edges, bias = head_pattern(edges, active[edges[1]], q.dtype)  # kept by a head where its query is active
    return ProbSparsePattern(edges, bias, active, sample)


def lazy_values(
    v: Tensor, *, causal: bool = False, lengths: Optional[Sequence[int]] = None, num_queries: Optional[int] = None
) -> Tensor:
    """What a lazy query outputs: the mean of V over its sequence, or with ``causal=True`` the
    running mean ``(v_0 + ... + v_i) / (i + 1)``: ``[N, H, dv]`` (``[num_queries, H, dv]``
    for one non-causal sequence, where queries and keys may differ in number; no keys: 0).

    The Informer code gives causal lazy queries the cumulative *sum* of V. We use the running
    mean: it is what uniform attention over the visible keys ``j <= i`` outputs (the causal
    twin of the non-causal mean), and its scale does not grow with the position i.
    """
    if lengths is None and not causal:
        mean = v.sum(0) / max(v.shape[0], 1)  # [H, dv]
        return mean.expand(v.shape[0] if num_queries is None else num_queries, *mean.shape)
    if lengths is None:
        lengths = [v.shape[0]]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=v.device), torch.as_tensor(lengths, device=v.device))
    if not causal:
        sums = v.new_zeros(len(lengths), *v.shape[1:]).index_add_(0, seq, v)  # [B, H, dv]
        counts = torch.as_tensor(lengths, device=v.device, dtype=v.dtype).clamp(min=1)
        return (sums / counts.view(-1, 1, 1))[seq]
    csum = v.cumsum(0)  # [N, H, dv]
    starts = torch.as_tensor([0] + list(lengths[:-1]), device=v.device).cumsum(0)  # first node of each sequence
    before = torch.cat([v.new_zeros(1, *v.shape[1:]), csum])[starts[seq]]  # sum of earlier sequences
    position = torch.arange(v.shape[0], device=v.device) - starts[seq]
    return (csum - before) / (position + 1).to(v.dtype).view(-1, 1, 1)


def probsparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    factor: int = 5,
    *,
    causal: bool = False,
    generator: Optional[torch.Generator] = None,
    sample: Optional[Tensor] = None,
    lengths: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
    return_pattern: bool = False,
):
    """Informer's ProbSparse self-attention output ``[Nq, H, dv]``.

    Per head, the active queries chosen by :func:`tgattn.builders.probsparse` attend to all
    keys (``j <= i`` when causal) through :func:`tgattn.functional.graph_attention`; each
    lazy query outputs :func:`lazy_values` (mean of V, or its running mean when causal).
    Cost ``O(L log L)`` per head: ``L U`` sampled scores plus ``u L`` attended edges.
    Zhou et al., "Informer", AAAI 2021.

    Args:
        q, k, v: ``[Nq, H, d]``, ``[Nk, H, d]``, ``[Nk, H, dv]``.
        factor: sampling factor ``c`` (``u = U = c ceil(ln L)``).
        causal: causal variant (Informer's decoder self-attention).
        generator: ``torch.Generator`` for the key samples.
        sample: ``[Nq, U]`` key ids to score queries with instead of drawing them.
        lengths: lengths of a packed batch (each sequence on its own).
        scale: score scale for the active queries (default ``1 / sqrt(d)``).
        return_pattern: also return the :class:`~tgattn.builders.informer.ProbSparsePattern`.

    Example:
        >>> q, k, v = torch.randn(40, 2, 8), torch.randn(40, 2, 8), torch.randn(40, 2, 8)
        >>> out, p = probsparse_attention(q, k, v, 2, generator=torch.Generator().manual_seed(0), return_pattern=True)
        >>> lazy = ~p.active  # [N, H]
        >>> torch.allclose(out[lazy], v.mean(0).expand(40, 2, 8)[lazy])
        True
    """
    pattern: ProbSparsePattern = probsparse(q, k, factor, causal=causal, generator=generator, sample=sample, lengths=lengths)
    active_out = graph_attention(q, k, v, pattern.edge_index, bias=pattern.bias, scale=scale)  # [Nq, H, dv]
    lazy = lazy_values(v, causal=causal, lengths=lengths, num_queries=q.shape[0])  # [Nq, H, dv]
    out = torch.where(pattern.active.unsqueeze(-1), active_out, lazy)
    return (out, pattern) if return_pattern else out
