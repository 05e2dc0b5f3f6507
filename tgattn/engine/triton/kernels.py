"""The Triton kernels of the ``triton`` backend, and the launches that size their grids.

Importing this module imports ``triton`` and defines the kernels: with ``TRITON_INTERPRET=1``
in the environment at that moment they are Triton's interpreter functions and run on CPU
tensors (``INTERPRETED`` says which); :func:`tgattn.engine.triton.attention.kernels_module`
re-imports the module when the environment changed since. Triton's own library of jit
functions (``tl.zeros``, ``tl.rand``, ...) is defined when ``triton`` is first imported, so the
interpreter works only if ``TRITON_INTERPRET=1`` was set before that.

Every kernel walks CSR rows (edges sorted by (query, key), ``ptr [rows + 1]``) with one
program per (block of ``BLOCK_M`` rows, head). Row ``r`` of a block takes its edges
``BLOCK_N`` at a time, so a chunk is a ``[BLOCK_M, BLOCK_N]`` grid of edge slots whose
key (or query) rows are gathered as ``[BLOCK_M, BLOCK_N, d]``; slots past a row's end are
masked. Rows are taken in the order ``order`` (by decreasing degree), so that the rows of one
block have about the same number of edges and few slots idle.

* :func:`forward_kernel`: scores, online softmax (Milakov & Gimelshein, 2018) and the
  weighted sum of values, accumulated in float32 (float64 for float64 inputs); saves the
  log-sum-exp of each row and head; optionally writes the weights in a second pass. Options:
  logit soft-capping ``c * tanh(s / c)`` of the scaled scores before the bias (Gemma 2), and
  a sink logit per head in each softmax without a value (gpt-oss); the backward kernels
  recompute the cap and multiply by its derivative, the sinks' gradient needs only the
  log-sum-exp and ``delta`` (:mod:`tgattn.engine.triton.attention`).
* :func:`dq_kernel` and :func:`dkdv_kernel`: the backward pass of FlashAttention-2 (Dao,
  2023), recomputing each edge's weight from the saved log-sum-exp: ``dq`` (and the bias
  gradient) over query rows, ``dk`` / ``dv`` over key rows of the transposed pattern. Each
  program owns the rows it writes: no atomics, the same bits on every run. (Atomics would
  save the key-side pass its recomputed scores, but that pass's time goes to gathering the
  query and output-gradient rows of each edge, which a scatter of ``dk`` / ``dv`` per edge
  would replace by read-modify-writes of the same size.)
* Edge features (:mod:`tgattn.engine.triton.edge_features`): the features ``[E, F]`` of each edge
  slot are read through the edge set's permutation (the caller's order); the key term adds
  ``scale * <kf_i, e_ij>`` to the scores, the value term sums ``a_ij e_ij`` beside the values, and
  the backward's ``dq`` pass writes each head's share of the features' gradient per edge (each
  edge has one query row: no atomics here either).
* Dropout keeps edge ``e`` of head ``h`` where ``tl.rand(seed, e * H + h) >= p`` (Philox,
  counter based): the backward and :func:`keep_kernel` regenerate the same mask.
  The seed is not specialised (``do_not_specialize``): Triton would otherwise compile each
  kernel again for the one seed in 16 that is divisible by 16, and for seed 1.
"""

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _keep(seed, e, h, heads, p_drop):
    """Whether dropout keeps the edges ``e`` of head ``h`` (one Philox draw per edge and head)."""
    return tl.rand(seed, e * heads + h) >= p_drop


@triton.jit
def _block(ORDER, PTR, n, BLOCK_M: tl.constexpr):
    """The rows of this program: ids ``[BLOCK_M]``, which exist, and their edge ranges."""
    slot = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = slot < n
    rows = tl.load(ORDER + slot, mask=live, other=0)
    start = tl.load(PTR + rows, mask=live, other=0)
    end = tl.load(PTR + rows + 1, mask=live, other=0)
    return rows, live, start, end


@triton.jit
def _rows(X, rows, h, s_n, s_h, live, offs, d, ACC: tl.constexpr):
    """``X[rows, h, :d]`` as ``[BLOCK_M, BLOCK_D]`` (zeros past ``d`` and for dead rows)."""
    ptr = X + rows[:, None] * s_n + h * s_h + offs[None, :]
    return tl.load(ptr, mask=live[:, None] & (offs < d)[None, :], other=0.0).to(ACC)


@triton.jit
def _gather(X, idx, h, s_n, s_h, edge, offs, d, ACC: tl.constexpr):
    """``X[idx, h, :d]`` for a ``[BLOCK_M, BLOCK_N]`` grid of node ids: ``[BLOCK_M, BLOCK_N, BLOCK_D]``."""
    ptr = X + idx[:, :, None] * s_n + h * s_h + offs[None, None, :]
    return tl.load(ptr, mask=edge[:, :, None] & (offs < d)[None, None, :], other=0.0).to(ACC)


@triton.jit
def _callers(PERM, e, edge, PERMUTED: tl.constexpr):
    """The caller's edge ids of sorted edge ids ``e`` (``PERM[e]``; ``e`` itself when the edges came sorted)."""
    if PERMUTED:
        e = tl.load(PERM + e, mask=edge, other=0)
    return e


@triton.jit
def _features(EF, eo, edge, of, nf, ACC: tl.constexpr):
    """The features ``EF[eo, :nf]`` of caller's edge ids ``eo`` ``[BLOCK_M, BLOCK_N]``: ``[BLOCK_M, BLOCK_N, BLOCK_F]``."""
    ptr = EF + eo[:, :, None] * nf + of[None, None, :]
    return tl.load(ptr, mask=edge[:, :, None] & (of < nf)[None, None, :], other=0.0).to(ACC)


@triton.jit
def _tanh(x):
    """``tanh(x)`` from one exponential (``tl`` has none of its own): -1 and 1 at the ends, no overflow to NaN.

    Below ``|x| = 0.1`` its odd Taylor polynomial to ``x^13`` (the next term is ``1.5e-17 x`` there):
    ``1 - 2 / (exp(2x) + 1)`` cancels to an absolute error of about eps there, which a large cap
    ``c`` multiplies back (the capped score ``c tanh(s / c)`` was off by ``c * eps``: uniform
    attention at ``c = 1e10`` in float32, at ``c = 1e30`` in float64). The coefficients are Python
    floats, made constants of ``x``'s type by Triton: no float64 arithmetic in a float32 kernel.
    """
    x2 = x * x
    poly = x2 * (21844.0 / 6081075.0) - 1382.0 / 155925.0
    poly = poly * x2 + 62.0 / 2835.0
    poly = poly * x2 - 17.0 / 315.0
    poly = poly * x2 + 2.0 / 15.0
    poly = poly * x2 - 1.0 / 3.0
    small = x + x * x2 * poly
    return tl.where(tl.abs(x) < 0.1, small, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def _scores(x, ys, scale, cap, BIAS, e, h, s_be, s_bh, edge, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
            ACC: tl.constexpr):
    """``(s, t)``: ``s = c * tanh(scale * <x_r, ys_rc> / c) + bias_e`` per edge slot (the cap only with
    ``SOFTCAP``), ``-inf`` on empty slots; ``t`` the tanh, whose ``1 - t^2`` the backward needs."""
    s = tl.sum(x[:, None, :] * ys, axis=2) * scale
    t = s  # not used without a cap
    if SOFTCAP:
        t = _tanh(s / cap)
        s = cap * t
    if HAS_BIAS:
        s += tl.load(BIAS + e * s_be + h * s_bh, mask=edge, other=0.0).to(ACC)
    return tl.where(edge, s, float("-inf")), t


@triton.jit(do_not_specialize=["seed"])
def forward_kernel(
    Q, K, V, BIAS, SINK, OUT, LSE, W, ROWPTR, SRC, ORDER,
    n_q, heads, dk, dv, scale: tl.float64, cap: tl.float64, p_drop, inv_keep: tl.float64, seed,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_on, s_oh, s_be, s_bh,
    KF, EF, EPERM, SE, nf, s_fn, s_fh,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, WEIGHTS: tl.constexpr, SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    KEY_FEATURES: tl.constexpr = False, VALUE_FEATURES: tl.constexpr = False, PERMUTED: tl.constexpr = False,
    BLOCK_F: tl.constexpr = 1,
):
    """``OUT [n_q, H, dv]``, ``LSE [H, n_q]`` (``+inf`` for rows without a finite score), ``W [E, H]``.

    With ``SINKS`` the logit ``SINK[h]`` joins each row's softmax without a value (it enters the
    log-sum-exp, so the weights of the edges sum to less than 1). Edge features ``EF [E, F]`` (the
    caller's order, read through ``EPERM``): with ``KEY_FEATURES`` the scores gain
    ``scale * <KF_i, EF_ij>`` (``KF [n_q, H, F]``), with ``VALUE_FEATURES`` ``SE [n_q, H, F]`` gets
    ``sum_j a_ij EF_ij``."""
    h = tl.program_id(1)
    # The float arguments arrive as float64 (their annotations): a bare Python float reaches a
    # compiled kernel as float32, which put float64 results 1e-8 off on an H100. Compute in ACC.
    scale, cap, inv_keep = tl.full([], scale, ACC), tl.full([], cap, ACC), tl.full([], inv_keep, ACC)
    rows, live, start, end = _block(ORDER, ROWPTR, n_q, BLOCK_M)
    od, ov, on = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = _rows(Q, rows, h, s_qn, s_qh, live, od, dk, ACC)  # [BM, BDK]
    of = tl.arange(0, BLOCK_F)
    if KEY_FEATURES:
        kf = _rows(KF, rows, h, s_fn, s_fh, live, of, nf, ACC)  # [BM, BF]
    acc_f = tl.zeros([BLOCK_M, BLOCK_F], ACC)  # sum_j p_ij e_ij
    m = tl.full([BLOCK_M], float("-inf"), ACC)  # running max
    l = tl.zeros([BLOCK_M], ACC)  # running sum of exp(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    longest = tl.max(end - start, axis=0)
    for t in range(0, longest, BLOCK_N):
        e = start[:, None] + t + on[None, :]  # [BM, BN] edge ids
        edge = e < end[:, None]
        j = tl.load(SRC + e, mask=edge, other=0)
        s, _ = _scores(q, _gather(K, j, h, s_kn, s_kh, edge, od, dk, ACC), scale, cap, BIAS, e, h, s_be, s_bh, edge,
                       HAS_BIAS, SOFTCAP, ACC)
        if KEY_FEATURES or VALUE_FEATURES:
            ef = _features(EF, _callers(EPERM, e, edge, PERMUTED), edge, of, nf, ACC)  # [BM, BN, BF]
        if KEY_FEATURES:  # 0 on empty slots: their -inf stays
            s += tl.sum(kf[:, None, :] * ef, axis=2) * scale
        m_new = tl.maximum(m, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows without a finite score yet
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])  # [BM, BN]
        l = l * alpha + tl.sum(p, axis=1)
        if DROPOUT:
            p = tl.where(_keep(seed, e, h, heads, p_drop), p * inv_keep, 0.0)
        vs = _gather(V, j, h, s_vn, s_vh, edge, ov, dv, ACC)  # [BM, BN, BDV]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vs, axis=1)
        if VALUE_FEATURES:
            acc_f = acc_f * alpha[:, None] + tl.sum(p[:, :, None] * ef, axis=1)
        m = m_new
    if SINKS:  # one more logit, without a value: rescale as for a chunk of one slot
        sink = tl.load(SINK + h).to(ACC)
        m_new = tl.maximum(m, sink)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        l = l * alpha + tl.exp(sink - shift)
        acc = acc * alpha[:, None]
        acc_f = acc_f * alpha[:, None]
        m = m_new
    dead = l == 0.0  # no edge, or every score -inf (NaN rows stay NaN)
    out = tl.where(dead[:, None], 0.0, acc / tl.where(dead, 1.0, l)[:, None])
    lse = tl.where(dead, float("inf"), m + tl.log(tl.where(dead, 1.0, l)))
    tl.store(OUT + rows[:, None] * s_on + h * s_oh + ov[None, :], out.to(OUT.dtype.element_ty),
             mask=live[:, None] & (ov < dv)[None, :])
    if VALUE_FEATURES:
        summed = tl.where(dead[:, None], 0.0, acc_f / tl.where(dead, 1.0, l)[:, None])
        tl.store(SE + rows[:, None] * (heads * nf) + h * nf + of[None, :], summed.to(SE.dtype.element_ty),
                 mask=live[:, None] & (of < nf)[None, :])
    tl.store(LSE + h * n_q + rows, lse.to(LSE.dtype.element_ty), mask=live)
    if WEIGHTS:  # a second pass: the weights need the row's final log-sum-exp
        for t in range(0, longest, BLOCK_N):
            e = start[:, None] + t + on[None, :]
            edge = e < end[:, None]
            j = tl.load(SRC + e, mask=edge, other=0)
            s, _ = _scores(q, _gather(K, j, h, s_kn, s_kh, edge, od, dk, ACC), scale, cap, BIAS, e, h, s_be, s_bh,
                           edge, HAS_BIAS, SOFTCAP, ACC)
            if KEY_FEATURES:
                ef = _features(EF, _callers(EPERM, e, edge, PERMUTED), edge, of, nf, ACC)
                s += tl.sum(kf[:, None, :] * ef, axis=2) * scale
            tl.store(W + e * heads + h, tl.exp(s - lse[:, None]).to(W.dtype.element_ty), mask=edge)


@triton.jit(do_not_specialize=["seed"])
def dq_kernel(
    Q, K, V, BIAS, DO, LSE, DELTA, GW, DQ, DB, ROWPTR, SRC, ORDER,
    n_q, heads, dk, dv, scale: tl.float64, cap: tl.float64, p_drop, inv_keep: tl.float64, seed,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_don, s_doh, s_be, s_bh,
    KF, EF, EPERM, G, DKF, DEH, nf, s_fn, s_fh, s_gn, s_gh,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, HAS_GW: tl.constexpr, BIAS_GRAD: tl.constexpr,
    SOFTCAP: tl.constexpr, ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    KEY_FEATURES: tl.constexpr = False, VALUE_FEATURES: tl.constexpr = False, PERMUTED: tl.constexpr = False,
    BLOCK_F: tl.constexpr = 1,
):
    """``DQ [n_q, H, dk]`` (contiguous) and, with ``BIAS_GRAD``, the score gradients ``DB [E, H]``.

    With edge features (see :func:`forward_kernel`; ``G [n_q, H, F]`` the gradient of ``SE``):
    ``DKF [n_q, H, F]`` (contiguous), the key features' gradient ``scale * sum_j ds_ij e_ij``, and
    ``DEH [E, H, F]`` (the caller's order), each head's share of the features' gradient
    ``scale * ds_ij KF_i + a_ij G_i``."""
    h = tl.program_id(1)
    # float64 arguments (see forward_kernel), converted to ACC
    scale, cap, inv_keep = tl.full([], scale, ACC), tl.full([], cap, ACC), tl.full([], inv_keep, ACC)
    rows, live, start, end = _block(ORDER, ROWPTR, n_q, BLOCK_M)
    od, ov, on = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    q = _rows(Q, rows, h, s_qn, s_qh, live, od, dk, ACC)  # [BM, BDK]
    do = _rows(DO, rows, h, s_don, s_doh, live, ov, dv, ACC)  # [BM, BDV]
    lse = tl.load(LSE + h * n_q + rows, mask=live, other=float("inf")).to(ACC)
    delta = tl.load(DELTA + h * n_q + rows, mask=live, other=0.0).to(ACC)
    dq = tl.zeros([BLOCK_M, BLOCK_DK], ACC)
    of = tl.arange(0, BLOCK_F)
    fmask = (of < nf)[None, None, :]
    if KEY_FEATURES:
        kf = _rows(KF, rows, h, s_fn, s_fh, live, of, nf, ACC)  # [BM, BF]
    if VALUE_FEATURES:
        g = _rows(G, rows, h, s_gn, s_gh, live, of, nf, ACC)  # [BM, BF]
    dkf = tl.zeros([BLOCK_M, BLOCK_F], ACC)
    for t in range(0, tl.max(end - start, axis=0), BLOCK_N):
        e = start[:, None] + t + on[None, :]  # [BM, BN]
        edge = e < end[:, None]
        j = tl.load(SRC + e, mask=edge, other=0)
        ks = _gather(K, j, h, s_kn, s_kh, edge, od, dk, ACC)  # [BM, BN, BDK]
        s, t = _scores(q, ks, scale, cap, BIAS, e, h, s_be, s_bh, edge, HAS_BIAS, SOFTCAP, ACC)
        if KEY_FEATURES or VALUE_FEATURES:
            eo = _callers(EPERM, e, edge, PERMUTED)
            ef = _features(EF, eo, edge, of, nf, ACC)  # [BM, BN, BF]
        if KEY_FEATURES:
            s += tl.sum(kf[:, None, :] * ef, axis=2) * scale
        p = tl.exp(s - lse[:, None])
        dp = tl.sum(do[:, None, :] * _gather(V, j, h, s_vn, s_vh, edge, ov, dv, ACC), axis=2)
        if VALUE_FEATURES:  # the value term's share: <dO_i, W e_ij> = <G_i, e_ij>
            dp += tl.sum(g[:, None, :] * ef, axis=2)
        used = p  # the weights as applied to the values
        if DROPOUT:
            keep = _keep(seed, e, h, heads, p_drop)
            dp = tl.where(keep, dp * inv_keep, 0.0)
            used = tl.where(keep, p * inv_keep, 0.0)
        if HAS_GW:
            dp += tl.load(GW + e * heads + h, mask=edge, other=0.0).to(ACC)
        ds = tl.where(edge, p * (dp - delta[:, None]), 0.0)  # d score (the bias's gradient)
        if BIAS_GRAD:
            tl.store(DB + e * heads + h, ds, mask=edge)
        if KEY_FEATURES or VALUE_FEATURES:  # the features' share of this head, before the cap (added after it)
            de = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_F], ACC)
            if KEY_FEATURES:
                dkf += tl.sum(ds[:, :, None] * ef, axis=1)
                de += (ds * scale)[:, :, None] * kf[:, None, :]
            if VALUE_FEATURES:
                de += used[:, :, None] * g[:, None, :]
            tl.store(DEH + eo[:, :, None] * (heads * nf) + h * nf + of[None, None, :], de.to(DEH.dtype.element_ty),
                     mask=edge[:, :, None] & fmask)
        if SOFTCAP:  # through the cap: d(c tanh(x / c)) / dx = 1 - tanh^2
            ds = ds * (1.0 - t * t)
        dq += tl.sum(ds[:, :, None] * ks, axis=1)
    tl.store(DQ + rows[:, None] * (heads * dk) + h * dk + od[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=live[:, None] & (od < dk)[None, :])
    if KEY_FEATURES:
        tl.store(DKF + rows[:, None] * (heads * nf) + h * nf + of[None, :], (dkf * scale).to(DKF.dtype.element_ty),
                 mask=live[:, None] & (of < nf)[None, :])


@triton.jit(do_not_specialize=["seed"])
def dkdv_kernel(
    Q, K, V, BIAS, DO, LSE, DELTA, GW, DK, DV, COLPTR, ROW_T, PERM_T, ORDER,
    n_k, n_q, heads, dk, dv, scale: tl.float64, cap: tl.float64, p_drop, inv_keep: tl.float64, seed,
    s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_don, s_doh, s_be, s_bh,
    KF, EF, EPERM, G, nf, s_fn, s_fh, s_gn, s_gh,
    HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr, HAS_GW: tl.constexpr, SOFTCAP: tl.constexpr,
    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
    KEY_FEATURES: tl.constexpr = False, VALUE_FEATURES: tl.constexpr = False, PERMUTED: tl.constexpr = False,
    BLOCK_F: tl.constexpr = 1,
):
    """``DK [n_k, H, dk]`` and ``DV [n_k, H, dv]`` (contiguous) over key rows of the transposed pattern
    (edge features as in :func:`dq_kernel`: they change the scores and the weights' gradients)."""
    h = tl.program_id(1)
    # float64 arguments (see forward_kernel), converted to ACC
    scale, cap, inv_keep = tl.full([], scale, ACC), tl.full([], cap, ACC), tl.full([], inv_keep, ACC)
    cols, live, start, end = _block(ORDER, COLPTR, n_k, BLOCK_M)
    od, ov, on = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_N)
    k = _rows(K, cols, h, s_kn, s_kh, live, od, dk, ACC)  # [BM, BDK]
    v = _rows(V, cols, h, s_vn, s_vh, live, ov, dv, ACC)  # [BM, BDV]
    dkey = tl.zeros([BLOCK_M, BLOCK_DK], ACC)
    dval = tl.zeros([BLOCK_M, BLOCK_DV], ACC)
    of = tl.arange(0, BLOCK_F)
    for t in range(0, tl.max(end - start, axis=0), BLOCK_N):
        slot = start[:, None] + t + on[None, :]  # [BM, BN] positions in the transposed pattern
        edge = slot < end[:, None]
        i = tl.load(ROW_T + slot, mask=edge, other=0)  # queries
        e = tl.load(PERM_T + slot, mask=edge, other=0)  # edge ids
        qs = _gather(Q, i, h, s_qn, s_qh, edge, od, dk, ACC)  # [BM, BN, BDK]
        lse = tl.load(LSE + h * n_q + i, mask=edge, other=0.0).to(ACC)
        s, t = _scores(k, qs, scale, cap, BIAS, e, h, s_be, s_bh, edge, HAS_BIAS, SOFTCAP, ACC)
        if KEY_FEATURES or VALUE_FEATURES:
            ef = _features(EF, _callers(EPERM, e, edge, PERMUTED), edge, of, nf, ACC)  # [BM, BN, BF]
        if KEY_FEATURES:
            s += tl.sum(_gather(KF, i, h, s_fn, s_fh, edge, of, nf, ACC) * ef, axis=2) * scale
        p = tl.exp(s - lse)
        dos = _gather(DO, i, h, s_don, s_doh, edge, ov, dv, ACC)  # [BM, BN, BDV]
        dp = tl.sum(v[:, None, :] * dos, axis=2)
        if VALUE_FEATURES:
            dp += tl.sum(_gather(G, i, h, s_gn, s_gh, edge, of, nf, ACC) * ef, axis=2)
        used = p
        if DROPOUT:
            keep = _keep(seed, e, h, heads, p_drop)
            used = tl.where(keep, p * inv_keep, 0.0)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        if HAS_GW:
            dp += tl.load(GW + e * heads + h, mask=edge, other=0.0).to(ACC)
        delta = tl.load(DELTA + h * n_q + i, mask=edge, other=0.0).to(ACC)
        ds = tl.where(edge, p * (dp - delta), 0.0)
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dval += tl.sum(used[:, :, None] * dos, axis=1)
        dkey += tl.sum(ds[:, :, None] * qs, axis=1)
    mask = live[:, None]
    tl.store(DK + cols[:, None] * (heads * dk) + h * dk + od[None, :], (dkey * scale).to(DK.dtype.element_ty),
             mask=mask & (od < dk)[None, :])
    tl.store(DV + cols[:, None] * (heads * dv) + h * dv + ov[None, :], dval.to(DV.dtype.element_ty),
             mask=mask & (ov < dv)[None, :])


@triton.jit(do_not_specialize=["seed"])
def keep_kernel(KEEP, num, heads, p_drop, seed, BLOCK: tl.constexpr):
    """``KEEP [E * H]``: the dropout mask the attention kernels draw (tests build oracles from it)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = offs < num
    tl.store(KEEP + offs, _keep(seed, offs // heads, offs % heads, heads, p_drop).to(tl.int8), mask=live)


class Launch(NamedTuple):
    """One kernel launch, ``kernel[grid](*args, **meta)``: the launchers below build it, and
    :mod:`tgattn.engine.triton.aot` compiles the very same arguments for GPUs that are not here."""

    kernel: object
    grid: Tuple[int, ...]
    args: tuple
    meta: dict

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.meta)


# ptxas's own cap on registers: without it, ptxas spills a few values (4-16 bytes at 96-168
# registers, in 7 of the 98 heaviest configurations) to fit more blocks per SM; with it, none
# spills and each still keeps at least 8 warps per SM (tgattn.engine.triton.aot).
MAX_REGISTERS = 255
# Warps a program: two from head dim 64 up, not Triton's default four. On an H100 (torch 2.11,
# triton 3.6) the same blocks at d = 64 ran window-64 / random-1 % attention 2.1-2.5x faster in
# bfloat16 and 1.3-1.6x in float32, forward and backward (data/gpu/h100.md, blocks.md), and
# compile without spills for sm_80 / sm_90; at d = 16 / 32 two warps spill 4-156 bytes with
# every option on (not measured on a GPU there).
def num_warps(block_d: int) -> int:
    return 2 if block_d >= 64 else 4


def _meta(q, v, blocks) -> dict:
    block_m, block_n = blocks
    block_d = triton.next_power_of_2(max(q.shape[2], v.shape[2]))
    return dict(
        ACC=tl.float64 if q.dtype == torch.float64 else tl.float32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_DK=triton.next_power_of_2(q.shape[2]),
        BLOCK_DV=triton.next_power_of_2(v.shape[2]),
        maxnreg=MAX_REGISTERS,
        num_warps=num_warps(block_d),
    )


class EdgeFeatures(NamedTuple):
    """The edge features the kernels take: ``features [E, F]`` (contiguous, the caller's order), ``perm``
    (sorted edge -> the caller's, or None when the edges came sorted), the key term's ``key [n_q, H, F]``
    (``W_h^T q_i``) or None, whether to sum the value term (``sums``), and in the backward ``grad_sums``,
    the gradient of those sums ``[n_q, H, F]`` (``W_h^T dO_i``) or None."""

    features: torch.Tensor
    perm: Optional[torch.Tensor]
    key: Optional[torch.Tensor]
    sums: bool
    grad_sums: Optional[torch.Tensor] = None


# float64 with as many features as head channels from d = 128: four warps, not two. At two the forward kernel
# spilled 0.9-3 KB for sm_80 / sm_90 (F = d = 128, with and without other options); at four none does.
WIDE_FEATURES = 256


def _feature_args(edge: Optional[EdgeFeatures], q, backward: bool = False):
    """``(pointers, ints, constants)``: the kernels' edge-feature arguments (placeholders without ``edge``);
    the backward's take ``G`` after ``EPERM`` and its strides last."""
    if edge is None:
        pointers, nf, key, grad = (q, q, q), 0, None, None
        flags = {}
    else:
        key, grad = edge.key, edge.grad_sums
        pointers = (q if key is None else key, edge.features, q if edge.perm is None else edge.perm)
        nf = edge.features.shape[1]
        flags = dict(KEY_FEATURES=key is not None, VALUE_FEATURES=edge.sums, PERMUTED=edge.perm is not None,
                     BLOCK_F=triton.next_power_of_2(nf))
        if q.dtype == torch.float64 and triton.next_power_of_2(q.shape[2]) + flags["BLOCK_F"] >= WIDE_FEATURES:
            flags["num_warps"] = 4
    strides = (0, 0) if key is None else (key.stride(0), key.stride(1))
    if backward:
        pointers += (q if grad is None else grad,)
        strides += (0, 0) if grad is None else (grad.stride(0), grad.stride(1))
    return pointers, (nf, *strides), flags


def _strides(q, k, v, bias):
    bias_strides = (0, 0) if bias is None else (bias.stride(0), bias.stride(1) if bias.shape[1] > 1 else 0)
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)) + bias_strides


def forward_launch(q, k, v, bias, rowptr, src, order, scale, p_drop, seed, weights, blocks, softcap=None, sinks=None,
                   edge: Optional[EdgeFeatures] = None):
    """The :func:`forward_kernel` launch and its outputs ``(out [n_q, H, dv], lse [H, n_q], weights [E, H] or empty,
    the value term's sums [n_q, H, F] or None)``.

    ``q, k, v`` have unit stride in their last dim; ``bias`` is ``[E, 1 or H]`` or ``None``;
    ``blocks = (BLOCK_M, BLOCK_N)``; ``softcap`` a float or ``None``; ``sinks`` ``[H]`` or ``None``;
    ``edge`` the edge features or ``None``.
    """
    n_q, heads, dk = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty(n_q, heads, v.shape[2])
    lse = torch.empty(heads, n_q, dtype=acc, device=q.device)
    w = q.new_empty(src.numel() if weights else 0, heads)
    sums = q.new_empty(n_q, heads, edge.features.shape[1]) if edge is not None and edge.sums else None
    strides = _strides(q, k, v, bias)
    pointers, ints, flags = _feature_args(edge, q)
    launch = Launch(forward_kernel, (triton.cdiv(n_q, blocks[0]), heads), (
        q, k, v, q if bias is None else bias, lse if sinks is None else sinks, out, lse, w, rowptr, src, order,
        n_q, heads, dk, v.shape[2], scale, 1.0 if softcap is None else softcap, p_drop, 1.0 / (1.0 - p_drop), seed,
        *strides[:6], out.stride(0), out.stride(1), *strides[6:], *pointers, q if sums is None else sums, *ints,
    ), dict(HAS_BIAS=bias is not None, DROPOUT=p_drop > 0, WEIGHTS=weights, SOFTCAP=softcap is not None,
            SINKS=sinks is not None, **{**_meta(q, v, blocks), **flags}))
    return launch, (out, lse, w, sums)


def forward(q, k, v, bias, rowptr, src, order, scale, p_drop, seed, weights, blocks, softcap=None, sinks=None,
            edge=None):
    """Launch :func:`forward_kernel`: ``(out [n_q, H, dv], lse [H, n_q], weights [E, H] or empty, sums or None)``."""
    launch, outputs = forward_launch(q, k, v, bias, rowptr, src, order, scale, p_drop, seed, weights, blocks,
                                     softcap, sinks, edge)
    launch()
    return outputs


def backward_launches(q, k, v, bias, grad_out, lse, delta, grad_w, rows, cols, scale, p_drop, seed, bias_grad, blocks,
                      softcap=None, edge: Optional[EdgeFeatures] = None):
    """The :func:`dq_kernel` and :func:`dkdv_kernel` launches and their outputs
    ``(dq, dk, dv, d_scores [E, H] or None, d_key [n_q, H, F] or None, d_features [E, H, F] or None)``;
    ``d_scores`` are the gradients of the capped scores, ``d_key`` of ``edge.key`` (q's dtype), ``d_features``
    each head's share of the features' gradient (the accumulator's dtype, the caller's edge order).

    ``rows = (rowptr, src, order)`` and ``cols = (colptr, row_t, perm_t, order)`` are the two
    CSR walks; ``delta [H, n_q]`` holds ``<dO_i, O_i>`` (plus the returned weights' share).
    """
    n_q, heads, dk = q.shape
    n_k, dv = k.shape[0], v.shape[2]
    common = (scale, 1.0 if softcap is None else softcap, p_drop, 1.0 / (1.0 - p_drop), seed)
    strides = _strides(q, k, v, bias)
    strides = strides[:6] + (grad_out.stride(0), grad_out.stride(1)) + strides[6:]
    pointers, ints, features = _feature_args(edge, q, backward=True)
    flags = dict(HAS_BIAS=bias is not None, DROPOUT=p_drop > 0, HAS_GW=grad_w is not None, SOFTCAP=softcap is not None,
                 **{**_meta(q, v, blocks), **features})
    b = q if bias is None else bias
    gw = lse if grad_w is None else grad_w
    dq = q.new_empty(n_q, heads, dk)
    d_scores = torch.empty(rows[1].numel(), heads, dtype=lse.dtype, device=q.device) if bias_grad else None
    dkey, dval = k.new_empty(n_k, heads, dk), v.new_empty(n_k, heads, dv)
    d_key = q.new_empty(n_q, heads, ints[0]) if edge is not None and edge.key is not None else None
    d_features = torch.empty(rows[1].numel(), heads, ints[0], dtype=lse.dtype, device=q.device) \
        if edge is not None else None
    launches = (
        Launch(dq_kernel, (triton.cdiv(n_q, blocks[0]), heads), (
            q, k, v, b, grad_out, lse, delta, gw, dq, lse if d_scores is None else d_scores, *rows,
            n_q, heads, dk, dv, *common, *strides, *pointers, q if d_key is None else d_key,
            lse if d_features is None else d_features, *ints,
        ), dict(BIAS_GRAD=bias_grad, **flags)),
        Launch(dkdv_kernel, (triton.cdiv(n_k, blocks[0]), heads), (
            q, k, v, b, grad_out, lse, delta, gw, dkey, dval, *cols,
            n_k, n_q, heads, dk, dv, *common, *strides, *pointers, *ints,
        ), flags),
    )
    return launches, (dq, dkey, dval, d_scores, d_key, d_features)


def backward(q, k, v, bias, grad_out, lse, delta, grad_w, rows, cols, scale, p_drop, seed, bias_grad, blocks,
             softcap=None, edge=None):
    """Launch :func:`dq_kernel` and :func:`dkdv_kernel`: see :func:`backward_launches`."""
    launches, outputs = backward_launches(
        q, k, v, bias, grad_out, lse, delta, grad_w, rows, cols, scale, p_drop, seed, bias_grad, blocks, softcap, edge
    )
    for launch in launches:
        launch()
    return outputs


KEEP_BLOCK = 256  # mask entries per keep_kernel program


def keep_launch(num_edges, heads, p_drop, seed, device):
    """The :func:`keep_kernel` launch and its output ``KEEP [E * H]`` (int8)."""
    out = torch.empty(num_edges * heads, dtype=torch.int8, device=device)
    grid = (triton.cdiv(out.numel(), KEEP_BLOCK),)
    return Launch(keep_kernel, grid, (out, out.numel(), heads, p_drop, seed), dict(BLOCK=KEEP_BLOCK)), out


def keep(num_edges, heads, p_drop, seed, device):
    """The dropout mask ``[E, H]`` (True = kept) that the kernels draw for this seed."""
    launch, out = keep_launch(num_edges, heads, p_drop, seed, device)
    launch()
    return out.view(num_edges, heads).bool()
