// The backward's kernels, in the order of FlashAttention-2's backward (Dao, 2023): the deltas, a pass
// over each key's edges (key_pass, key_pass8) for dk, dv and dq or the score gradients, the query pass
// for dq (query_rows), and the edge terms' gradients (edge_grads). Included by backward.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "heads.h"
#include "ops.h"
#include "rows.h"
#include "terms.h"
#include "vec.h"

namespace tgattn_fused {
namespace {

// Everything of one head the backward pass reads or writes; per-node rows are `stride` apart.
// The inputs, dk, dv and the weights' gradient are S (the input dtype); the log-sum-exp, deltas,
// bias, its gradient and the dq sums (added to by many keys) are T.
template <typename S, typename T = compute_t<S>>
struct HeadGrad {
  const S *q, *k, *v, *go;
  const T *lse, *delta, *bias;
  const S* gw;
  int64_t qs, ks, vs, gs, bias_stride, dk, dv;
  T* dq;
  S *dkey, *dval;
  T* ds;
  int64_t dqs, dks, dvs;
  // Edge terms (EdgeTerms): qe and the gradient of the value sums s of this head ([n_q, H, F], rows
  // ers apart), each or null, and the features [E, F]. The key pass adds <qe_i, e_ij> to the score
  // and <ds_i, e_ij> to dp_ij (s_i is a weighted sum like o_i) and writes, for the key term, the
  // scaled score gradient (as: scale ds_e, no cap) and, for the value term, each edge's weight as
  // applied (pw: p_e times the dropout factor); the features' and qe's gradients are summed from them
  // afterwards (edge_grads). Both in the order of the key pass (indexed by the position in
  // colptr / row_t, not by edge): a key's edges are consecutive there, so a group of keys writes one
  // run of positions, where by edge every weight was a scattered store (0.1 ms of the molecule
  // backward's 0.3 ms of edge terms went to those).
  const T *qe = nullptr, *gsum = nullptr;
  FeatureRows<S> feat;
  T *as = nullptr, *pw = nullptr;
  int64_t ers = 0;
  // With a query pass for dq (query_rows; dq null): the scaled score gradient of each edge (the
  // coefficient of k_j in dq_i), written by edge [E] instead of added into dq rows here.
  T* ad = nullptr;
};

// The backward of keys j0 .. j0 + m - 1 (m <= 8), each of 1 to 8 edges, without weight
// gradients (float): key_pass with the keys as the lanes of a vector and their
// edges visited slot by slot, as attend_rows8 does for query rows. A key past its last edge
// repeats it with weight 0 (its dq row gets 0 * k, which the dispatcher keeps finite; with a
// query pass, g.ad, only a key's own edges are written).
template <typename S, typename I, bool LOGITS, bool EDGE, bool AD>
void key_pass8(int64_t j0, int64_t m, int64_t c1, RowPtr colptr, const I* row_t, const I* perm_t,
               const HeadGrad<S>& g, float scale, const Dropout& drop, int64_t h, const Logits<float>& lg) {
  typedef int32_t ivec_t __attribute__((vector_size(32)));
  int64_t first[8], deg[8], most = 0, at[9];
  for (int r = 0; r <= m; ++r) at[r] = colptr[j0 + r];
  const S *kr[8], *vr[8];
  for (int r = 0; r < 8; ++r) {
    const int64_t l = std::min<int64_t>(r, m - 1), j = j0 + l;
    first[r] = at[l], deg[r] = at[l + 1] - at[l], kr[r] = g.k + j * g.ks, vr[r] = g.v + j * g.vs;
    most = std::max(most, deg[r]);
    if (j + 8 < c1) {  // the next group's rows (a head's rows are strided: see fetch)
      fetch(g.k + (j + 8) * g.ks, g.dk * sizeof(S)), fetch(g.v + (j + 8) * g.vs, g.dv * sizeof(S));
      fetch<1>(g.dkey + (j + 8) * g.dks, g.dk * sizeof(S)), fetch<1>(g.dval + (j + 8) * g.dvs, g.dv * sizeof(S));
    }
  }
  ivec_t degs;
  for (int r = 0; r < 8; ++r) degs[r] = int32_t(deg[r]);
  vec_t<float> p[8], a[8];
  int64_t rows[8][8];  // rows[t][r]: the query of slot t of key r
  for (int64_t t = 0; t < most; ++t) {
    const S *qr[8], *gr[8];
    float lse[8], delta[8], b[8] = {};
    int64_t edge[8];
    for (int r = 0; r < 8; ++r) {
      const int64_t pos = first[r] + std::min(t, deg[r] - 1), i = row_t[pos];
      rows[t][r] = i, qr[r] = g.q + i * g.qs, gr[r] = g.go + i * g.gs, lse[r] = g.lse[i], delta[r] = g.delta[i];
      edge[r] = perm_t ? int64_t(perm_t[pos]) : pos;
      if (g.bias) b[r] = g.bias[edge[r] * g.bias_stride];
    }
    float x[8], y[8];
    dots8(Pointers<const S>{kr}, qr, g.dk, x);
    dots8(Pointers<const S>{vr}, gr, g.dv, y);
    vec_t<float> xv = load(x), yv = load(y);
    if constexpr (EDGE) {
      const float* a[8];
      const S* e[8];
      for (int r = 0; r < 8; ++r) e[r] = g.feat[edge[r]];
      bool done = false;
      if constexpr (std::is_same_v<S, float>) {
        if (g.feat.F == 4) {  // bond features of molecule models: transposed in registers
          vec_t<float> et[4];
          transpose8x4(e, et);
          if (g.qe) {
            for (int r = 0; r < 8; ++r) a[r] = g.qe + rows[t][r] * g.ers;
            xv += edge_dots8_t4(a, et);
          }
          if (g.gsum) {
            for (int r = 0; r < 8; ++r) a[r] = g.gsum + rows[t][r] * g.ers;
            yv += edge_dots8_t4(a, et);
          }
          done = true;
        }
      }
      if (!done && g.qe) {
        for (int r = 0; r < 8; ++r) a[r] = g.qe + rows[t][r] * g.ers;
        xv += edge_dots8(a, e, g.feat.F);
      }
      if (!done && g.gsum) {
        for (int r = 0; r < 8; ++r) a[r] = g.gsum + rows[t][r] * g.ers;
        yv += edge_dots8(a, e, g.feat.F);
      }
    }
    // Padding and -inf-biased edges weigh 0 (their lse may be -inf too: -inf - -inf is NaN).
    const vec_t<float> bv = load(b), fv = drop.on() ? drop.factors8(h, edge) : vec_t<float>{} + 1.0f;
    const auto live = ((ivec_t{} + int32_t(t)) < degs) & (bv > -std::numeric_limits<float>::infinity());
    // Through the cap, d(cap tanh(u / cap)) / du = 1 - tanh^2.
    const vec_t<float> th = LOGITS && lg.cap ? tanh8(xv * lg.k) : vec_t<float>{};
    const vec_t<float> st = LOGITS && lg.cap ? madd(th, vec_t<float>{} + lg.cap, bv)
                                             : madd(xv, vec_t<float>{} + scale, bv);
    const vec_t<float> e = exp_nonpositive(st - load(lse));
    const vec_t<float> pt = live ? e : vec_t<float>{};
    const vec_t<float> ds = pt * (yv * fv - load(delta));
    if (g.ds)
      for (int r = 0; r < m; ++r)
        if (t < deg[r]) g.ds[edge[r]] = ds[r];
    a[t] = LOGITS && lg.cap ? ds * (1.0f - th * th) * scale : ds * scale;
    p[t] = pt * fv;
    if constexpr (AD)
      for (int r = 0; r < m; ++r)
        if (t < deg[r]) g.ad[edge[r]] = a[t][r];
  }
  for (int r = 0; r < m; ++r) {
    const int64_t j = j0 + r;
    float ac[8], pc[8];
    const S *qr[8], *gr[8];
    float* dq[8];
    for (int64_t t = 0; t < most; ++t) {
      const int64_t i = rows[t][r];
      ac[t] = a[t][r], pc[t] = p[t][r];
      qr[t] = g.q + i * g.qs, gr[t] = g.go + i * g.gs;
      if constexpr (!AD) dq[t] = g.dq + i * g.dqs;
    }
    accumulate_pointers(g.dkey + j * g.dks, ac, qr, most, g.dk);
    accumulate_pointers(g.dval + j * g.dvs, pc, gr, most, g.dv);
    if constexpr (!AD) scatter(Pointers<float>{dq}, ac, kr[r], most, g.dk);
    if constexpr (EDGE) {  // key r's edges are positions first[r] .. first[r] + deg[r] - 1
      if (g.as) std::copy(ac, ac + deg[r], g.as + first[r]);
      if (g.pw) std::copy(pc, pc + deg[r], g.pw + first[r]);
    }
  }
}

// Backward of one head over keys c0 .. c1, in the order of FlashAttention-2's backward (Dao,
// 2023): the outer loop runs over keys, the inner over each key's queries (the transposed
// pattern colptr / row_t; perm_t maps a position to its edge, needed only for a bias, dropout
// or weight gradients). Each weight is recomputed from q, k and the saved log-sum-exp,
// p_e = exp(s_e - lse_i), never read from memory; then with dp_e = <dO_i, v_j> (times the
// dropout factor) (+ gw_e, the gradient that reached returned weights) and
// delta_i = sum_e p_e dp_e (computed before, per row):
//   ds_e = p_e (dp_e - delta_i),  dk_j += scale sum ds_e q_i,  dv_j += sum p_e dO_i,
//   dq_i += scale ds_e k_j.
// The thread owns dk_j and dv_j; dq rows are shared between keys, so the caller gives each
// key block that may run at the same time as another block of the same head its own dq, or
// (g.dq null, g.ad set) the key pass writes each edge's scale ds_e and a pass over query rows
// sums dq afterwards (query_rows).
// A float16 / bfloat16 dk_j, dv_j of more than GROUP queries is summed in float (`sums`) and
// rounded once at the end, not after each group.
constexpr int64_t GROUP = 16;

// AD: the query pass's variant (g.ad written, g.dq null; float16 / bfloat16), instantiated apart: with
// the choice a branch on g.ad, float32's key pass with the scatter ran 1.04-1.18x slower (random /
// top-k 1 %).
// groups: whether keys of few edges go by eight (key_pass8); key_pass_heads passes false for the single
// keys it has not grouped.
template <typename S, typename I, bool EDGE, bool AD, typename T = compute_t<S>>
void key_pass(int64_t c0, int64_t c1, RowPtr colptr, const I* row_t, const I* perm_t, const HeadGrad<S>& g,
              T scale, const Dropout& drop, int64_t h, Entries<T, I>& ce, std::vector<T>& a, std::vector<T>& sums,
              const Logits<T>& lg, bool groups) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const auto edge = [&](int64_t t) -> int64_t { return perm_t ? int64_t(perm_t[t]) : t; };
  if constexpr (is_half_v<S>) sums.resize(g.dk + g.dv);
  for (int64_t j = c0; j < c1; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      const int64_t m = std::min<int64_t>(8, c1 - j);
      if (groups && !g.gw && short_group(colptr, j, m)) {
        if (lg.cap)  // a sink changes nothing here: it is in the lse
          key_pass8<S, I, true, EDGE, AD>(j, m, c1, colptr, row_t, perm_t, g, scale, drop, h, lg);
        else
          key_pass8<S, I, false, EDGE, AD>(j, m, c1, colptr, row_t, perm_t, g, scale, drop, h, lg);
        j += m - 1;
        continue;
      }
    }
    if (j + 1 < c1) {
      fetch(g.k + (j + 1) * g.ks, g.dk * sizeof(S)), fetch(g.v + (j + 1) * g.vs, g.dv * sizeof(S));
      fetch<1>(g.dkey + (j + 1) * g.dks, g.dk * sizeof(S)), fetch<1>(g.dval + (j + 1) * g.dvs, g.dv * sizeof(S));
    }
    const int64_t n = ce.gather(colptr, row_t, j, [&](int64_t t) {
      return !(g.bias && g.bias[edge(t) * g.bias_stride] == neg_inf);
    });
    if (n == 0) {  // dk and dv come uninitialised; the first group writes them otherwise
      std::memset(g.dkey + j * g.dks, 0, g.dk * sizeof(S));
      std::memset(g.dval + j * g.dvs, 0, g.dv * sizeof(S));
    }
    T *p = ce.x.data(), *dp = ce.y.data();
    a.resize(n);
    const S* kj = g.k + j * g.ks;
    // A group of GROUP queries at a time: their q, dO and dq rows are read for the dot
    // products and again for the sums while they are in L1 (a key of a window of 64 has 129
    // queries: 100 KB of rows, which would be read from L2 twice).
    for (int64_t g0 = 0; g0 < n; g0 += GROUP) {
      const int64_t m = std::min<int64_t>(GROUP, n - g0);
      const I* rows = ce.index + g0;
      T *pg = p + g0, *dpg = dp + g0, *ag = a.data() + g0;
      dots(kj, Rows<const S, I>{g.q, rows, g.qs}, m, g.dk, pg);
      if constexpr (EDGE)
        if (g.qe)
          for (int64_t r = 0; r < m; ++r)
            pg[r] += edge_dot<T>(g.qe + rows[r] * g.ers, g.feat[edge(ce.position(g0 + r))], g.feat.F);
      if (lg.cap) {  // ag holds each tanh until its 1 - tanh^2 is used below
        std::copy(pg, pg + m, ag);
        tanh_scaled(ag, m, lg.k);
        for (int64_t r = 0; r < m; ++r) {
          const T b = g.bias ? g.bias[edge(ce.position(g0 + r)) * g.bias_stride] : T(0);
          pg[r] = madd(ag[r], lg.cap, b) - g.lse[rows[r]];
        }
      } else {
        for (int64_t r = 0; r < m; ++r) {
          const T b = g.bias ? g.bias[edge(ce.position(g0 + r)) * g.bias_stride] : T(0);
          pg[r] = madd(pg[r], scale, b) - g.lse[rows[r]];  // the forward's score (see hsum)
        }
      }
      exp_shifted(pg, m, T(0));
      dots(g.v + j * g.vs, Rows<const S, I>{g.go, rows, g.gs}, m, g.dv, dpg);
      if constexpr (EDGE)
        if (g.gsum)
          for (int64_t r = 0; r < m; ++r)
            dpg[r] += edge_dot<T>(g.gsum + rows[r] * g.ers, g.feat[edge(ce.position(g0 + r))], g.feat.F);
      if (lg.cap) {
        for (int64_t r = 0; r < m; ++r) {
          T f = 1, ds;
          if (drop.on() || g.gw || g.ds) {
            const int64_t e = edge(ce.position(g0 + r));
            f = drop.factor<T>(h, e);
            ds = pg[r] * (dpg[r] * f + (g.gw ? T(g.gw[e]) : T(0)) - g.delta[rows[r]]);
            if (g.ds) g.ds[e] = ds;
          } else {
            ds = pg[r] * (dpg[r] - g.delta[rows[r]]);
          }
          ag[r] = ds * (T(1) - ag[r] * ag[r]) * scale;
          pg[r] *= f;
        }
      } else {
        for (int64_t r = 0; r < m; ++r) {
          T f = 1;
          if (drop.on() || g.gw || g.ds) {
            const int64_t e = edge(ce.position(g0 + r));
            f = drop.factor<T>(h, e);
            const T ds = pg[r] * (dpg[r] * f + (g.gw ? T(g.gw[e]) : T(0)) - g.delta[rows[r]]);
            if (g.ds) g.ds[e] = ds;
            ag[r] = ds * scale;
          } else {
            ag[r] = pg[r] * (dpg[r] - g.delta[rows[r]]) * scale;
          }
          pg[r] *= f;
        }
      }
      if constexpr (EDGE) {  // by position (see HeadGrad)
        if (g.as)
          for (int64_t r = 0; r < m; ++r) g.as[ce.position(g0 + r)] = ag[r];
        if (g.pw)
          for (int64_t r = 0; r < m; ++r) g.pw[ce.position(g0 + r)] = pg[r];
      }
      if constexpr (is_half_v<S>) {
        const Rows<const S, I> qrows{g.q, rows, g.qs}, gorows{g.go, rows, g.gs};
        if (n > GROUP) {
          accumulate(sums.data(), ag, qrows, m, g.dk, g0 == 0);
          accumulate(sums.data() + g.dk, pg, gorows, m, g.dv, g0 == 0);
        } else {  // one group: the sums are rounded as they are stored
          accumulate(g.dkey + j * g.dks, ag, qrows, m, g.dk, true);
          accumulate(g.dval + j * g.dvs, pg, gorows, m, g.dv, true);
        }
      } else {
        accumulate(g.dkey + j * g.dks, ag, Rows<const T, I>{g.q, rows, g.qs}, m, g.dk, g0 == 0);
        accumulate(g.dval + j * g.dvs, pg, Rows<const T, I>{g.go, rows, g.gs}, m, g.dv, g0 == 0);
      }
      if constexpr (AD)
        for (int64_t r = 0; r < m; ++r) g.ad[edge(ce.position(g0 + r))] = ag[r];
      else
        scatter(Rows<T, I>{g.dq, rows, g.dqs}, ag, kj, m, g.dk);
    }
    if constexpr (is_half_v<S>)
      if (n > GROUP) convert(g.dkey + j * g.dks, sums.data(), g.dk), convert(g.dval + j * g.dvs, sums.data() + g.dk, g.dv);
  }
}

// key_pass of heads h0 .. h1 (g[h - h0] each) over keys c0 .. c1, the heads taken in turn for each group of
// keys rather than one head over all keys: the rows of a node's heads are adjacent in the caller's layout
// ([N, H, d]), so the rows a group reads and writes for one head share pages and neighbouring lines with
// those of the next, read while still in cache (H = 4, d = 16: a head's row is 64 bytes of a node's 256).
// The groups and each head's arithmetic are key_pass's, so the results are bit for bit those of one head
// at a time. dq rows are summed in place (g.dq, no query pass).
template <typename S, typename I, bool EDGE, typename T = compute_t<S>>
void key_pass_heads(int64_t c0, int64_t c1, RowPtr colptr, const I* row_t, const I* perm_t, const HeadGrad<S>* g,
                    int64_t h0, int64_t h1, T scale, const Dropout& drop, Entries<T, I>& ce, std::vector<T>& a,
                    std::vector<T>& sums, const Logits<T>* lg) {
  for (int64_t j = c0; j < c1;) {
    if constexpr (std::is_same_v<T, float>) {
      const int64_t m = std::min<int64_t>(8, c1 - j);
      if (!g[0].gw && short_group(colptr, j, m)) {
        for (int64_t h = h0; h < h1; ++h)
          (lg[h - h0].cap ? key_pass8<S, I, true, EDGE, false> : key_pass8<S, I, false, EDGE, false>)(
              j, m, c1, colptr, row_t, perm_t, g[h - h0], scale, drop, h, lg[h - h0]);
        j += m;
        continue;
      }
    }
    for (int64_t h = h0; h < h1; ++h)
      key_pass<S, I, EDGE, false>(j, j + 1, colptr, row_t, perm_t, g[h - h0], scale, drop, h, ce, a, sums, lg[h - h0],
                                  /*groups=*/false);
    ++j;
  }
}

// The query pass of one head over rows r0 .. r1: dq_i = sum_e ad_e k_col[e] over row i's edges, with
// ad [E] (by edge) the scaled score gradients the key pass wrote, summed in registers and written
// once, in the inputs' dtype (accumulate, as the forward sums its values): no float dq to clear,
// add into and round afterwards, and no dq copy per key block. k: the head's rows (a packed copy).
// In the order of the row's edges, the order in which a single key block's scatter added them.
template <typename S, typename T = compute_t<S>>
void query_rows(int64_t r0, int64_t r1, RowPtr ptr, const int64_t* col, const T* ad, const S* k, int64_t ks, int64_t d,
                S* dq, int64_t dqs) {
  for (int64_t i = r0; i < r1; ++i) {
    if (i + 1 < r1) fetch<1>(dq + (i + 1) * dqs, d * sizeof(S));
    const int64_t e0 = ptr[i];
    accumulate(dq + i * dqs, ad + e0, Rows<const S>{k, col + e0, ks}, ptr[i + 1] - e0, d, /*fresh=*/true);
  }
}

// delta_i = <dO_i, O_i> (+ sum_e w_e gw_e over row i when the returned weights got a gradient)
// (+ <ds_i, s_i> with the value sums of edge terms, gsum and sums rows F numbers long, rs apart):
// sum_e p_e dp_e of the backward, from the outputs instead of the edges (FlashAttention-2).
template <typename S, typename T = compute_t<S>>
void deltas(int64_t r0, int64_t r1, const S* go, int64_t gs, const S* out, int64_t os, int64_t dv, RowPtr ptr,
            const S* w, const S* gw, T* delta, const T* gsum, const T* sums, int64_t F, int64_t rs) {
  for (int64_t i = r0; i < r1; ++i) {
    if (i + AHEAD < r1) fetch(go + (i + AHEAD) * gs, dv * sizeof(S)), fetch(out + (i + AHEAD) * os, dv * sizeof(S));
    T s = 0;
    for (int64_t t = 0; t < dv; ++t) s += T(go[i * gs + t]) * T(out[i * os + t]);
    if (gw)
      for (int64_t e = ptr[i]; e < ptr[i + 1]; ++e) s += T(w[e]) * T(gw[e]);
    if (gsum) s += edge_dot<T>(gsum + i * rs, sums + i * rs, F);  // a chain of its own, added once
    delta[i] = s;
  }
}

// The gradients of the edge terms' inputs from what the key pass wrote per edge and head (the score
// gradient ds [H, E] and, for the value term, the weight as applied pw [H, E]), one pass over the
// rows with every head: dqe_i = scale sum_j ds_ij e_ij [n_q, H, F] (with qe), and per edge
// de_ij = sum_h (scale ds_ij qe_i + pw_ij gsum_i) [E, F] in the caller's edge order, each edge's row
// written once (no atomics).
// Rows r0 .. r1 of edge_grads; N > 0: F = N features, each edge's sums over heads in N registers
// (the loops over features unrolled and, through restrict pointers, nothing reloaded after a store);
// N = 0: any F. Each sum adds the heads in order, the key term's first (the same roundings either way).
template <int N, typename S, typename T, typename I>
void edge_grad_rows(int64_t r0, int64_t r1, RowPtr ptr, int64_t H, int64_t E, const FeatureRows<S>& feat,
                    const I* __restrict pos_of, const T* __restrict qe, const T* __restrict gsum, const T* __restrict as,
                    const T* __restrict pw, T* __restrict dqe, T* __restrict de) {
  const int64_t F = N ? N : feat.F;
  std::vector<T> a(N ? 0 : H), p(N ? 0 : H);
  for (int64_t i = r0; i < r1; ++i) {
    T* __restrict dq = dqe ? dqe + i * H * F : nullptr;
    const T* __restrict qi = qe ? qe + i * H * F : nullptr;
    const T* __restrict gi = gsum ? gsum + i * H * F : nullptr;
    if (dq) std::fill(dq, dq + H * F, T(0));
    for (int64_t e = ptr[i]; e < ptr[i + 1]; ++e) {
      const int64_t k = pos_of[e];  // the edge's position in the key pass
      const S* __restrict x = feat[e];
      T* __restrict g = de + feat(e) * F;
      if constexpr (N > 0) {
        T acc[N] = {}, xf[N];
#pragma GCC unroll 8
        for (int f = 0; f < N; ++f) xf[f] = T(x[f]);
        if (qi)
          for (int64_t h = 0; h < H; ++h) {
            const T ah = as[h * E + k];
#pragma GCC unroll 8
            for (int f = 0; f < N; ++f) acc[f] += ah * qi[h * N + f];
#pragma GCC unroll 8
            for (int f = 0; f < N; ++f) dq[h * N + f] += ah * xf[f];
          }
        if (gi)
          for (int64_t h = 0; h < H; ++h) {
            const T ph = pw[h * E + k];
#pragma GCC unroll 8
            for (int f = 0; f < N; ++f) acc[f] += ph * gi[h * N + f];
          }
#pragma GCC unroll 8
        for (int f = 0; f < N; ++f) g[f] = acc[f];
      } else {
        for (int64_t h = 0; h < H; ++h) a[h] = qi ? as[h * E + k] : T(0), p[h] = gi ? pw[h * E + k] : T(0);
        for (int64_t f = 0; f < F; ++f) {  // the sum over heads in a register (see edge_sums)
          T acc = 0;
          if (qi)
            for (int64_t h = 0; h < H; ++h) acc += a[h] * qi[h * F + f];
          if (gi)
            for (int64_t h = 0; h < H; ++h) acc += p[h] * gi[h * F + f];
          g[f] = acc;
          if (dq)
            for (int64_t h = 0; h < H; ++h) dq[h * F + f] += a[h] * T(x[f]);
        }
      }
    }
  }
}

// The gradients of the edge terms' inputs from what the key pass wrote per position and head (the
// scaled score gradient as [H, E] with qe, the weight as applied pw [H, E] with gsum, see HeadGrad),
// one pass over the rows with every head: dqe_i = sum_j as_ij e_ij [n_q, H, F] (with qe), and per edge
// de_ij = sum_h (as_ij qe_i + pw_ij gsum_i) [E, F] in the caller's edge order, each edge's row
// written once (no atomics). pos_of [E]: the position of each (sorted) edge in the key pass, the inverse
// of perm_t. Up to 8 features in loops of fixed length (edge_grad_rows): with a loop of F over loops
// of H, and every pointer possibly aliased by the stores, this pass took 0.2-0.3 ms of the molecule
// backward (6,848 edges, H = 4, F = 4), about 0.1 ms now.
template <typename S, typename I, typename T = compute_t<S>>
void edge_grads(RowPtr ptr, int64_t n_q, int64_t H, int64_t E, const FeatureRows<S>& feat, const I* pos_of, const T* qe,
                const T* gsum, const T* as, const T* pw, T* dqe, T* de) {
  at::parallel_for(0, n_q, 1024, [&](int64_t r0, int64_t r1) {
    switch (feat.F) {
#define TGATTN_EDGE_GRADS(n) \
  case n: return edge_grad_rows<n>(r0, r1, ptr, H, E, feat, pos_of, qe, gsum, as, pw, dqe, de);
      TGATTN_EDGE_GRADS(1) TGATTN_EDGE_GRADS(2) TGATTN_EDGE_GRADS(3) TGATTN_EDGE_GRADS(4)
      TGATTN_EDGE_GRADS(5) TGATTN_EDGE_GRADS(6) TGATTN_EDGE_GRADS(7) TGATTN_EDGE_GRADS(8)
#undef TGATTN_EDGE_GRADS
      default: return edge_grad_rows<0>(r0, r1, ptr, H, E, feat, pos_of, qe, gsum, as, pw, dqe, de);
    }
  });
}

}  // namespace
}  // namespace tgattn_fused
