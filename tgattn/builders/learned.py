"""Learned sparse selections: DeepSeek's lightning-indexer top-k and MoBA's block top-k.

Both rank candidates by a score computed without gradient, keep the best ``k_top`` per query
(ties to the smaller index) and score in blocks of rows and columns, never all ``[N, N]`` pairs
at once (``chunk=``: score floats per block).
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._common import as_lengths, check_count
from .informer import _rows
from .scored import HeadPattern, head_pattern

CHUNK = 1 << 22  # score floats per block by default (32 MB in float64)


def sequence_bounds(n: int, lengths: Optional[Sequence[int]], device) -> Tuple[Tensor, Tensor]:
    """First node ``start [N]`` and one-past-last node ``end [N]`` of each node's sequence."""
    seq = None if lengths is None else as_lengths(lengths)
    if seq is None:  # one sequence
        seq = [n if lengths is None else int(lengths)]
    if sum(seq) != n:
        raise ValueError(f"lengths sum to {sum(seq)}, but the inputs have {n} nodes")
    sizes = torch.tensor(seq, dtype=torch.long, device=device)
    start = torch.repeat_interleave(sizes.cumsum(0) - sizes, sizes)  # [N]
    return start, start + torch.repeat_interleave(sizes, sizes)


def smallest(blocks: Iterable[Tuple[Tensor, Tensor]], k: int, key: Tensor, ids: Tensor) -> Tuple[Tensor, Tensor]:
    """The ``k`` smallest keys along the last dimension of a stream of blocks, and their ids.

    ``blocks`` yields ``(key [..., C], ids [C])`` with ids increasing over the stream; ``key,
    ids [..., 0]`` start it. The best so far are kept sorted by a stable sort of [best | block],
    so earlier columns come first among equal keys (ties go to the smaller id) and NaN (not a
    candidate) comes last. Once ``k`` are held, only keys below the k-th enter the sort (an equal
    one would lose the tie): most of a block is dropped before sorting.
    """
    for block_key, block_ids in blocks:
        block_ids = block_ids.expand_as(block_key)
        if key.shape[-1] == k:
            kth = key[..., -1:]  # the k-th smallest so far (NaN: fewer than k candidates yet)
            enter = (block_key < kth) | (kth.isnan() & ~block_key.isnan())
            block_key, block_ids = compact(block_key, block_ids, enter)
        key, ids = torch.cat([key, block_key], -1), torch.cat([ids, block_ids], -1)
        order = torch.sort(key, dim=-1, stable=True).indices[..., :k]
        key, ids = key.gather(-1, order), ids.gather(-1, order)
    return key, ids


def compact(key: Tensor, ids: Tensor, enter: Tensor) -> Tuple[Tensor, Tensor]:
    """The entries of ``key, ids [..., C]`` where ``enter``, moved to the front of their row in
    order, rows padded with NaN to the longest: ``[..., C']``."""
    flat = enter.reshape(-1, enter.shape[-1])  # [rows, C]
    width = int(flat.sum(1).max()) if flat.numel() else 0
    rows, cols = flat.nonzero(as_tuple=True)
    slot = flat.cumsum(1)[rows, cols] - 1  # place among my row's entries
    out_key = key.new_full((flat.shape[0], width), float("nan"))
    out_ids = ids.new_zeros(flat.shape[0], width)
    out_key[rows, slot] = key.reshape(flat.shape)[rows, cols]
    out_ids[rows, slot] = ids.reshape(flat.shape)[rows, cols]
    return out_key.view(*key.shape[:-1], width), out_ids.view(*key.shape[:-1], width)


def not_ranked(scores: Tensor, allowed: Tensor) -> Tensor:
    """Sort keys ``-scores`` (largest score first), NaN where a cell is not a candidate."""
    return torch.neg(scores).masked_fill_(~allowed, float("nan"))


def first_nan(scores: Tensor, allowed: Tensor) -> Optional[List[int]]:
    """Index of the first NaN score among the candidates, or None."""
    bad = scores.isnan() & allowed
    return bad.nonzero()[0].tolist() if bool(bad.any()) else None


def indexer_topk(
    q_index: Tensor,
    k_index: Tensor,
    weights: Tensor,
    k_top: int,
    *,
    causal: bool = True,
    lengths: Optional[Sequence[int]] = None,
    chunk: int = CHUNK,
) -> Tensor:
    """DeepSeek's lightning indexer: query i keeps the ``k_top`` keys with the largest index score.

    Rule: ``I_ij = sum_h weights[i, h] * relu(<q_index[i, h], k_index[j]>)``; query i keeps the
    ``k_top`` keys j with the largest ``I_ij`` among its candidates (``j <= i`` with
    ``causal=True``, else every key of its sequence), ties to the smaller j, every candidate
    when it has at most ``k_top``. All heads of the attention share the selection (one edge
    set, as DeepSeek-V3.2 shares it across the MQA heads). Rows = queries i, columns = keys j.
    Edges: ``sum_i min(k_top, candidates of i)`` (causal: ``sum_i min(k_top, i + 1)``).

    The selection is not differentiable (it is computed without gradient; which keys win is a
    step function): train the indexer with its own loss, as DeepSeek does (KL to the main
    attention). A NaN score of a candidate raises (NaN cannot be ranked); ``inf`` ranks
    normally. Cost: every candidate pair is scored, ``O(N^2 HI dI)`` (half of it causal), in
    ``[rows, HI, keys]`` blocks of at most ``chunk`` floats; memory ``O(N k_top + chunk)``.
    DeepSeek-AI, "DeepSeek-V3.2" technical report, 2025 (DeepSeek Sparse Attention: the
    lightning indexer and its top-k token selection).

    Args:
        q_index: indexer queries ``[N, HI, dI]``.
        k_index: indexer keys ``[N, dI]`` (one per token, shared by the indexer heads).
        weights: per-query head weights ``[N, HI]``.
        k_top: keys kept per query, ``>= 1``.
        causal: candidates are ``j <= i`` (the paper's setting); ``False``: all keys.
        lengths: lengths of a packed batch; a query's candidates are keys of its own sequence.
        chunk: score floats held at once (blocks of about ``sqrt(chunk / HI)`` rows and keys).

    Example:
        >>> from tgattn.builders import draw
        >>> q_index, weights = torch.ones(6, 1, 1), torch.ones(6, 1)  # I_ij = relu(k_j) = 2 1 2 0 3 0
        >>> k_index = torch.tensor([2.0, 1.0, 2.0, 0.0, 3.0, -1.0]).view(6, 1)
        >>> print(draw(indexer_topk(q_index, k_index, weights, 2)))  # row 4: 3, then 2 = 2 -> j = 0
        x . . . . .
        x x . . . .
        x . x . . .
        x . x . . .
        x . . . x .
        x . . . x .
    """
    if q_index.dim() != 3 or k_index.dim() != 2 or weights.dim() != 2 or not (
        q_index.shape[0] == k_index.shape[0] == weights.shape[0]
        and q_index.shape[2] == k_index.shape[1]
        and q_index.shape[1] == weights.shape[1]
    ):
        raise ValueError(
            f"q_index, k_index and weights must have shapes [N, HI, dI], [N, dI] and [N, HI] "
            f"(got {list(q_index.shape)}, {list(k_index.shape)} and {list(weights.shape)})"
        )
    if not q_index.is_floating_point() or not (q_index.dtype == k_index.dtype == weights.dtype):
        dtypes = f"{q_index.dtype}, {k_index.dtype}, {weights.dtype}"
        raise ValueError(f"q_index, k_index and weights must share a floating dtype (got {dtypes})")
    k_top, chunk = check_count("k_top", k_top, 1), check_count("chunk", chunk, 1)
    n, heads, device = q_index.shape[0], q_index.shape[1], q_index.device
    start, end = sequence_bounds(n, lengths, device)
    if causal:
        end = torch.arange(1, n + 1, device=device)
    side = max(1, math.isqrt(chunk // max(heads, 1)))
    parts = [torch.empty(2, 0, dtype=torch.long, device=device)]

    def blocks(r0: int, r1: int):
        q, w = q_index[r0:r1], weights[r0:r1].unsqueeze(1)  # [R, HI, dI], [R, 1, HI]
        for c0 in range(int(start[r0]), int(end[r1 - 1]), side):
            c1 = min(c0 + side, int(end[r1 - 1]))
            cols = torch.arange(c0, c1, device=device)
            scores = torch.bmm(w, torch.matmul(q, k_index[c0:c1].T).relu_()).squeeze(1)  # [R, C]
            allowed = (cols >= start[r0:r1, None]) & (cols < end[r0:r1, None])  # [R, C]
            bad = first_nan(scores, allowed)
            if bad is not None:
                i, j = r0 + bad[0], c0 + bad[1]
                raise ValueError(f"indexer score I[{i}, {j}] is NaN (NaN or inf in q_index, k_index or weights)")
            yield not_ranked(scores, allowed), cols

    with torch.no_grad():
        for r0 in range(0, n, side):
            r1 = min(n, r0 + side)
            key, ids = smallest(blocks(r0, r1), k_top, q_index.new_empty(r1 - r0, 0), start.new_empty(r1 - r0, 0))
            kept = ~key.isnan()  # [R, <= k_top]; fewer candidates than k_top leave NaN
            ids = ids.masked_fill(~kept, n).sort(dim=1).values  # keys ascending, NaN slots last
            rows = torch.arange(r0, r1, device=device).unsqueeze(1).expand_as(ids)
            first = torch.arange(ids.shape[1], device=device) < kept.sum(1, keepdim=True)
            parts.append(torch.stack([ids[first], rows[first]]))
    return torch.cat(parts, dim=1)


def block_topk(
    q: Tensor,
    k: Tensor,
    block: int,
    k_top: int,
    *,
    causal: bool = True,
    lengths: Optional[Sequence[int]] = None,
    chunk: int = CHUNK,
) -> HeadPattern:
    """MoBA's block top-k: per head, each query sees its own block and the ``k_top - 1`` best blocks.

    The sequence is cut into blocks of ``block`` keys (``b_j = j // block``; the last block may
    be shorter). Per head h, query i in block ``b_i`` gates block b by ``s_ib = <q_ih, mean of
    k_jh over j in b>``; rule: j is attended when ``b_j == b_i`` (and ``j <= i`` with
    ``causal=True``) or ``b_j`` is among the ``k_top - 1`` candidate blocks with the largest
    ``s_ib`` (ties to the smaller block; every candidate when there are fewer). Candidates:
    the earlier blocks ``b < b_i`` (``causal=True``, MoBA's setting), or every other block of
    the sequence (``causal=False``: the natural extension, not in the paper). Heads choose
    different blocks, so the result is a :class:`HeadPattern` as for :func:`topk`. Rows =
    queries i, columns = keys j. Edges per head: ``<= n * k_top * block``; ``k_top = 1`` is
    ``block_local(n, block, causal=causal)``.

    The selection is not differentiable (gates are computed without gradient); the kept
    scores are. A NaN gate of a candidate raises (NaN cannot be ranked); ``inf`` ranks
    normally. Cost: ``O(N (N / block) H d)`` for the gates, in blocks of ``chunk`` floats.
    Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs", 2025.

    Args:
        q: queries ``[N, H, d]``.
        k: keys ``[N, H, d]``.
        block: keys per block, ``>= 1``.
        k_top: blocks per query and head, its own included, ``>= 1``.
        causal: keys ``j <= i`` in the own block and earlier blocks only (MoBA).
        lengths: lengths of a packed batch; blocks restart at each sequence and a query
            gates only the blocks of its own sequence.
        chunk: gate floats held at once.

    Example:
        >>> from tgattn.builders import draw
        >>> q = torch.ones(8, 1, 1)  # gates = block means of k: 2 0 5 2
        >>> k = torch.tensor([1.0, 3.0, 0.0, 0.0, 5.0, 5.0, 2.0, 2.0]).view(8, 1, 1)
        >>> print(draw(block_topk(q, k, 2, 2).edge_index))  # own block + the best earlier one
        x . . . . . . .
        x x . . . . . .
        x x x . . . . .
        x x x x . . . .
        x x . . x . . .
        x x . . x x . .
        . . . . x x x .
        . . . . x x x x
    """
    if q.dim() != 3 or q.shape != k.shape:
        raise ValueError(f"q and k must both have shape [N, H, d] (got {list(q.shape)} and {list(k.shape)})")
    if not q.is_floating_point() or q.dtype != k.dtype:
        raise ValueError(f"q and k must share a floating dtype (got {q.dtype} and {k.dtype})")
    block, k_top, chunk = check_count("block", block, 1), check_count("k_top", k_top, 1), check_count("chunk", chunk, 1)
    n, heads, device = q.shape[0], q.shape[1], q.device
    start, end = sequence_bounds(n, lengths, device)
    position = torch.arange(n, device=device) - start
    own = (position % block == 0).cumsum(0) - 1  # [N] block of each node, numbered over the batch
    block_start = (position % block == 0).nonzero().view(-1)  # [B]
    block_size = torch.diff(block_start, append=torch.tensor([n], device=device))  # [B]
    num_blocks = block_start.numel()
    first, last = own[start], own[end - 1] + 1  # [N] my sequence's first block, one past its last
    side = max(1, math.isqrt(chunk // max(heads, 1)))
    parts = [torch.empty(2, 0, dtype=torch.long, device=device)]
    keeps = [torch.empty(0, heads, dtype=torch.bool, device=device)]

    def gates(r0: int, r1: int, means: Tensor):
        below = own[r0:r1, None] if causal else last[r0:r1, None]  # [R, 1] candidates end here
        stop = int(below.max())
        for c0 in range(int(first[r0]), stop, side):
            cols = torch.arange(c0, min(c0 + side, stop), device=device)
            scores = torch.einsum("rhd,bhd->rhb", q[r0:r1], means[cols])  # [R, H, C]
            allowed = ((cols >= first[r0:r1, None]) & (cols < below) & (cols != own[r0:r1, None])).unsqueeze(1)
            bad = first_nan(scores, allowed)
            if bad is not None:
                i, h, b = r0 + bad[0], bad[1], c0 + bad[2] - int(first[r0 + bad[0]])
                raise ValueError(f"block_topk gate of query {i}, head {h}, block {b} of its sequence is NaN (NaN or inf in q or k)")
            yield not_ranked(scores, allowed), cols

    with torch.no_grad():
        means = k.new_zeros(num_blocks, heads, k.shape[2]).index_add_(0, own, k) / block_size.view(-1, 1, 1)
        for r0 in range(0, n, side):
            r1 = min(n, r0 + side)
            best = q.new_empty(r1 - r0, heads, 0), own.new_empty(r1 - r0, heads, 0)
            key, ids = smallest(gates(r0, r1, means) if k_top > 1 else (), k_top - 1, *best)  # [R, H, <= k_top - 1]
            ids = torch.cat([ids.masked_fill(key.isnan(), -1), own[r0:r1, None, None].expand(-1, heads, 1)], 2)  # + own block
            i = torch.arange(r0, r1, device=device).view(-1, 1, 1).expand_as(ids)
            h = torch.arange(heads, device=device).view(1, -1, 1).expand_as(ids)
            picked = ids >= 0
            code = i[picked] * num_blocks + ids[picked]  # one per (query, head, block) chosen
            pairs = torch.unique(code)  # (query, block) chosen by some head, sorted
            keep = torch.zeros(pairs.numel(), heads, dtype=torch.bool, device=device)
            keep[torch.searchsorted(pairs, code), h[picked]] = True  # [P, H]
            i, b = pairs // num_blocks, pairs % num_blocks
            count = torch.where((b == own[i]) & causal, i - block_start[b] + 1, block_size[b])  # own block: j <= i
            src, pair = _rows(torch.arange(pairs.numel(), device=device), block_start[b], count)
            parts.append(torch.stack([src, i[pair]]))
            keeps.append(keep[pair])  # [E', H]
    return head_pattern(torch.cat(parts, dim=1), torch.cat(keeps), q.dtype)
