"""The tensor-core kernels of the ``tc`` backend: ``tl.dot`` over the tiles of a :class:`~.tile_plan.TilePlan`.

Importing this module imports ``triton`` (see :mod:`.kernels` for the interpreter's rules).

A program owns one block of ``BLOCK_M`` queries (or ``BLOCK_N`` keys) and one key/value head
``hk``; its tile rows are the block's queries times the ``GROUP`` query heads that share
``hk`` (grouped-query attention: row ``r`` is query ``r // GROUP``, head ``hk * GROUP + r %
GROUP``), so heads sharing keys share each tile's key and value loads. It walks its block's
full tiles (no mask: every cell is an edge and in bounds), then its partial ones (each cell's
bit of the plan's mask; out-of-bounds cells have none).

* :func:`tile_forward_kernel`: scores ``Q K^T`` and ``P V`` on tensor cores, an online softmax
  (in float32) that takes the gathered remainder's result as one more chunk (``INIT``: its
  output and log-sum-exp, i.e. a running max ``lse``, sum 1 and accumulator ``out``), so the
  merge is exact and needs no pass of its own; writes the output and the log-sum-exp of all the
  row's edges (``+inf`` for a row without any, as the gather kernels do).
* :func:`tile_dq_kernel` and :func:`tile_dkdv_kernel`: FlashAttention-2's backward (Dao,
  2023) with the call's log-sum-exp and ``delta = <dO_i, O_i>``: ``dq`` over query blocks,
  ``dk`` / ``dv`` over key blocks (the plan's key-major lists); each program owns what it
  writes (no atomics). The gathered remainder's gradients are added by the caller.

float32 multiplies in IEEE precision (``input_precision="ieee"``: no TF32), so that it equals
the gather kernels' float32 within float32 rounding; float16 / bfloat16 take the weights to the
inputs' dtype before ``P V`` (as FlashAttention does) and accumulate in float32.
"""
from typing import Tuple

import torch
import triton
import triton.language as tl

from .kernels import Launch, MAX_REGISTERS
from .tile_config import tile_config

INTERPRETED = bool(triton.knobs.runtime.interpret)
# Triton 3.7.1's interpreter multiplies bfloat16 tl.dot operands as their raw bits (numpy has no
# bfloat16): it gets them as float32 (exact: bfloat16 products fit float32, which is what the
# tensor cores accumulate in). Compiled kernels never take this branch.
_UPCAST_BF16 = tl.constexpr(INTERPRETED)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """``a @ b`` accumulated in float32 (``PRECISION``: ``"ieee"`` for float32 inputs, no TF32)."""
    if _UPCAST_BF16 and a.dtype == tl.bfloat16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _tanh(x):
    """``tanh(x) = 1 - 2 / (exp(2x) + 1)``, one exponential and no branch: the gather kernels' tanh
    (:func:`~.kernels._tanh`) adds an odd polynomial below ``|x| = 0.1`` for float32 / float64 caps of
    1e10 and more, whose second branch held registers that sm_80's dk-dv kernel spilled (8-16 bytes).
    Its absolute error, about float32's eps, is ``c * eps`` in a capped score: 4e-6 at ``c = 30``,
    far under the tiles' half-precision inputs' rounding."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _tile_rows(X, block, hk, n, s_n, s_h, offs, d, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Rows ``X[block * BLOCK + r // GROUP, hk * GROUP + r % GROUP, :d]``: ``[BLOCK * GROUP, D]``
    (zeros past ``d`` and past ``n``), and their node ids and heads."""
    r = tl.arange(0, BLOCK * GROUP)
    node = block * BLOCK + r // GROUP
    head = hk * GROUP + r % GROUP
    ptr = X + node[:, None].to(tl.int64) * s_n + head[:, None] * s_h + offs[None, :]
    return tl.load(ptr, mask=(node < n)[:, None] & (offs < d)[None, :], other=0.0), node, head


@triton.jit
def _keys(X, first, hk, n, s_n, s_h, offs, d, COUNT: tl.constexpr):
    """``X[first + c, hk, :d]``: ``[COUNT, D]`` (zeros past ``d`` and past ``n``)."""
    node = first + tl.arange(0, COUNT)
    ptr = X + node[:, None].to(tl.int64) * s_n + hk * s_h + offs[None, :]
    return tl.load(ptr, mask=(node < n)[:, None] & (offs < d)[None, :], other=0.0)


@triton.jit
def _bits(MASKS, tile, rows, cols, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """Whether each cell of mask row ``tile`` is an edge: ``[R, BN]`` for ``rows [R]`` and ``cols [BN]``
    (tile offsets), ``[BN, R]`` unless ``ROWS_FIRST``. One, two or four int32 words a row (tiles of
    up to 128 keys), loaded as vectors of rows and spread over the keys in registers (a ``[R, BN]``
    grid of word pointers held 64-bit addresses of every cell)."""
    base = MASKS + (tile.to(tl.int64) * BLOCK_M + rows) * WORDS
    lo = tl.load(base)
    hi = lo
    if WORDS > 1:
        hi = tl.load(base + 1)
    if ROWS_FIRST:  # one return: Triton types every return of a function alike, even under a constexpr if
        word = tl.where(cols[None, :] < 32, lo[:, None], hi[:, None])
    else:
        word = tl.where(cols[:, None] < 32, lo[None, :], hi[None, :])
    if WORDS > 2:  # keys 64..127 of a 128-key tile: words 2 and 3 (64-key tiles compile as before)
        w2, w3 = tl.load(base + 2), tl.load(base + 3)
        if ROWS_FIRST:
            word = tl.where(cols[None, :] < 64, word, tl.where(cols[None, :] < 96, w2[:, None], w3[:, None]))
        else:
            word = tl.where(cols[:, None] < 64, word, tl.where(cols[:, None] < 96, w2[None, :], w3[None, :]))
    if ROWS_FIRST:
        bit = (word >> (cols[None, :] % 32)) & 1
    else:
        bit = (word >> (cols[:, None] % 32)) & 1
    return bit != 0


@triton.jit
def _forward_step(q, K, V, MASKS, kb, mrow, hk, n_k, dk, dv, scale, cap, m, l, acc,
                  s_kn, s_kh, s_vn, s_vh, od, ov, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                  PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  WORDS: tl.constexpr):
    """One tile (key block ``kb``, mask row ``mrow``) of the forward's online softmax: the new ``(m, l, acc)``."""
    k = _keys(K, kb * BLOCK_N, hk, n_k, s_kn, s_kh, od, dk, BLOCK_N)  # [BN, BDK]
    s = _dot(q, tl.trans(k), PRECISION) * scale  # [R, BN]
    if SOFTCAP:
        s = cap * _tanh(s / cap)
    if MASKED:
        r = tl.arange(0, BLOCK_M * GROUP) // GROUP
        s = tl.where(_bits(MASKS, mrow, r, tl.arange(0, BLOCK_N), WORDS, BLOCK_M, True), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows without a finite score yet
    alpha = tl.exp(m - shift)
    p = tl.exp(s - shift[:, None])
    v = _keys(V, kb * BLOCK_N, hk, n_k, s_vn, s_vh, ov, dv, BLOCK_N)  # [BN, BDV]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _first(IDS, start, end):
    """``IDS[start]`` (0 for an empty range ``start .. end``): the id of a loop's first tile."""
    return tl.load(IDS + start, mask=start < end, other=0)


@triton.jit
def _out_offsets(node, head, ov, s_on, s_oh):
    return node[:, None].to(tl.int64) * s_on + head[:, None] * s_oh + ov[None, :]


# The tile loops carry the tile's block id and mask row from one step to the next and read the
# next step's as plain scalars (``_first`` of ``t + 1``), as FlexAttention carries its key /
# value offsets: the software pipeliner then sees key / value (query / output-gradient) loads
# whose addresses come from the loop's own arguments, and issues them ``num_stages - 1`` steps
# ahead. Read inside the step (``tl.load(QKB + t)``), the id was itself made an asynchronous copy
# that the tiles' loads waited for, and every step waited for all its copies at its top
# (``async_wait {num = 0}``, data/gpu issue 56).
@triton.jit
def tile_forward_kernel(
    Q, K, V, OUT, LSE, OUT0, LSE0, QPTR, QSPLIT, QKB, QMASK, MASKS,
    n_q, n_k, heads, dk, dv, scale: tl.float64, cap: tl.float64,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh,
    INIT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WORDS: tl.constexpr,
):
    """``OUT [n_q, H, dv]`` and ``LSE [H, n_q]`` over query block ``program_id(0)``, key/value head
    ``program_id(1)``; with ``INIT`` the online softmax takes in ``OUT0`` / ``LSE0`` (the gathered
    remainder's result, laid out like ``OUT`` / ``LSE``)."""
    qb, hk = tl.program_id(0), tl.program_id(1)
    scale, cap = tl.full([], scale, tl.float32), tl.full([], cap, tl.float32)
    od, ov = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q, node, head = _tile_rows(Q, qb, hk, n_q, s_qn, s_qh, od, dk, BLOCK_M, GROUP)  # [R, BDK]
    live = node < n_q
    m = tl.full([BLOCK_M * GROUP], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * GROUP], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP, BLOCK_DV], tl.float32)
    start, split, end = tl.load(QPTR + qb), tl.load(QSPLIT + qb), tl.load(QPTR + qb + 1)
    kb = _first(QKB, start, split)
    for t in range(start, split):
        kb_next = _first(QKB, t + 1, split)
        m, l, acc = _forward_step(q, K, V, MASKS, kb, 0, hk, n_k, dk, dv, scale, cap, m, l, acc,
                                  s_kn, s_kh, s_vn, s_vh, od, ov, False, SOFTCAP, PRECISION, GROUP,
                                  BLOCK_M, BLOCK_N, WORDS)
        kb = kb_next
    kb, mrow = _first(QKB, split, end), _first(QMASK, split, end)
    for t in range(split, end):
        kb_next, mrow_next = _first(QKB, t + 1, end), _first(QMASK, t + 1, end)
        m, l, acc = _forward_step(q, K, V, MASKS, kb, mrow, hk, n_k, dk, dv, scale, cap, m, l, acc,
                                  s_kn, s_kh, s_vn, s_vh, od, ov, True, SOFTCAP, PRECISION, GROUP,
                                  BLOCK_M, BLOCK_N, WORDS)
        kb, mrow = kb_next, mrow_next
    if INIT:  # the remainder as one more chunk: sum 1 (or 0 without a logit) at its log-sum-exp, sum times out0
        # (merged after the tiles, not before: loaded before, sm_80's ptxas spilled 8 bytes at d = 64)
        lse0 = tl.load(LSE0 + head * n_q + node, mask=live, other=float("inf"))
        m0 = tl.where(lse0 == float("inf"), float("-inf"), lse0)
        m_new = tl.maximum(m, m0)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp(m - shift), tl.exp(m0 - shift)
        out0 = tl.load(OUT0 + _out_offsets(node, head, ov, s_on, s_oh), mask=live[:, None] & (ov < dv)[None, :],
                       other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + out0 * beta[:, None]
        l = l * alpha + beta
        m = m_new
    dead = l == 0.0  # no edge, or every score -inf
    out = tl.where(dead[:, None], 0.0, acc / tl.where(dead, 1.0, l)[:, None])
    lse = tl.where(dead, float("inf"), m + tl.log(tl.where(dead, 1.0, l)))
    # offsets formed here, not kept from before the loops: 64-bit, they held registers through them
    tl.store(OUT + _out_offsets(node, head, ov, s_on, s_oh), out.to(OUT.dtype.element_ty),
             mask=live[:, None] & (ov < dv)[None, :])
    tl.store(LSE + head * n_q + node, lse, mask=live)


@triton.jit
def _scores_t(a, b, scale, cap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """``(s, t)``: ``s = c tanh(scale a b^T / c)`` (the cap only with ``SOFTCAP``), ``t`` the tanh."""
    s = _dot(a, tl.trans(b), PRECISION) * scale
    t = s  # not used without a cap
    if SOFTCAP:
        t = _tanh(s / cap)
        s = cap * t
    return s, t


@triton.jit
def _dq_step(q, do, lse, delta, K, V, MASKS, kb, mrow, hk, n_k, dk, dv, scale, cap, dq,
             s_kn, s_kh, s_vn, s_vh, od, ov, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    k = _keys(K, kb * BLOCK_N, hk, n_k, s_kn, s_kh, od, dk, BLOCK_N)  # [BN, BDK]
    v = _keys(V, kb * BLOCK_N, hk, n_k, s_vn, s_vh, ov, dv, BLOCK_N)  # [BN, BDV]
    s, th = _scores_t(q, k, scale, cap, SOFTCAP, PRECISION)  # [R, BN]
    p = tl.exp(s - lse[:, None])
    if MASKED:
        r = tl.arange(0, BLOCK_M * GROUP) // GROUP
        p = tl.where(_bits(MASKS, mrow, r, tl.arange(0, BLOCK_N), WORDS, BLOCK_M, True), p, 0.0)
    if SOFTCAP:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2, taken now so the tanh is not held
        p = p * (1.0 - th * th)  # through the next product (at d = 128 it spilled 12 bytes on sm_90)
    dp = _dot(do, tl.trans(v), PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + _dot(ds.to(k.dtype), k, PRECISION)


@triton.jit
def _dq_offsets(node, head, heads, dk, od):
    return node[:, None].to(tl.int64) * (heads * dk) + head[:, None] * dk + od[None, :]


@triton.jit
def tile_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DQ0, QPTR, QSPLIT, QKB, QMASK, MASKS,
    n_q, n_k, heads, dk, dv, scale: tl.float64, cap: tl.float64,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_don, s_doh,
    INIT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WORDS: tl.constexpr,
):
    """``DQ [n_q, H, dk]`` (contiguous, the inputs' dtype): the query gradients, the tiles' share
    accumulated in float32, plus with ``INIT`` the gathered remainder's ``DQ0`` (laid out like ``DQ``)."""
    qb, hk = tl.program_id(0), tl.program_id(1)
    scale, cap = tl.full([], scale, tl.float32), tl.full([], cap, tl.float32)
    od, ov = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q, node, head = _tile_rows(Q, qb, hk, n_q, s_qn, s_qh, od, dk, BLOCK_M, GROUP)  # [R, BDK]
    do, _, _ = _tile_rows(DO, qb, hk, n_q, s_don, s_doh, ov, dv, BLOCK_M, GROUP)  # [R, BDV]
    live = node < n_q
    lse = tl.load(LSE + head * n_q + node, mask=live, other=float("inf"))
    delta = tl.load(DELTA + head * n_q + node, mask=live, other=0.0)
    dq = tl.zeros([BLOCK_M * GROUP, BLOCK_DK], tl.float32)
    if INIT:  # the remainder's share starts the accumulator (in units of dS K: times scale at the end)
        dq = tl.load(DQ0 + _dq_offsets(node, head, heads, dk, od), mask=live[:, None] & (od < dk)[None, :],
                     other=0.0).to(tl.float32) / scale
    start, split, end = tl.load(QPTR + qb), tl.load(QSPLIT + qb), tl.load(QPTR + qb + 1)
    kb = _first(QKB, start, split)
    for t in range(start, split):
        kb_next = _first(QKB, t + 1, split)
        dq = _dq_step(q, do, lse, delta, K, V, MASKS, kb, 0, hk, n_k, dk, dv, scale, cap, dq,
                      s_kn, s_kh, s_vn, s_vh, od, ov, False, SOFTCAP, PRECISION, GROUP, BLOCK_M, BLOCK_N, WORDS)
        kb = kb_next
    kb, mrow = _first(QKB, split, end), _first(QMASK, split, end)
    for t in range(split, end):
        kb_next, mrow_next = _first(QKB, t + 1, end), _first(QMASK, t + 1, end)
        dq = _dq_step(q, do, lse, delta, K, V, MASKS, kb, mrow, hk, n_k, dk, dv, scale, cap, dq,
                      s_kn, s_kh, s_vn, s_vh, od, ov, True, SOFTCAP, PRECISION, GROUP, BLOCK_M, BLOCK_N, WORDS)
        kb, mrow = kb_next, mrow_next
    # offsets formed again, not kept from the INIT load: 64-bit, held through the loops they spilled on sm_80
    tl.store(DQ + _dq_offsets(node, head, heads, dk, od), (dq * scale).to(DQ.dtype.element_ty),
             mask=live[:, None] & (od < dk)[None, :])


@triton.jit
def _dkdv_step(k, v, cols, Q, DO, LSE, DELTA, MASKS, qb, mrow, hk, n_q, dk, dv, scale, cap, dkey, dval,
               s_qn, s_qh, s_don, s_doh, od, ov, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
               PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WORDS: tl.constexpr):
    q, node, head = _tile_rows(Q, qb, hk, n_q, s_qn, s_qh, od, dk, BLOCK_M, GROUP)  # [R, BDK]
    do, _, _ = _tile_rows(DO, qb, hk, n_q, s_don, s_doh, ov, dv, BLOCK_M, GROUP)  # [R, BDV]
    live = node < n_q
    lse = tl.load(LSE + head * n_q + node, mask=live, other=float("inf"))
    delta = tl.load(DELTA + head * n_q + node, mask=live, other=0.0)
    s, th = _scores_t(k, q, scale, cap, SOFTCAP, PRECISION)  # [KEYS, R]: keys x (query, head) rows
    p = tl.exp(s - lse[None, :])
    if MASKED:
        r = tl.arange(0, BLOCK_M * GROUP) // GROUP
        p = tl.where(_bits(MASKS, mrow, r, cols, WORDS, BLOCK_M, False), p, 0.0)
    pv = p.to(do.dtype)
    if SOFTCAP:  # as in _dq_step: the cap's derivative taken before the products, the tanh not held through them
        p = p * (1.0 - th * th)
    dval += _dot(pv, do, PRECISION)
    dp = _dot(v, tl.trans(do), PRECISION)  # [KEYS, R]
    ds = p * (dp - delta[None, :])
    return dkey + _dot(ds.to(q.dtype), q, PRECISION), dval


@triton.jit
def tile_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KPTR, KSPLIT, KQB, KMASK, MASKS,
    n_q, n_k, heads, kv_heads, dk, dv, scale: tl.float64, cap: tl.float64,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_don, s_doh,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WORDS: tl.constexpr, SPLIT: tl.constexpr,
):
    """``DK [n_k, H_kv, dk]`` and ``DV [n_k, H_kv, dv]`` (contiguous, the inputs' dtype): the tiles' key
    and value gradients, summed over the ``GROUP`` query heads of each key/value head in float32.
    ``SPLIT`` programs share a key block, ``BLOCK_N / SPLIT`` keys each, over the same tile list
    (:func:`~.tile_config.default_config` takes 2: 64-key programs spilled; each query tile is then
    read twice).
    (A gathered remainder's share is the caller's to add: merged in here as dq's is, or written in
    float32, it cost 4-24 bytes of spills on sm_90 at d = 128 and on sm_80 at d = 64.)"""
    KEYS: tl.constexpr = BLOCK_N // SPLIT
    kb, part, hk = tl.program_id(0) // SPLIT, tl.program_id(0) % SPLIT, tl.program_id(1)
    scale, cap = tl.full([], scale, tl.float32), tl.full([], cap, tl.float32)
    od, ov = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    cols = part * KEYS + tl.arange(0, KEYS)  # this program's keys, as columns of the block's tiles
    k = _keys(K, kb * BLOCK_N + part * KEYS, hk, n_k, s_kn, s_kh, od, dk, KEYS)  # [KEYS, BDK]
    v = _keys(V, kb * BLOCK_N + part * KEYS, hk, n_k, s_vn, s_vh, ov, dv, KEYS)  # [KEYS, BDV]
    node = (kb * BLOCK_N + cols).to(tl.int64)
    live = (node < n_k)[:, None]
    dkey = tl.zeros([KEYS, BLOCK_DK], tl.float32)
    dval = tl.zeros([KEYS, BLOCK_DV], tl.float32)
    start, split, end = tl.load(KPTR + kb), tl.load(KSPLIT + kb), tl.load(KPTR + kb + 1)
    qb = _first(KQB, start, split)
    for t in range(start, split):
        qb_next = _first(KQB, t + 1, split)
        dkey, dval = _dkdv_step(k, v, cols, Q, DO, LSE, DELTA, MASKS, qb, 0, hk, n_q, dk, dv, scale, cap, dkey,
                                dval, s_qn, s_qh, s_don, s_doh, od, ov, False, SOFTCAP, PRECISION, GROUP, BLOCK_M,
                                BLOCK_N, WORDS)
        qb = qb_next
    qb, mrow = _first(KQB, split, end), _first(KMASK, split, end)
    for t in range(split, end):
        qb_next, mrow_next = _first(KQB, t + 1, end), _first(KMASK, t + 1, end)
        dkey, dval = _dkdv_step(k, v, cols, Q, DO, LSE, DELTA, MASKS, qb, mrow, hk, n_q, dk, dv, scale, cap, dkey,
                                dval, s_qn, s_qh, s_don, s_doh, od, ov, True, SOFTCAP, PRECISION, GROUP, BLOCK_M,
                                BLOCK_N, WORDS)
        qb, mrow = qb_next, mrow_next
    tl.store(DK + node[:, None] * (kv_heads * dk) + hk * dk + od[None, :], (dkey * scale).to(DK.dtype.element_ty),
             mask=live & (od < dk)[None, :])
    tl.store(DV + node[:, None] * (kv_heads * dv) + hk * dv + ov[None, :], dval.to(DV.dtype.element_ty),
             mask=live & (ov < dv)[None, :])


@triton.jit
def tile_delta_kernel(DO, OUT, DELTA, n_q, heads, dv, s_don, s_doh, s_on, s_oh,
                      BLOCK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``DELTA [H, n_q]`` (float32) ``= <dO_i, O_i>`` per row and head, in one pass over ``dO`` and ``O``
    in their own dtype (products summed in float32): rows ``program_id(0) * BLOCK ..`` of head ``program_id(1)``."""
    h = tl.program_id(1)
    node = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ov = tl.arange(0, BLOCK_DV)
    live = node < n_q
    mask = live[:, None] & (ov < dv)[None, :]
    do = tl.load(DO + node[:, None].to(tl.int64) * s_don + h * s_doh + ov[None, :], mask=mask, other=0.0)
    o = tl.load(OUT + node[:, None].to(tl.int64) * s_on + h * s_oh + ov[None, :], mask=mask, other=0.0)
    tl.store(DELTA + h * n_q + node, tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1), mask=live)


DELTA_ROWS = 64  # rows of one head per tile_delta_kernel program


def _meta(q, v, plan, group: int, options) -> dict:
    """The constants and launch options of a tile kernel: ``options = (num_warps, num_stages)``."""
    if plan.words > 4:
        raise ValueError(f"the tile kernels take tiles of up to 128 keys, a power of two (got block_n = {plan.block_n})")
    block_dk = max(16, triton.next_power_of_2(q.shape[2]))  # tl.dot needs a K dim of 16 or more
    block_dv = max(16, triton.next_power_of_2(v.shape[2]))
    return dict(
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 is ignored by 16-bit inputs
        GROUP=group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        WORDS=plan.words, maxnreg=MAX_REGISTERS, num_warps=options[0], num_stages=options[1],
    )


def _config(q, v, plan, group: int, arch):
    """The launch options of the tile kernels for these inputs and plan (:func:`~.tile_config.tile_config`)."""
    return tile_config(q.dtype, max(q.shape[2], v.shape[2]), plan.block_m * group, plan.block_n, arch=arch)


def _masks(plan):
    return plan.masks if plan.masks.numel() else plan.q_tile_mask  # a valid pointer when no tile is partial


def forward_launch(q, k, v, plan, scale, softcap=None, init=None, arch=None) -> Tuple[Launch, tuple]:
    """The :func:`tile_forward_kernel` launch and its outputs ``(out [n_q, H, dv], lse [H, n_q] float32)``.

    ``q [n_q, H, d]``, ``k`` / ``v`` ``[n_k, H / G, d]`` (unit stride in the last dim); ``init =
    (out0, lse0)``: the gathered remainder's output (strides of ``out``) and log-sum-exp, or ``None``;
    ``arch``: the compute capability to take launch options for (default: this process's device).
    """
    n_q, heads, dk = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    out = q.new_empty(n_q, heads, v.shape[2]) if init is None else torch.empty_like(init[0])
    lse = torch.empty(heads, n_q, dtype=torch.float32, device=q.device)
    out0, lse0 = (out, lse) if init is None else init
    launch = Launch(tile_forward_kernel, (plan.q_ptr.numel() - 1, kv_heads), (
        q, k, v, out, lse, out0, lse0, plan.q_ptr, plan.q_split, plan.q_tile_kb, plan.q_tile_mask, _masks(plan),
        n_q, k.shape[0], heads, dk, v.shape[2], scale, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
    ), dict(INIT=init is not None, SOFTCAP=softcap is not None,
            **_meta(q, v, plan, group, _config(q, v, plan, group, arch).forward)))
    return launch, (out, lse)


def delta_launch(grad_out, out) -> Tuple[Launch, torch.Tensor]:
    """The :func:`tile_delta_kernel` launch and its output ``delta [H, n_q]`` (float32, ``<dO_i, O_i>``)."""
    n_q, heads, dv = out.shape
    delta = torch.empty(heads, n_q, dtype=torch.float32, device=out.device)
    return Launch(tile_delta_kernel, (triton.cdiv(n_q, DELTA_ROWS), heads), (
        grad_out, out, delta, n_q, heads, dv, grad_out.stride(0), grad_out.stride(1), out.stride(0), out.stride(1),
    ), dict(BLOCK=DELTA_ROWS, BLOCK_DV=triton.next_power_of_2(dv), num_warps=4)), delta


def backward_launches(q, k, v, grad_out, lse, delta, plan, scale, softcap=None, init=None, arch=None
                      ) -> Tuple[Tuple[Launch, Launch], tuple]:
    """The :func:`tile_dq_kernel` and :func:`tile_dkdv_kernel` launches and their outputs ``(dq, dk, dv)``
    in the inputs' dtype. ``lse`` and ``delta`` are the call's ``[H, n_q]`` (float32); ``init``: the
    gathered remainder's ``dq`` (contiguous), added in float32 before the one rounding, or ``None``
    (the caller adds the remainder's ``dk`` and ``dv``). ``arch`` as in :func:`forward_launch`."""
    n_q, heads, dk = q.shape
    n_k, kv_heads, dv = k.shape[0], k.shape[1], v.shape[2]
    group = heads // kv_heads
    config = _config(q, v, plan, group, arch)
    common = (n_q, n_k, heads)
    tail = (dk, dv, scale, 1.0 if softcap is None else softcap, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1))
    dq = torch.empty(n_q, heads, dk, dtype=q.dtype, device=q.device)
    dkey, dval = torch.empty_like(k), torch.empty(n_k, kv_heads, dv, dtype=v.dtype, device=v.device)
    masks = _masks(plan)
    launches = (
        Launch(tile_dq_kernel, (plan.q_ptr.numel() - 1, kv_heads), (
            q, k, v, grad_out, lse, delta, dq, dq if init is None else init, plan.q_ptr, plan.q_split, plan.q_tile_kb,
            plan.q_tile_mask, masks, *common, *tail),
            dict(INIT=init is not None, SOFTCAP=softcap is not None, **_meta(q, v, plan, group, config.dq))),
        Launch(tile_dkdv_kernel, ((plan.k_ptr.numel() - 1) * config.dkdv_split, kv_heads), (
            q, k, v, grad_out, lse, delta, dkey, dval, plan.k_ptr, plan.k_split, plan.k_tile_qb, plan.k_tile_mask,
            masks, *common, kv_heads, *tail),
            dict(SOFTCAP=softcap is not None, SPLIT=config.dkdv_split, **_meta(q, v, plan, group, config.dkdv))),
    )
    return launches, (dq, dkey, dval)
