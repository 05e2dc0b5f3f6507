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

from .kernels import Launch, MAX_REGISTERS, _tanh

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
def _tile_rows(X, block, hk, n, s_n, s_h, offs, d, BLOCK: tl.constexpr, GROUP: tl.constexpr):
    """Rows ``X[block * BLOCK + r // GROUP, hk * GROUP + r % GROUP, :d]``: ``[BLOCK * GROUP, D]``
    (zeros past ``d`` and past ``n``), and their node ids and heads."""
    r = tl.arange(0, BLOCK * GROUP)
    node = block * BLOCK + r // GROUP
    head = hk * GROUP + r % GROUP
    ptr = X + node[:, None].to(tl.int64) * s_n + head[:, None] * s_h + offs[None, :]
    return tl.load(ptr, mask=(node < n)[:, None] & (offs < d)[None, :], other=0.0), node, head


@triton.jit
def _keys(X, kb, hk, n, s_n, s_h, offs, d, BLOCK_N: tl.constexpr):
    """``X[kb * BLOCK_N + c, hk, :d]``: ``[BLOCK_N, D]`` (zeros past ``d`` and past ``n``)."""
    node = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    ptr = X + node[:, None].to(tl.int64) * s_n + hk * s_h + offs[None, :]
    return tl.load(ptr, mask=(node < n)[:, None] & (offs < d)[None, :], other=0.0)


@triton.jit
def _bits(MASKS, tile, rows, cols, WORDS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """Whether each cell of mask row ``tile`` is an edge: ``[R, BN]`` for ``rows [R]`` and ``cols [BN]``
    (tile offsets), ``[BN, R]`` unless ``ROWS_FIRST``. One or two int32 words a row, loaded as
    vectors of rows and spread over the keys in registers (a ``[R, BN]`` grid of word pointers
    held 64-bit addresses of every cell)."""
    base = MASKS + (tile.to(tl.int64) * BLOCK_M + rows) * WORDS
    lo = tl.load(base)
    hi = lo
    if WORDS > 1:
        hi = tl.load(base + 1)
    if ROWS_FIRST:
        word = tl.where(cols[None, :] < 32, lo[:, None], hi[:, None])
        return ((word >> (cols[None, :] % 32)) & 1) != 0
    word = tl.where(cols[:, None] < 32, lo[None, :], hi[None, :])
    return ((word >> (cols[:, None] % 32)) & 1) != 0


@triton.jit
def _forward_step(q, K, V, MASKS, QKB, QMASK, t, hk, n_k, dk, dv, scale, cap, m, l, acc,
                  s_kn, s_kh, s_vn, s_vh, od, ov, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                  PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  WORDS: tl.constexpr):
    """One tile of the forward's online softmax: the new ``(m, l, acc)``."""
    kb = tl.load(QKB + t)
    k = _keys(K, kb, hk, n_k, s_kn, s_kh, od, dk, BLOCK_N)  # [BN, BDK]
    s = _dot(q, tl.trans(k), PRECISION) * scale  # [R, BN]
    if SOFTCAP:
        s = cap * _tanh(s / cap)
    if MASKED:
        r = tl.arange(0, BLOCK_M * GROUP) // GROUP
        s = tl.where(_bits(MASKS, tl.load(QMASK + t), r, tl.arange(0, BLOCK_N), WORDS, BLOCK_M, True), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows without a finite score yet
    alpha = tl.exp(m - shift)
    p = tl.exp(s - shift[:, None])
    v = _keys(V, kb, hk, n_k, s_vn, s_vh, ov, dv, BLOCK_N)  # [BN, BDV]
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _out_offsets(node, head, ov, s_on, s_oh):
    return node[:, None].to(tl.int64) * s_on + head[:, None] * s_oh + ov[None, :]


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
    for t in range(start, split):
        m, l, acc = _forward_step(q, K, V, MASKS, QKB, QMASK, t, hk, n_k, dk, dv, scale, cap, m, l, acc,
                                  s_kn, s_kh, s_vn, s_vh, od, ov, False, SOFTCAP, PRECISION, GROUP,
                                  BLOCK_M, BLOCK_N, WORDS)
    for t in range(split, end):
        m, l, acc = _forward_step(q, K, V, MASKS, QKB, QMASK, t, hk, n_k, dk, dv, scale, cap, m, l, acc,
                                  s_kn, s_kh, s_vn, s_vh, od, ov, True, SOFTCAP, PRECISION, GROUP,
                                  BLOCK_M, BLOCK_N, WORDS)
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
def _dq_step(q, do, lse, delta, K, V, MASKS, QKB, QMASK, t, hk, n_k, dk, dv, scale, cap, dq,
             s_kn, s_kh, s_vn, s_vh, od, ov, MASKED: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
             GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    kb = tl.load(QKB + t)
    k = _keys(K, kb, hk, n_k, s_kn, s_kh, od, dk, BLOCK_N)  # [BN, BDK]
    v = _keys(V, kb, hk, n_k, s_vn, s_vh, ov, dv, BLOCK_N)  # [BN, BDV]
    s, th = _scores_t(q, k, scale, cap, SOFTCAP, PRECISION)  # [R, BN]
    p = tl.exp(s - lse[:, None])
    if MASKED:
        r = tl.arange(0, BLOCK_M * GROUP) // GROUP
        p = tl.where(_bits(MASKS, tl.load(QMASK + t), r, tl.arange(0, BLOCK_N), WORDS, BLOCK_M, True), p, 0.0)
    dp = _dot(do, tl.trans(v), PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2
        ds = ds * (1.0 - th * th)
    return dq + _dot(ds.to(k.dtype), k, PRECISION)


@triton.jit
def tile_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, QPTR, QSPLIT, QKB, QMASK, MASKS,
    n_q, n_k, heads, dk, dv, scale: tl.float64, cap: tl.float64,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_don, s_doh,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WORDS: tl.constexpr,
):
    """``DQ [n_q, H, dk]`` (float32, contiguous): the tiles' share of the query gradients."""
    qb, hk = tl.program_id(0), tl.program_id(1)
    scale, cap = tl.full([], scale, tl.float32), tl.full([], cap, tl.float32)
    od, ov = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q, node, head = _tile_rows(Q, qb, hk, n_q, s_qn, s_qh, od, dk, BLOCK_M, GROUP)  # [R, BDK]
    do, _, _ = _tile_rows(DO, qb, hk, n_q, s_don, s_doh, ov, dv, BLOCK_M, GROUP)  # [R, BDV]
    live = node < n_q
    lse = tl.load(LSE + head * n_q + node, mask=live, other=float("inf"))
    delta = tl.load(DELTA + head * n_q + node, mask=live, other=0.0)
    dq = tl.zeros([BLOCK_M * GROUP, BLOCK_DK], tl.float32)
    start, split, end = tl.load(QPTR + qb), tl.load(QSPLIT + qb), tl.load(QPTR + qb + 1)
    for t in range(start, split):
        dq = _dq_step(q, do, lse, delta, K, V, MASKS, QKB, QMASK, t, hk, n_k, dk, dv, scale, cap, dq,
                      s_kn, s_kh, s_vn, s_vh, od, ov, False, SOFTCAP, PRECISION, GROUP, BLOCK_M, BLOCK_N, WORDS)
    for t in range(split, end):
        dq = _dq_step(q, do, lse, delta, K, V, MASKS, QKB, QMASK, t, hk, n_k, dk, dv, scale, cap, dq,
                      s_kn, s_kh, s_vn, s_vh, od, ov, True, SOFTCAP, PRECISION, GROUP, BLOCK_M, BLOCK_N, WORDS)
    tl.store(DQ + node[:, None].to(tl.int64) * (heads * dk) + head[:, None] * dk + od[None, :], dq * scale,
             mask=live[:, None] & (od < dk)[None, :])


@triton.jit
def _dkdv_step(k, v, Q, DO, LSE, DELTA, MASKS, KQB, KMASK, t, hk, n_q, dk, dv, scale, cap, dkey, dval,
               s_qn, s_qh, s_don, s_doh, od, ov, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
               PRECISION: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               WORDS: tl.constexpr):
    qb = tl.load(KQB + t)
    q, node, head = _tile_rows(Q, qb, hk, n_q, s_qn, s_qh, od, dk, BLOCK_M, GROUP)  # [R, BDK]
    do, _, _ = _tile_rows(DO, qb, hk, n_q, s_don, s_doh, ov, dv, BLOCK_M, GROUP)  # [R, BDV]
    live = node < n_q
    lse = tl.load(LSE + head * n_q + node, mask=live, other=float("inf"))
    delta = tl.load(DELTA + head * n_q + node, mask=live, other=0.0)
    s, th = _scores_t(k, q, scale, cap, SOFTCAP, PRECISION)  # [BN, R]: keys x (query, head) rows
    p = tl.exp(s - lse[None, :])
    if MASKED:
        r = tl.arange(0, BLOCK_M * GROUP) // GROUP
        p = tl.where(_bits(MASKS, tl.load(KMASK + t), r, tl.arange(0, BLOCK_N), WORDS, BLOCK_M, False), p, 0.0)
    dval += _dot(p.to(do.dtype), do, PRECISION)
    dp = _dot(v, tl.trans(do), PRECISION)  # [BN, R]
    ds = p * (dp - delta[None, :])
    if SOFTCAP:
        ds = ds * (1.0 - th * th)
    return dkey + _dot(ds.to(q.dtype), q, PRECISION), dval


@triton.jit
def tile_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, KPTR, KSPLIT, KQB, KMASK, MASKS,
    n_q, n_k, heads, kv_heads, dk, dv, scale: tl.float64, cap: tl.float64,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_don, s_doh,
    SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    WORDS: tl.constexpr,
):
    """``DK [n_k, H_kv, dk]`` and ``DV [n_k, H_kv, dv]`` (float32, contiguous): the tiles' share of the
    key and value gradients, summed over the ``GROUP`` query heads of each key/value head."""
    kb, hk = tl.program_id(0), tl.program_id(1)
    scale, cap = tl.full([], scale, tl.float32), tl.full([], cap, tl.float32)
    od, ov = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    k = _keys(K, kb, hk, n_k, s_kn, s_kh, od, dk, BLOCK_N)  # [BN, BDK]
    v = _keys(V, kb, hk, n_k, s_vn, s_vh, ov, dv, BLOCK_N)  # [BN, BDV]
    dkey = tl.zeros([BLOCK_N, BLOCK_DK], tl.float32)
    dval = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    start, split, end = tl.load(KPTR + kb), tl.load(KSPLIT + kb), tl.load(KPTR + kb + 1)
    for t in range(start, split):
        dkey, dval = _dkdv_step(k, v, Q, DO, LSE, DELTA, MASKS, KQB, KMASK, t, hk, n_q, dk, dv, scale, cap, dkey,
                                dval, s_qn, s_qh, s_don, s_doh, od, ov, False, SOFTCAP, PRECISION, GROUP, BLOCK_M,
                                BLOCK_N, WORDS)
    for t in range(split, end):
        dkey, dval = _dkdv_step(k, v, Q, DO, LSE, DELTA, MASKS, KQB, KMASK, t, hk, n_q, dk, dv, scale, cap, dkey,
                                dval, s_qn, s_qh, s_don, s_doh, od, ov, True, SOFTCAP, PRECISION, GROUP, BLOCK_M,
                                BLOCK_N, WORDS)
    node = (kb * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    live = (node < n_k)[:, None]
    tl.store(DK + node[:, None] * (kv_heads * dk) + hk * dk + od[None, :], dkey * scale, mask=live & (od < dk)[None, :])
    tl.store(DV + node[:, None] * (kv_heads * dv) + hk * dv + ov[None, :], dval, mask=live & (ov < dv)[None, :])


# Warps a program. Compiled for sm_80 at 64 x 64 tiles in bfloat16 with a softcap, four warps
# spilled 20 bytes a thread in the forward at d = 64 (255 registers); eight spill nothing at
# d = 16-128 on sm_80 or sm_90 (data/gpu/compiled.md) and keep 8 warps resident per SM.
TILE_WARPS = 8


def _meta(q, v, plan, group: int) -> dict:
    if plan.words > 2:
        raise ValueError(f"the tile kernels take tiles of up to 64 keys (got block_n = {plan.block_n})")
    block_dk = max(16, triton.next_power_of_2(q.shape[2]))  # tl.dot needs a K dim of 16 or more
    block_dv = max(16, triton.next_power_of_2(v.shape[2]))
    return dict(
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32 is ignored by 16-bit inputs
        GROUP=group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        WORDS=plan.words, maxnreg=MAX_REGISTERS, num_warps=TILE_WARPS,
    )


def _masks(plan):
    return plan.masks if plan.masks.numel() else plan.q_tile_mask  # a valid pointer when no tile is partial


def forward_launch(q, k, v, plan, scale, softcap=None, init=None) -> Tuple[Launch, tuple]:
    """The :func:`tile_forward_kernel` launch and its outputs ``(out [n_q, H, dv], lse [H, n_q] float32)``.

    ``q [n_q, H, d]``, ``k`` / ``v`` ``[n_k, H / G, d]`` (unit stride in the last dim); ``init =
    (out0, lse0)``: the gathered remainder's output (strides of ``out``) and log-sum-exp, or ``None``.
    """
    n_q, heads, dk = q.shape
    kv_heads = k.shape[1]
    out = q.new_empty(n_q, heads, v.shape[2]) if init is None else torch.empty_like(init[0])
    lse = torch.empty(heads, n_q, dtype=torch.float32, device=q.device)
    out0, lse0 = (out, lse) if init is None else init
    launch = Launch(tile_forward_kernel, (plan.q_ptr.numel() - 1, kv_heads), (
        q, k, v, out, lse, out0, lse0, plan.q_ptr, plan.q_split, plan.q_tile_kb, plan.q_tile_mask, _masks(plan),
        n_q, k.shape[0], heads, dk, v.shape[2], scale, 1.0 if softcap is None else softcap,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
    ), dict(INIT=init is not None, SOFTCAP=softcap is not None, **_meta(q, v, plan, heads // kv_heads)))
    return launch, (out, lse)


def backward_launches(q, k, v, grad_out, lse, delta, plan, scale, softcap=None) -> Tuple[Tuple[Launch, Launch], tuple]:
    """The :func:`tile_dq_kernel` and :func:`tile_dkdv_kernel` launches and their outputs ``(dq, dk, dv)``
    (float32): the tiles' share of the gradients. ``lse`` and ``delta`` are the call's ``[H, n_q]`` (float32)."""
    n_q, heads, dk = q.shape
    n_k, kv_heads, dv = k.shape[0], k.shape[1], v.shape[2]
    common = (n_q, n_k, heads)
    tail = (dk, dv, scale, 1.0 if softcap is None else softcap, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1))
    meta = dict(SOFTCAP=softcap is not None, **_meta(q, v, plan, heads // kv_heads))
    f32 = dict(dtype=torch.float32, device=q.device)
    dq = torch.empty(n_q, heads, dk, **f32)
    dkey, dval = torch.empty(n_k, kv_heads, dk, **f32), torch.empty(n_k, kv_heads, dv, **f32)
    masks = _masks(plan)
    launches = (
        Launch(tile_dq_kernel, (plan.q_ptr.numel() - 1, kv_heads), (
            q, k, v, grad_out, lse, delta, dq, plan.q_ptr, plan.q_split, plan.q_tile_kb, plan.q_tile_mask, masks,
            *common, *tail), meta),
        Launch(tile_dkdv_kernel, (plan.k_ptr.numel() - 1, kv_heads), (
            q, k, v, grad_out, lse, delta, dkey, dval, plan.k_ptr, plan.k_split, plan.k_tile_qb, plan.k_tile_mask,
            masks, *common, kv_heads, *tail), meta),
    )
    return launches, (dq, dkey, dval)
