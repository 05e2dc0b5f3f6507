// The forward's kernels: a row's scores, softmax and weighted sum of values in one visit of the row
// (attend_rows, attend_rows8), over (head, row block) tasks (forward_heads). Included by forward.cpp,
// which instantiates forward_heads for every input dtype.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <limits>

#include "heads.h"
#include "ops.h"
#include "rows.h"
#include "terms.h"
#include "vec.h"

namespace tgattn_fused {
namespace {

// The forward of rows i0 .. i0 + m - 1 (m <= 8), each of 1 to 8 edges (float): the rows are
// the eight lanes of a vector and their edges are visited slot by slot (the t-th edge of every
// row at once; a row past its last edge repeats it, masked out). The softmax then needs no
// horizontal reductions, and the eight rows' chains of dependent steps (dot products, max, exp,
// sum, log, weighted sum) run side by side: one row at a time, at 3-4 edges a row (molecule
// batches), the forward waited on those chains. S: float, float16 or bfloat16 rows.
template <typename S, bool LOGITS, bool EDGE>
inline void attend_rows8(int64_t i0, int64_t m, int64_t r1, RowPtr ptr, const int64_t* col, const S* q,
                         int64_t qs, const S* k, int64_t ks, int64_t d, const float* bias, int64_t bias_stride,
                         float scale, float* lse, S* w, const S* v, int64_t vs, int64_t dv, S* out,
                         int64_t os, const Dropout& drop, int64_t h, const Logits<float>& lg,
                         const EdgeTerms<S>& et) {
  typedef int32_t ivec_t __attribute__((vector_size(32)));
  int64_t first[8], deg[8], most = 0, at[9];
  for (int r = 0; r <= m; ++r) at[r] = ptr[i0 + r];
  const S* qr[8];
  for (int r = 0; r < 8; ++r) {
    const int64_t l = std::min<int64_t>(r, m - 1), i = i0 + l;
    first[r] = at[l], deg[r] = at[l + 1] - at[l], qr[r] = q + i * qs;
    most = std::max(most, deg[r]);
    if (i + 8 < r1) fetch(q + (i + 8) * qs, d * sizeof(S)), fetch<1>(out + (i + 8) * os, dv * sizeof(S));
  }
  ivec_t degs;
  for (int r = 0; r < 8; ++r) degs[r] = int32_t(deg[r]);
  const vec_t<float> neg_inf = vec_t<float>{} - std::numeric_limits<float>::infinity();
  vec_t<float> s[8], mx = neg_inf, sum = {};
  for (int64_t t = 0; t < most; ++t) {
    const S* kr[8];
    for (int r = 0; r < 8; ++r) kr[r] = k + col[first[r] + std::min(t, deg[r] - 1)] * ks;
    float x[8], b[8] = {};
    dots8(Pointers<const S>{qr}, kr, d, x);
    vec_t<float> xv = load(x);
    if constexpr (EDGE)
      if (et.qe) {
        const float* a[8];
        const S* e[8];
        for (int r = 0; r < 8; ++r)
          a[r] = et.qe + (i0 + std::min<int64_t>(r, m - 1)) * et.rs, e[r] = et.feat[first[r] + std::min(t, deg[r] - 1)];
        xv += edge_dots8(a, e, et.feat.F);
      }
    if (bias)
      for (int r = 0; r < 8; ++r) b[r] = bias[(first[r] + std::min(t, deg[r] - 1)) * bias_stride];
    const vec_t<float> st = LOGITS && lg.cap ? madd(tanh8(xv * lg.k), vec_t<float>{} + lg.cap, load(b))
                                             : madd(xv, vec_t<float>{} + scale, load(b));
    s[t] = (ivec_t{} + int32_t(t)) < degs ? st : neg_inf;
    mx = s[t] > mx ? s[t] : mx;
  }
  const vec_t<float> sink = vec_t<float>{} + (lg.has_sink ? lg.sink : -std::numeric_limits<float>::infinity());
  if (LOGITS && lg.has_sink) mx = sink > mx ? sink : mx;
  // A -inf score (padding, or a -inf bias) weighs exactly 0; a row whose scores are all -inf
  // keeps lse = -inf and a zero output, as in the general path.
  for (int64_t t = 0; t < most; ++t) {
    s[t] = s[t] > neg_inf ? exp_nonpositive(s[t] - mx) : vec_t<float>{};
    sum += s[t];
  }
  if (LOGITS && lg.has_sink) sum += sink > neg_inf ? exp_nonpositive(sink - mx) : vec_t<float>{};
  for (int r = 0; r < m; ++r) lse[i0 + r] = mx[r] + std::log(sum[r]);
  const vec_t<float> inv = sum > 0.0f ? 1.0f / sum : vec_t<float>{};
  for (int64_t t = 0; t < most; ++t) {
    s[t] *= inv;
    if (w)
      for (int r = 0; r < m; ++r)
        if (t < deg[r]) w[first[r] + t] = S(s[t][r]);
    if (drop.on()) {
      int64_t e[8];
      for (int r = 0; r < 8; ++r) e[r] = first[r] + t;
      s[t] *= drop.factors8(h, e);
    }
  }
  for (int r = 0; r < m; ++r) {
    float coef[8];
    const S* vr[8];
    for (int64_t t = 0; t < most; ++t) coef[t] = s[t][r], vr[t] = v + col[first[r] + std::min(t, deg[r] - 1)] * vs;
    accumulate(out + (i0 + r) * os, coef, Pointers<const S>{vr}, most, dv, /*fresh=*/true);
    if constexpr (EDGE)
      if (et.sums) {
        const S* e[8];
        for (int64_t t = 0; t < deg[r]; ++t) e[t] = et.feat[first[r] + t];
        edge_sums(et.sums + (i0 + r) * et.rs, coef, [&](int64_t t) { return e[t]; }, deg[r], et.feat.F);
      }
  }
}

// Forward of one head: w_e = softmax over row i of (<q_i, k_j> * scale + bias_e), and
// out_i = sum_e w_e v_j (w_e times the dropout factor under dropout), in one visit of each row.
// Saves the row's log-sum-exp (lse_i = -inf when no score is finite) and, when w is given,
// the weights. Edges with a -inf bias are skipped before their dot product, so a top-k pattern
// (a per-head -inf mask over the union of the heads' edges) pays only for the edges each head keeps.
// Out of line, as GCC compiled it before row pointers could be int32: inlined into the forward's
// loop (as it was then) its sums fused other multiply-adds (outputs an ulp off) and rows of 0-2
// edges ran about 1.1x slower.
// q, k, v, out and w are S (T, or float16 / bfloat16 computed in T = float); bias and lse are T.
template <typename S, bool LOGITS, bool EDGE, typename T = compute_t<S>>
__attribute__((noinline))
void attend_rows(int64_t r0, int64_t r1, RowPtr ptr, const int64_t* col, const S* q, int64_t qs, const S* k,
                 int64_t ks, int64_t d, const T* bias, int64_t bias_stride, T scale, T* lse, S* w, const S* v,
                 int64_t vs, int64_t dv, S* out, int64_t os, const Dropout& drop, int64_t h, Entries<T, int64_t>& re,
                 const Logits<T>& lg, const EdgeTerms<S>& et) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t i = r0; i < r1; ++i) {
    if (i + 1 < r1) fetch(q + (i + 1) * qs, d * sizeof(S)), fetch<1>(out + (i + 1) * os, dv * sizeof(S));
    if constexpr (std::is_same_v<T, float>) {
      const int64_t m = std::min<int64_t>(8, r1 - i);
      if (short_group(ptr, i, m)) {
        attend_rows8<S, LOGITS, EDGE>(i, m, r1, ptr, col, q, qs, k, ks, d, bias, bias_stride, scale, lse, w, v, vs, dv,
                                      out, os, drop, h, lg, et);
        i += m - 1;
        continue;
      }
    }
    lse[i] = neg_inf;
    const int64_t n = re.gather(ptr, col, i, [&](int64_t e) {
      return !(bias && bias[e * bias_stride] == neg_inf);  // a -inf edge keeps weight 0
    });
    T* x = re.x.data();
    dots(q + i * qs, Rows<const S>{k, re.index, ks}, n, d, x);
    if constexpr (EDGE)
      if (et.qe)
        for (int64_t r = 0; r < n; ++r) x[r] += edge_dot<T>(et.qe + i * et.rs, et.feat[re.position(r)], et.feat.F);
    T row_max = neg_inf;
    if (LOGITS && lg.cap) {
      tanh_scaled(x, n, lg.k);
      for (int64_t r = 0; r < n; ++r)
        row_max = std::max(row_max, x[r] = madd(x[r], lg.cap, bias ? bias[re.position(r) * bias_stride] : T(0)));
    } else if (bias) {
      for (int64_t r = 0; r < n; ++r)
        row_max = std::max(row_max, x[r] = madd(x[r], scale, bias[re.position(r) * bias_stride]));
    } else {
      row_max = scale_max(x, n, scale);
    }
    if (LOGITS && lg.has_sink) row_max = std::max(row_max, lg.sink);
    if (row_max == neg_inf) {  // no finite score (or no edge): every weight stays 0
      std::memset(out + i * os, 0, dv * sizeof(S));  // out comes uninitialised
      continue;
    }
    T sum = exp_shifted(x, n, row_max);
    if (LOGITS && lg.has_sink) sum += std::exp(lg.sink - row_max);
    lse[i] = row_max + std::log(sum);
    const T inv_sum = T(1) / sum;
    for (int64_t r = 0; r < n; ++r) x[r] *= inv_sum;
    if (w)
      for (int64_t r = 0; r < n; ++r) w[re.position(r)] = S(x[r]);
    if (drop.on())
      for (int64_t r = 0; r < n; ++r) x[r] *= drop.factor<T>(h, re.position(r));
    accumulate(out + i * os, x, Rows<const S>{v, re.index, vs}, n, dv, /*fresh=*/true);
    if constexpr (EDGE)
      if (et.sums) {
        edge_sums(et.sums + i * et.rs, x, [&](int64_t r) { return et.feat[re.position(r)]; }, n, et.feat.F);
      }
  }
}

}  // namespace

template <typename scalar_t>
void forward_heads(const ForwardCall& c) {
  const at::Tensor &q = c.q, &k = c.k, &v = c.v, &b = c.b, &sk = c.sk, &qe = c.qe, &feat = c.feat;
  const at::Tensor &out = c.out, &lse = c.lse, &w = c.w, &sums = c.sums;
  const RowPtr ptr = c.ptr;
  const int64_t *cp = c.cp, *fperm = c.fperm;
  const int64_t H = c.H, n_q = c.n_q, n_k = c.n_k, dk = c.dk, dv = c.dv, E = c.E, F = c.F;
  const double scale = c.scale, dropout_p = c.dropout_p, softcap = c.softcap;
  const int64_t seed = c.seed;
  const bool weights = c.weights, edge_sums = c.edge_sums;
  using T = compute_t<scalar_t>;
  const int64_t bias_heads = b.defined() ? b.size(1) : 0;
  const Dropout drop{dropout_p, uint64_t(seed)};
  struct Scratch {
    Slab<scalar_t> k, v;
    Entries<T, int64_t> re;
  };
  const RowBlocks rb = forward_blocks(ptr, cp, n_q, n_k);
  const int64_t runs = same_head_blocks(H, int64_t(rb.keys.size()));
  for_head_blocks<Scratch>(rb.bounds, ptr, H, [&](Scratch& sc, int64_t h, int64_t blk, int64_t r0, int64_t r1) {
    const T* bh = b.defined() ? b.data_ptr<T>() + (bias_heads == 1 ? 0 : h) : nullptr;
    const auto [lo, hi] = rb.keys[blk];
    if (in_place((ptr[r1] - ptr[r0]) * runs, hi - lo, std::max(k.stride(0), v.stride(0)) * int64_t(sizeof(scalar_t))))
      sc.k.view(k, h), sc.v.view(v, h);  // few edges among many keys: no copy
    else
      sc.k.hold(k, h, lo, hi), sc.v.hold(v, h, lo, hi);
    const Logits<T> lg = logits<T>(softcap, scale, sk, h);
    EdgeTerms<scalar_t> et;
    if (feat.defined()) {
      et.feat = {feat.data_ptr<scalar_t>(), fperm, F}, et.rs = H * F;
      if (qe.defined()) et.qe = qe.data_ptr<T>() + h * F;
      if (edge_sums) et.sums = sums.data_ptr<T>() + h * F;
    }
    // Instances without the cap and sink code, as the kernel was before them: with it, float32 rows
    // with a bias ran 1.04-1.06x slower (short rows, random 1 %); likewise without the edge terms' code.
    const bool cap_or_sink = lg.cap || lg.has_sink;
    const auto rows = feat.defined() ? (cap_or_sink ? attend_rows<scalar_t, true, true> : attend_rows<scalar_t, false, true>)
                                     : (cap_or_sink ? attend_rows<scalar_t, true, false> : attend_rows<scalar_t, false, false>);
    rows(r0, r1, ptr, cp, head<scalar_t>(q, h), q.stride(0), sc.k.rows, sc.k.stride, dk, bh, bias_heads,
         static_cast<T>(scale), lse.data_ptr<T>() + h * n_q, weights ? w.data_ptr<scalar_t>() + h * E : nullptr,
         sc.v.rows, sc.v.stride, dv, head<scalar_t>(out, h), out.stride(0), drop, h, sc.re, lg, et);
  });
}

}  // namespace tgattn_fused
