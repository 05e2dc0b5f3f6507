// What enters a score besides the dot product: the soft cap and the sink (Logits), and the per-edge
// key and value terms (EdgeTerms), with the dot products of edge features in one rounding order.
#pragma once

#include <ATen/core/Tensor.h>

#include "vec.h"

namespace tgattn_fused {
namespace {

// Gemma 2's logit soft-capping and gpt-oss's attention sink, for one head: the score of an edge is
// cap * tanh(scale * <q_i, k_j> / cap) + bias_e (the cap on the scaled score, before the bias), and
// the logit `sink` joins each row's softmax without a value (it enters the log-sum-exp, so a row's
// weights sum to less than 1). The kernels branch on them outside their inner loops: without
// either, the code and its roundings are those of the kernels before.
template <typename T>
struct Logits {
  T cap = 0, k = 0;  // cap 0: no cap; k = scale / cap
  bool has_sink = false;
  T sink = 0;
};

// Per-edge key and value terms in factored form (TransformerConv's edge features, issue 30): edge
// e = (j, i) has features e_ij [F], shared by the heads, and head h maps them by W_h [d, F]. The
// key term enters the score as <q_i, W_h e_ij> = <qe_i, e_ij> with qe_i = W_h^T q_i (one matrix
// product outside), added to the dot product <q_i, k_j> before it is scaled; the value term is
// W_h s_i with s_i = sum_j a_ij e_ij (the weights as applied to v_j, after dropout), summed here and
// projected outside. No [E, H, d] and nothing per edge and head is formed in the forward.
// qe and s are [n_q, H, F] in the compute dtype (head h's row i at + i * rs), the features [E, F] in
// the inputs' dtype (float16 / bfloat16 widened as read) in the caller's edge order, read through the
// sort's permutation (a copy in sorted order and its gradient's scatter back cost more than the kernel's
// work on them, molecule batches).
template <typename S>
struct FeatureRows {
  const S* feat = nullptr;     // [E, F], the caller's order
  const int64_t* perm = nullptr;  // sorted edge e is the caller's perm[e] (null: the same order)
  int64_t F = 0;
  int64_t operator()(int64_t e) const { return perm ? perm[e] : e; }  // the caller's edge
  const S* operator[](int64_t e) const { return feat + (*this)(e) * F; }
};

template <typename S, typename T = compute_t<S>>
struct EdgeTerms {
  const T* qe = nullptr;   // the key term's W_h^T q_i of this head, or null
  FeatureRows<S> feat;     // the features e
  T* sums = nullptr;       // the value term's s_i of this head (zeroed before), or null
  int64_t rs = 0;          // the row stride of qe and sums (H * F)
};

// <a, e> over F features, in one rounding order wherever it is computed (a row's forward, the
// eight-lane paths, a key's backward), so that the backward recomputes each score bit for bit (see hsum).
template <typename T, int N, typename A, typename S>
__attribute__((always_inline)) inline T edge_dot_n(const A* a, const S* e, int64_t F) {
  T s = 0;
#pragma GCC unroll 8
  for (int64_t f = 0; f < (N ? N : F); ++f) s = madd(T(a[f]), T(e[f]), s);
  return s;
}

// Up to 8 features (bond features of molecule models) in a loop of fixed length the compiler unrolls:
// a loop of F iterations cost a compare and a branch per multiply-add. Inlined always: a call per
// edge (GCC kept it out of line) was 5 % of the molecule backward with edge terms.
template <typename T, typename A, typename S>
__attribute__((always_inline)) inline T edge_dot(const A* a, const S* e, int64_t F) {
  switch (F) {
    case 1: return edge_dot_n<T, 1>(a, e, F);
    case 2: return edge_dot_n<T, 2>(a, e, F);
    case 3: return edge_dot_n<T, 3>(a, e, F);
    case 4: return edge_dot_n<T, 4>(a, e, F);
    case 5: return edge_dot_n<T, 5>(a, e, F);
    case 6: return edge_dot_n<T, 6>(a, e, F);
    case 7: return edge_dot_n<T, 7>(a, e, F);
    case 8: return edge_dot_n<T, 8>(a, e, F);
    default: return edge_dot_n<T, 0>(a, e, F);
  }
}

// The eight lanes' edge_dot(a[r], e[r]) as one vector, assembled in registers: scalar sums added into
// an array that is then loaded as a vector stall the load (no store-to-load forwarding).
// The number of features is switched on once for the eight lanes.
template <int N, typename A, typename S>
__attribute__((always_inline)) inline vec_t<float> edge_dots8_n(const A* const* a, const S* const* e, int64_t F) {
  return vec_t<float>{edge_dot_n<float, N>(a[0], e[0], F), edge_dot_n<float, N>(a[1], e[1], F),
                      edge_dot_n<float, N>(a[2], e[2], F), edge_dot_n<float, N>(a[3], e[3], F),
                      edge_dot_n<float, N>(a[4], e[4], F), edge_dot_n<float, N>(a[5], e[5], F),
                      edge_dot_n<float, N>(a[6], e[6], F), edge_dot_n<float, N>(a[7], e[7], F)};
}

template <typename A, typename S>
__attribute__((always_inline)) inline vec_t<float> edge_dots8(const A* const* a, const S* const* e, int64_t F) {
  switch (F) {
    case 1: return edge_dots8_n<1>(a, e, F);
    case 2: return edge_dots8_n<2>(a, e, F);
    case 3: return edge_dots8_n<3>(a, e, F);
    case 4: return edge_dots8_n<4>(a, e, F);
    case 5: return edge_dots8_n<5>(a, e, F);
    case 6: return edge_dots8_n<6>(a, e, F);
    case 7: return edge_dots8_n<7>(a, e, F);
    case 8: return edge_dots8_n<8>(a, e, F);
    default: return edge_dots8_n<0>(a, e, F);
  }
}

// Eight float rows of 4 features, transposed in registers: x[f] holds feature f of rows 0 .. 7 (two
// 128-bit rows per vector, then the 4 x 4 transposes of both halves).
__attribute__((always_inline)) inline void transpose8x4(const float* const* p, vec_t<float>* x) {
  const auto pair = [&](int r) {
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p[r])), _mm_loadu_ps(p[r + 4]), 1);
  };
  const __m256 t0 = pair(0), t1 = pair(1), t2 = pair(2), t3 = pair(3);
  const __m256 u0 = _mm256_unpacklo_ps(t0, t1), u1 = _mm256_unpackhi_ps(t0, t1);
  const __m256 u2 = _mm256_unpacklo_ps(t2, t3), u3 = _mm256_unpackhi_ps(t2, t3);
  x[0] = _mm256_shuffle_ps(u0, u2, 0x44), x[1] = _mm256_shuffle_ps(u0, u2, 0xEE);
  x[2] = _mm256_shuffle_ps(u1, u3, 0x44), x[3] = _mm256_shuffle_ps(u1, u3, 0xEE);
}

// edge_dots8 of 4 float features with both sides transposed (transpose8x4): lane r's chain of
// multiply-adds is edge_dot_n's (bit for bit), four vector ones instead of 32 scalar ones.
__attribute__((always_inline)) inline vec_t<float> edge_dots8_t4(const float* const* a, const vec_t<float>* e) {
  vec_t<float> x[4];
  transpose8x4(a, x);
  vec_t<float> s{};
  for (int f = 0; f < 4; ++f) s = madd(x[f], e[f], s);
  return s;
}

// s[f] = sum_r c[r] e_r[f] for the features e_r = row(r) of n edges (the value term's sums of one
// row), each sum in a register (added to in memory, each edge's add waited for the previous one's store).
template <typename T, typename Row>
inline void edge_sums(T* s, const T* c, const Row& row, int64_t n, int64_t F) {
  for (int64_t f = 0; f < F; ++f) {
    T acc = 0;
    for (int64_t r = 0; r < n; ++r) acc = madd(c[r], T(row(r)[f]), acc);
    s[f] = acc;
  }
}

// The soft cap (0: none) and the sink of head h (sinks [H] or undefined).
template <typename T>
Logits<T> logits(double softcap, double scale, const at::Tensor& sinks, int64_t h) {
  Logits<T> lg;
  if (softcap > 0) lg.cap = T(softcap), lg.k = T(scale / softcap);
  if (sinks.defined()) lg.has_sink = true, lg.sink = sinks.data_ptr<T>()[h];
  return lg;
}

}  // namespace
}  // namespace tgattn_fused
