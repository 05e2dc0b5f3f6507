// Fused edge attention on the CPU: one pass over each query's CSR row forward, one pass over
// each key's edges backward.
//
// The CSR backend runs every step (scores, softmax, aggregation) as a separate PyTorch
// kernel over [E, H] tensors; here a thread walks a block of query rows of one head and,
// for each row, computes its edges' scores, softmax and weighted sum of values while the
// row's numbers are in registers and L1. Nothing of size [E, H, d] is ever formed, and, as in
// FlashAttention-2 (Dao, 2023), the forward saves only the log-sum-exp per query and head
// [H, n_q]: the backward recomputes each weight from q, k and it (the weights [H, E] are
// written only when the caller asks for them).
//
// Edges are sorted by (target, source): rowptr [n_q + 1], col [E] (the key of each edge).
// The backward walks the transposed pattern (colptr, row_t, perm_t), so each thread owns the
// rows of dk / dv it writes and, by heads, the dq rows it adds to: no atomics, deterministic results.
//
// Where the time goes (n = 4096, 5 % random edges, d = 64): reading each edge's key and
// value rows, 512 bytes per edge and head from all over K and V. The forward takes 1.1-1.3x
// the time of those reads alone (gather_rows below, the benchmark's floor peer); blocking the
// keys so that a block stays in L2 (128 to 4096 keys per block, measured) did not make the
// reads cheaper.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// 32-byte SIMD vectors through GCC / Clang vector extensions: explicit vectors keep the
// accumulators in registers (the auto-vectorizer spilled them) without tying the code to
// one instruction set; -march=native picks AVX2, AVX-512 halves or NEON pairs.
template <typename T>
struct Vec;
template <>
struct Vec<float> {
  typedef float type __attribute__((vector_size(32)));
  static constexpr int L = 8;
};
template <>
struct Vec<double> {
  typedef double type __attribute__((vector_size(32)));
  static constexpr int L = 4;
};
template <typename T>
using vec_t = typename Vec<T>::type;

template <typename T>
inline vec_t<T> load(const T* p) {
  vec_t<T> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename T>
inline void store(T* p, vec_t<T> v) {
  std::memcpy(p, &v, sizeof v);
}

// float16 / bfloat16 inputs are read where they are and computed in float: each load widens
// eight numbers in registers, each store of an output or gradient rounds eight to nearest even
// (as torch's .to() does), and sums, the log-sum-exp, a bias and its gradient stay float. Half
// the bytes of float32 cross the memory system; a float32 copy of q, k and v first (the engine
// before) moved three times as many.
template <typename S>
struct Compute {
  using type = S;
};
template <>
struct Compute<c10::Half> {
  using type = float;
};
template <>
struct Compute<c10::BFloat16> {
  using type = float;
};
template <typename S>
using compute_t = typename Compute<S>::type;
template <typename S>
constexpr bool is_half_v = !std::is_same_v<S, compute_t<S>>;

typedef uint16_t u16x8_t __attribute__((vector_size(16)));
typedef uint32_t u32x8_t __attribute__((vector_size(32)));
typedef int32_t i32x8_t __attribute__((vector_size(32)));

// bfloat16 is the top half of a float: widening is a shift, on every instruction set.
inline vec_t<float> load(const c10::BFloat16* p) {
#if defined(__AVX2__)
  // GCC widens the generic form below in two 128-bit halves (five instructions, not two).
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  u16x8_t x;
  std::memcpy(&x, p, sizeof x);
  const u32x8_t bits = __builtin_convertvector(x, u32x8_t) << 16;
  vec_t<float> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}

inline void store(c10::BFloat16* p, vec_t<float> v) {
  u32x8_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  u32x8_t r = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;  // to nearest, ties to even
  const i32x8_t nan = v != v;
  r = (r & ~u32x8_t(nan)) | (u32x8_t(nan) & 0x7fc0u);  // torch's quiet NaN, as c10::BFloat16 rounds it
  const u16x8_t x = __builtin_convertvector(r, u16x8_t);
  std::memcpy(p, &x, sizeof x);
}

// float16 through F16C's conversions where the CPU has them (-march=native defines __F16C__ on
// such a CPU; the build folder is keyed by the CPU's flags), else c10::Half's, one number at a time.
inline vec_t<float> load(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float x[8];
  for (int l = 0; l < 8; ++l) x[l] = float(p[l]);
  return load(x);
#endif
}

inline void store(c10::Half* p, vec_t<float> v) {
#if defined(__F16C__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
  for (int l = 0; l < 8; ++l) p[l] = c10::Half(v[l]);
#endif
}


// A score is recomputed in the backward (from q, k and the saved log-sum-exp) by other code than
// the forward's: a key's edges are grouped by eight where a row's were, and the dot products are
// inlined into other loops. It must still come out bit for bit the same: at scores near 1e4
// (float32) an ulp of a score is 1e-3 on its weight, and a backward weight off by that from the
// forward's no longer sums with the others to what the forward's output says (sum_e ds_e = 0
// failed by 1e-3 * |ds|, and dq by 2e-2 to 1e-1 where it is 5e-2, on keys sharing a common
// part). Hence one rounding sequence for every dot product and score, whichever path computes it:
//  * lane sums in hsum8's order, a pairwise tree ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))
//    (left to right, a row's last n % 8 dot products rounded otherwise than its groups of eight);
//  * multiply-adds fused explicitly (madd): under -ffp-contract=fast the compiler fused some
//    a * b + c and not others, by context (the backward's dot products were left unfused);
//  * score = madd(dot, scale, bias or 0) (scale_max's dot * scale is the same number), then minus
//    the log-sum-exp (dot * scale - lse in one multiply-add skipped the rounding of dot * scale
//    that the forward's score has).
template <typename T>
inline T hsum(vec_t<T> v) {
#if defined(__AVX__)
  // hsum8's instructions on one vector: a tree of array adds here made the backward's key pass
  // (random 1 %) 1.05-1.12x slower.
  if constexpr (std::is_same_v<T, float>) {
    const __m256 t = _mm256_hadd_ps(v, v), u = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  } else {
    const __m256d t = _mm256_hadd_pd(v, v);
    return _mm_cvtsd_f64(_mm_add_sd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1)));
  }
#else
  constexpr int L = Vec<T>::L;
  T x[L];
  for (int l = 0; l < L; ++l) x[l] = v[l];
  for (int w = 1; w < L; w *= 2)
    for (int l = 0; l < L; l += 2 * w) x[l] += x[l + w];
  return x[0];
#endif
}

// a * b + c rounded once on x86 CPUs with fused multiply-adds, whatever the context (see hsum).
// Elsewhere the compiler decides: without FMA always twice (consistent again), on other
// instruction sets with FMA (ARM) by context, where a recomputed score may be an ulp off.
#if defined(__FMA__) && defined(__AVX__)
inline vec_t<float> madd(vec_t<float> a, vec_t<float> b, vec_t<float> c) { return _mm256_fmadd_ps(a, b, c); }
inline vec_t<double> madd(vec_t<double> a, vec_t<double> b, vec_t<double> c) { return _mm256_fmadd_pd(a, b, c); }
inline float madd(float a, float b, float c) { return std::fma(a, b, c); }
inline double madd(double a, double b, double c) { return std::fma(a, b, c); }
#else
template <typename V>
inline V madd(V a, V b, V c) {
  return a * b + c;
}
#endif

// Stores the lane sums of acc[0..7] (one dot product each) into out[0..7]. On AVX a
// transpose-and-add tree does all eight in nine instructions instead of eight serial sums.
template <typename T>
inline void hsum8(const vec_t<T>* acc, T* out) {
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float>) {
    const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // 128-bit halves
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
    return;
  } else {
    for (int g = 0; g < 8; g += 4) {
      const __m256d t0 = _mm256_hadd_pd(acc[g], acc[g + 1]), t1 = _mm256_hadd_pd(acc[g + 2], acc[g + 3]);
      _mm256_storeu_pd(out + g, _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20), _mm256_permute2f128_pd(t0, t1, 0x31)));
    }
    return;
  }
#endif
  for (int k = 0; k < 8; ++k) out[k] = hsum<T>(acc[k]);
}

// exp of 8 floats (Cephes' expf: range reduction by ln 2 and a degree-6 polynomial, about
// 1 ulp), for arguments <= 0 as in a softmax; below -87 it returns exp(-87) ~ 1.6e-38 instead of
// a denormal. Scalar std::exp costs a call per edge. Inlined always (see exp_shifted).
__attribute__((always_inline)) inline vec_t<float> exp_nonpositive(vec_t<float> x) {
  typedef int32_t ivec_t __attribute__((vector_size(32)));
  x = x < -87.0f ? vec_t<float>{} - 87.0f : x;
  const vec_t<float> n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  const vec_t<float> r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vec_t<float> p = vec_t<float>{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec_t bits = (__builtin_convertvector(n, ivec_t) + 127) << 23;  // 2^n
  vec_t<float> two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// x[r] = exp(x[r] - shift) for r < n; returns the sum. Inlined always, as GCC did before the
// kernels had float16 / bfloat16 instances: with three callers computing in float it made a call
// of it per group of queries in the backward's key pass (float32 backward 1.02-1.05x slower) and
// of exp_nonpositive per row in the forward.
// On AVX-512 the tail's exponentials come from a masked load and store of x, not through a padded
// copy, whose vector load waited on the bytes just stored into it (a store that cannot be forwarded
// to a wider load); the row's sum, log and output waited on that. The same numbers bit for bit; the
// forward (with scale_max's masked tail) 1.01-1.03x faster in bfloat16 on random / top-k 1 % and
// window 64, float32 1.00-1.02x, both 1.04-1.05x with every row in L1 (one thread, n = 4096,
// H = 8, d = 64, against the copy in one process). The backward's key pass runs the same tail;
// its A/B did not stand out from that harness's noise (two identical builds differ by up to 8 %).
template <typename T>
__attribute__((always_inline)) inline T exp_shifted(T* x, int64_t n, T shift) {
  T sum = 0;
  int64_t r = 0;
  if constexpr (std::is_same_v<T, float>) {
    vec_t<float> acc = {};
    for (; r + 8 <= n; r += 8) {
      const vec_t<float> e = exp_nonpositive(load(x + r) - shift);
      store(x + r, e);
      acc += e;
    }
    if (r < n) {  // the tail through the vector exp too: short rows and columns are common
#if defined(__AVX512VL__)
      // lanes past n hold shift - 100 (as the copy's padding: arguments <= 0), neither stored nor summed
      const __mmask8 live = __mmask8((1u << (n - r)) - 1);
      const vec_t<float> e = exp_nonpositive(_mm256_mask_loadu_ps(vec_t<float>{} + (shift - 100.0f), live, x + r) - shift);
      _mm256_mask_storeu_ps(x + r, live, e);
      for (int64_t l = 0; l < n - r; ++l) sum += e[l];
#else
      float tail[8];
      std::fill(tail, tail + 8, shift - 100.0f);  // padding: exp(-87) ~ 1.6e-38 each, then dropped
      std::copy(x + r, x + n, tail);
      const vec_t<float> e = exp_nonpositive(load(tail) - shift);
      store(tail, e);
      for (int64_t l = 0; l < n - r; ++l) sum += (x[r + l] = tail[l]);
#endif
      r = n;
    }
    sum += hsum<float>(acc);
  }
  for (; r < n; ++r) sum += (x[r] = std::exp(x[r] - shift));
  return sum;
}

// tanh of 8 floats for logit soft-capping (Cephes' tanhf, about 2 ulp: an odd polynomial below
// 0.625, else 1 - 2 e / (1 + e) with e = exp(-2 |x|) through exp_nonpositive, which clamps at -87:
// 1 from |x| = 44 on, never NaN). Every multiply-add is fused explicitly and the function is
// elementwise, so a row's scores, a key's and eight lanes' come out bit for bit alike (see hsum).
__attribute__((always_inline)) inline vec_t<float> tanh8(vec_t<float> x) {
  const vec_t<float> a = x < 0.0f ? -x : x, z = x * x;
  vec_t<float> p = madd(vec_t<float>{} - 5.70498872745e-3f, z, vec_t<float>{} + 2.06390887954e-2f);
  p = madd(p, z, vec_t<float>{} - 5.37397155531e-2f);
  p = madd(p, z, vec_t<float>{} + 1.33314422036e-1f);
  p = madd(p, z, vec_t<float>{} - 3.33332819422e-1f);
  const vec_t<float> small = madd(p * z, x, x);
  const vec_t<float> e = exp_nonpositive(a * -2.0f);
  const vec_t<float> big = 1.0f - (e + e) / (1.0f + e);
  return a < 0.625f ? small : (x < 0.0f ? -big : big);
}

// x[r] = tanh(x[r] * k) for r < n (k = scale / cap): the soft cap's tanh of the scaled scores,
// eight at a time in float (a short tail padded with zeros), std::tanh in double.
template <typename T>
__attribute__((always_inline)) inline void tanh_scaled(T* x, int64_t n, T k) {
  int64_t r = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; r + 8 <= n; r += 8) store(x + r, tanh8(load(x + r) * k));
    if (r < n) {
      float tail[8] = {};
      std::copy(x + r, x + n, tail);
      store(tail, tanh8(load(tail) * k));
      std::copy(tail, tail + (n - r), x + r);
    }
  } else {
    for (; r < n; ++r) x[r] = std::tanh(x[r] * k);
  }
}

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

// Fetches the row of `bytes` bytes at p into the cache ahead of its use (for writing when
// WRITE). A head's rows in the caller's layout [N, H, d] are H * d numbers apart, a stride the
// hardware prefetchers of the 2-core AMD EPYC we measure on do not follow: walking them one
// after the other cost ~150 ns a row (the forward at n = 4096 ran 1.3-1.4x slower on such q
// than on packed rows), so the loops over consecutive rows ask for the next ones themselves.
constexpr int64_t AHEAD = 8;  // rows fetched ahead by copies of a head's rows

template <int WRITE = 0>
inline void fetch(const void* p, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(static_cast<const char*>(p) + c, WRITE, 3);
}

// The rows of a per-node tensor picked by index: rows[r] = base + idx[r] * stride.
template <typename T, typename I = int64_t>
struct Rows {
  T* base;
  const I* idx;
  int64_t stride;
  T* operator[](int64_t r) const { return base + int64_t(idx[r]) * stride; }
};

// The same row for every index: one x for all eight rows of dots8.
template <typename T>
struct Repeat {
  const T* p;
  const T* operator[](int64_t) const { return p; }
};

// The rows of an array of pointers, for dots8, accumulate and scatter.
template <typename T>
struct Pointers {
  T* const* p;
  T* operator[](int64_t r) const { return p[r]; }
};

// bfloat16 dot products on CPUs with AVX512-BF16 (AMD Zen 4, Intel Cooper Lake and later):
// vdpbf16ps multiplies 16 pairs exactly and adds them, two to a float32 lane, into 8 lanes in
// one instruction, where widening both rows and a multiply-add take six for 16. Every bfloat16
// dot product goes through it (dots8 and the single rows of dots alike, forward and backward), so
// the backward still recomputes each score bit for bit (see hsum). Like every instruction here it
// is chosen when the build is made: -march=native on the machine that loads the build (its folder
// is keyed by the CPU's flags), so the check is that of the compiler on this CPU.
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define TGATTN_BF16_DOT 1
inline vec_t<float> dot16(vec_t<float> acc, const c10::BFloat16* a, const c10::BFloat16* b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  return _mm256_dpbf16_ps(acc, (__m256bh)x, (__m256bh)y);
}
#else
#define TGATTN_BF16_DOT 0
#endif

// Weighted sums of float32 and bfloat16 rows in 512-bit registers (accumulate_chunk).
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define TGATTN_WIDE_SUMS 1
#else
#define TGATTN_WIDE_SUMS 0
#endif

// Which conversions this build compiled: the benchmark and the docs say which path ran.
std::string half_paths() {
  std::string paths = "float16: ";
#if defined(__F16C__)
  paths += "F16C conversions";
#else
  paths += "c10::Half conversions (no F16C)";
#endif
  paths += "; bfloat16: ";
#if TGATTN_BF16_DOT
  paths += "dot products AVX512-BF16 (vdpbf16ps), sums widened by shifts";
#else
  paths += "widened by shifts";
#endif
#if TGATTN_WIDE_SUMS
  paths += ", 32 numbers a 512-bit register";
#endif
  return paths;
}

// out[k] = <x[k], p[k]> for eight pairs of rows of length d (x a Repeat when all eight share one
// x, whose pieces are then loaded once): eight independent accumulators hide the latency of the
// multiply-adds, and one transposed sum (hsum8) finishes them.
template <typename T, typename S, typename X>
__attribute__((always_inline)) inline void dots8(const X& x, const S* const* p, int64_t d, T* out) {
  constexpr int L = Vec<T>::L, R = 8;
  const int64_t dl = d - d % L;
  vec_t<T> acc[R] = {};
#if TGATTN_BF16_DOT
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    const int64_t d16 = d - d % 16;
    for (int64_t t = 0; t < d16; t += 16) {
#pragma GCC unroll 8
      for (int k = 0; k < R; ++k) acc[k] = dot16(acc[k], x[k] + t, p[k] + t);
    }
    if (d16 < dl)
      for (int k = 0; k < R; ++k) acc[k] = madd(load(x[k] + d16), load(p[k] + d16), acc[k]);
  } else
#endif
    for (int64_t t = 0; t < dl; t += L) {
#pragma GCC unroll 8
      for (int k = 0; k < R; ++k) acc[k] = madd(load(x[k] + t), load(p[k] + t), acc[k]);
    }
  hsum8<T>(acc, out);
  for (int64_t t = dl; t < d; ++t)
    for (int k = 0; k < R; ++k) out[k] = madd(T(x[k][t]), T(p[k][t]), out[k]);
}

// out[r] = <x, rows[r]> for n rows, eight at a time (dots8), the last n % 8 one by one.
// No software prefetch here or in accumulate: prefetching the next group's rows made the
// forward 1.3-1.6x slower on the 2-core AMD EPYC we measure on (the loads of the current group
// already keep the memory system busy; the benchmark's floor peer shows how busy).
template <typename T, typename S, typename Rs>
inline void dots(const S* x, const Rs& rows, int64_t n, int64_t d, T* out) {
  constexpr int L = Vec<T>::L, R = 8;
  const int64_t dl = d - d % L;
  int64_t r = 0;
  for (; r + R <= n; r += R) {
    const S* p[R];
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k) p[k] = rows[r + k];
    dots8(Repeat<S>{x}, p, d, out + r);
  }
  for (; r < n; ++r) {
    const S* p = rows[r];
    vec_t<T> acc = {};
#if TGATTN_BF16_DOT
    if constexpr (std::is_same_v<S, c10::BFloat16>) {  // as dots8 forms each lane
      const int64_t d16 = d - d % 16;
      for (int64_t t = 0; t < d16; t += 16) acc = dot16(acc, x + t, p + t);
      if (d16 < dl) acc = madd(load(x + d16), load(p + d16), acc);
    } else
#endif
      for (int64_t t = 0; t < dl; t += L) acc = madd(load(x + t), load(p + t), acc);
    T s = hsum<T>(acc);
    for (int64_t t = dl; t < d; ++t) s = madd(T(x[t]), T(p[t]), s);
    out[r] = s;
  }
}

#if TGATTN_WIDE_SUMS
// y[0 : 16] as one 512-bit register and back (y float, or float16 / bfloat16 widened and rounded as
// 8-lane vectors are).
template <typename Y>
inline __m512 load16(const Y* y) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(load(y)), load(y + 8), 1);
}

template <typename Y>
inline void store16(Y* y, __m512 v) {
  store(y, vec_t<float>(_mm512_castps512_ps256(v)));
  store(y + 8, vec_t<float>(_mm512_extractf32x8_ps(v, 1)));
}
#endif

// y[0 : NV * L] += sum_r coef[r] * rows[r][offset : offset + NV * L], y held in registers
// (y = the sum when `fresh`: y is not read, so an output row needs no zeroing first). y and the
// rows may be float16 / bfloat16 (T float): widened on loading, y rounded once on storing.
template <typename T, int NV, typename Y, typename R>
inline void accumulate_chunk(Y* y, const T* coef, const R& rows, int64_t n, int64_t offset, bool fresh) {
  constexpr int L = Vec<T>::L;
  using Row = std::remove_cv_t<std::remove_pointer_t<decltype(rows[0])>>;
#if TGATTN_WIDE_SUMS
  // float32 and bfloat16 rows 512 bits a register where the build has AVX-512 (Zen 4, Intel since
  // Skylake-SP): half the instructions of the 256-bit forms below, each number's sum the same
  // multiply-adds in the same order, bit for bit. One thread, n = 4096, H = 8, d = 64, against the
  // 256-bit forms in one process, forward: bfloat16 1.08-1.11x faster on random and top-k 1 %,
  // 1.02-1.05x on window 64; float32 1.03-1.09x and 1.01-1.02x; the backward, whose sums run over
  // groups of 16 queries, unchanged. float16 keeps 256 bits: converted 512 bits at a time, its
  // window 64 ran 1.11x slower.
  if constexpr (std::is_same_v<Row, float> && std::is_same_v<T, float> && NV % 2 == 0) {
    __m512 acc[NV / 2];
    for (int m = 0; m < NV / 2; ++m) acc[m] = fresh ? _mm512_setzero_ps() : load16(y + 2 * m * L);
    for (int64_t r = 0; r < n; ++r) {
      const __m512 c = _mm512_set1_ps(coef[r]);
      const float* x = rows[r] + offset;
#pragma GCC unroll 4
      for (int m = 0; m < NV / 2; ++m) acc[m] = _mm512_fmadd_ps(c, _mm512_loadu_ps(x + 2 * m * L), acc[m]);
    }
    for (int m = 0; m < NV / 2; ++m) store16(y + 2 * m * L, acc[m]);
    return;
  }
  if constexpr (std::is_same_v<Row, c10::BFloat16> && NV % 4 == 0) {
    // As the 256-bit form below: unpacking against zeros widens numbers 0-3, 8-11, 16-19, 24-27 of a
    // load of 32 (lo) and 4-7, 12-15, 20-23, 28-31 (hi); the sums are put in that order and back once.
    const __m512i lo_lanes = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i hi_lanes = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 lo[NV / 4], hi[NV / 4];
    for (int m = 0; m < NV / 4; ++m) {
      if (fresh) {
        lo[m] = hi[m] = _mm512_setzero_ps();
      } else {
        const __m512 a = load16(y + 4 * m * L), b = load16(y + (4 * m + 2) * L);
        lo[m] = _mm512_permutex2var_ps(a, lo_lanes, b), hi[m] = _mm512_permutex2var_ps(a, hi_lanes, b);
      }
    }
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t r = 0; r < n; ++r) {
      const __m512 c = _mm512_set1_ps(coef[r]);
      const c10::BFloat16* x = rows[r] + offset;
#pragma GCC unroll 4
      for (int m = 0; m < NV / 4; ++m) {
        const __m512i raw = _mm512_loadu_si512(x + 4 * m * L);
        lo[m] = _mm512_fmadd_ps(c, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, raw)), lo[m]);
        hi[m] = _mm512_fmadd_ps(c, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, raw)), hi[m]);
      }
    }
    for (int m = 0; m < NV / 4; ++m) {
      store16(y + 4 * m * L, _mm512_permutex2var_ps(lo[m], first, hi[m]));
      store16(y + (4 * m + 2) * L, _mm512_permutex2var_ps(lo[m], second, hi[m]));
    }
    return;
  }
#endif
#if defined(__AVX2__)
  if constexpr (std::is_same_v<Row, c10::BFloat16> && NV % 2 == 0) {
    // bfloat16 rows 16 numbers a load: unpacking against zeros widens numbers 0-3, 8-11 and
    // 4-7, 12-15 in one instruction each (a shift and a widening per 8 otherwise); the sums keep
    // that order in registers and are put back in order once, at the end.
    vec_t<float> lo[NV / 2], hi[NV / 2];
#pragma GCC unroll 4
    for (int m = 0; m < NV / 2; ++m) {
      const vec_t<float> a = fresh ? vec_t<float>{} : load(y + 2 * m * L), b = fresh ? vec_t<float>{} : load(y + (2 * m + 1) * L);
      lo[m] = _mm256_permute2f128_ps(a, b, 0x20), hi[m] = _mm256_permute2f128_ps(a, b, 0x31);
    }
    const __m256i zero = _mm256_setzero_si256();
    for (int64_t r = 0; r < n; ++r) {
      const __m256 c = _mm256_set1_ps(coef[r]);
      const c10::BFloat16* x = rows[r] + offset;
#pragma GCC unroll 4
      for (int m = 0; m < NV / 2; ++m) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 2 * m * L));
        lo[m] = _mm256_fmadd_ps(c, _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, raw)), lo[m]);
        hi[m] = _mm256_fmadd_ps(c, _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, raw)), hi[m]);
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < NV / 2; ++m) {
      store(y + 2 * m * L, vec_t<float>(_mm256_permute2f128_ps(lo[m], hi[m], 0x20)));
      store(y + (2 * m + 1) * L, vec_t<float>(_mm256_permute2f128_ps(lo[m], hi[m], 0x31)));
    }
    return;
  }
#endif
  vec_t<T> acc[NV];
#pragma GCC unroll 8
  for (int k = 0; k < NV; ++k) acc[k] = fresh ? vec_t<T>{} : load(y + k * L);
  for (int64_t r = 0; r < n; ++r) {
    const vec_t<T> c = vec_t<T>{} + coef[r];
    const auto* x = rows[r] + offset;
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) acc[k] += c * load(x + k * L);
  }
#pragma GCC unroll 8
  for (int k = 0; k < NV; ++k) store(y + k * L, acc[k]);
}

// y += sum_r coef[r] * rows[r], for rows of length d (y = the sum when `fresh`).
template <typename T, typename Y, typename R>
inline void accumulate(Y* y, const T* coef, const R& rows, int64_t n, int64_t d, bool fresh = false) {
  constexpr int L = Vec<T>::L, NV = 8;
  int64_t c = 0;
  for (; c + NV * L <= d; c += NV * L) accumulate_chunk<T, NV>(y + c, coef, rows, n, c, fresh);
  for (; c + L <= d; c += L) accumulate_chunk<T, 1>(y + c, coef, rows, n, c, fresh);
  if constexpr (std::is_same_v<Y, T>) {
    if (c < d && fresh) std::fill(y + c, y + d, T(0));
    for (int64_t r = 0; c < d && r < n; ++r)
      for (int64_t t = c; t < d; ++t) y[t] += coef[r] * T(rows[r][t]);
  } else {  // a float16 / bfloat16 y: summed in float, rounded once
    for (int64_t t = c; t < d; ++t) {
      T s = fresh ? T(0) : T(y[t]);
      for (int64_t r = 0; r < n; ++r) s += coef[r] * T(rows[r][t]);
      y[t] = Y(s);
    }
  }
}

// accumulate over rows given by pointers, fresh, out of line: key_pass8's sums as GCC compiled
// them before (under -ffp-contract=fast, which multiply-adds fuse depends on the code around
// them: a copy inlined into key_pass8 fused others, and dv came out an ulp off).
template <typename T, typename Y, typename S>
__attribute__((noinline)) void accumulate_pointers(Y* y, const T* coef, const S* const* rows, int64_t n, int64_t d) {
  accumulate(y, coef, Pointers<const S>{rows}, n, d, /*fresh=*/true);
}

// rows[r] += coef[r] * x for n rows of length d (the transpose of accumulate: x is read once
// into registers, a chunk at a time, and each row is updated in place).
template <typename T, typename S, typename R>
inline void scatter(const R& rows, const T* coef, const S* x, int64_t n, int64_t d) {
  constexpr int L = Vec<T>::L, NV = 8;
  int64_t c = 0;
#if TGATTN_WIDE_SUMS
  // float32 in 512-bit registers, as accumulate_chunk: each number the same multiply-add, bit for
  // bit; float32's backward (dq added into by each key) 1.04-1.05x faster on random / top-k 1 % and
  // window 64, one thread, n = 4096, H = 8, d = 64.
  if constexpr (std::is_same_v<T, float> && std::is_same_v<S, float>) {
    for (; c + NV * L <= d; c += NV * L) {
      __m512 xv[NV / 2];
      for (int k = 0; k < NV / 2; ++k) xv[k] = _mm512_loadu_ps(x + c + 2 * k * L);
      for (int64_t r = 0; r < n; ++r) {
        const __m512 a = _mm512_set1_ps(coef[r]);
        T* y = rows[r] + c;
#pragma GCC unroll 4
        for (int k = 0; k < NV / 2; ++k)
          _mm512_storeu_ps(y + 2 * k * L, _mm512_fmadd_ps(a, xv[k], _mm512_loadu_ps(y + 2 * k * L)));
      }
    }
  }
#endif
  for (; c + NV * L <= d; c += NV * L) {
    vec_t<T> xv[NV];
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) xv[k] = load(x + c + k * L);
    for (int64_t r = 0; r < n; ++r) {
      const vec_t<T> a = vec_t<T>{} + coef[r];
      T* y = rows[r] + c;
#pragma GCC unroll 8
      for (int k = 0; k < NV; ++k) store(y + k * L, load(y + k * L) + a * xv[k]);
    }
  }
  for (; c + L <= d; c += L) {
    const vec_t<T> xv = load(x + c);
    for (int64_t r = 0; r < n; ++r) store(rows[r] + c, load(rows[r] + c) + coef[r] * xv);
  }
  for (int64_t r = 0; c < d && r < n; ++r)
    for (int64_t t = c; t < d; ++t) rows[r][t] += coef[r] * T(x[t]);
}

// x[r] *= scale for r < n; returns the largest result.
template <typename T>
inline T scale_max(T* x, int64_t n, T scale) {
  constexpr int L = Vec<T>::L;
  T m = -std::numeric_limits<T>::infinity();
  vec_t<T> mv = vec_t<T>{} + m;
  int64_t r = 0;
  for (; r + L <= n; r += L) {
    const vec_t<T> s = load(x + r) * scale;
    store(x + r, s);
    mv = s > mv ? s : mv;
  }
#if defined(__AVX512VL__)
  // The last n % 8 as one masked vector (see exp_shifted's tail): the same products, bit for bit.
  if constexpr (std::is_same_v<T, float>) {
    if (r < n) {
      const __mmask8 live = __mmask8((1u << (n - r)) - 1);
      const vec_t<float> s = _mm256_maskz_loadu_ps(live, x + r) * scale;
      _mm256_mask_storeu_ps(x + r, live, s);
      mv = _mm256_mask_max_ps(mv, live, s, mv);
      r = n;
    }
  }
#endif
  for (int l = 0; l < L; ++l) m = std::max(m, mv[l]);
  for (; r < n; ++r) m = std::max(m, x[r] *= scale);
  return m;
}

// to[0 : d] = from[0 : d] in the dtype of `to` (float16 / bfloat16 rounded to nearest even).
template <typename S, typename T>
inline void convert(S* to, const T* from, int64_t d) {
  constexpr int L = Vec<T>::L;
  int64_t c = 0;
  for (; c + L <= d; c += L) store(to + c, load(from + c));
  for (; c < d; ++c) to[c] = S(from[c]);
}

// Per-node tensors [N, H, d] are read in place through their strides (the caller's layout:
// the view of a projection's output), so only the feature dimension must be contiguous.
bool rows_ok(const at::Tensor& t) { return t.dim() == 3 && t.device().is_cpu() && (t.size(2) <= 1 || t.stride(2) == 1); }

// The first row of head h of a per-node tensor [N, H, d] (rows are t.stride(0) apart).
template <typename T>
T* head(const at::Tensor& t, int64_t h) {
  return t.data_ptr<T>() + h * t.stride(1);
}

// A CSR pointer (rowptr, colptr), int32 when the edges fit, else int64 (the row pointer of 10
// edges among 10^7 nodes is 38 MB instead of 76), read as int64. One type for both, not a
// template: kernels instantiated for both widths came out slower, GCC inlining otherwise in the
// larger code (the molecule forward 1.03x, rows of 0-2 edges 1.1-1.2x), and a branch on a flag
// that never changes costs nothing measurable.
struct RowPtr {
  const void* data;
  bool wide;  // int64 entries
  int64_t operator[](int64_t i) const {
    return wide ? static_cast<const int64_t*>(data)[i] : int64_t(static_cast<const int32_t*>(data)[i]);
  }
};

bool index_type(const at::Tensor& t) { return t.scalar_type() == at::kLong || t.scalar_type() == at::kInt; }
RowPtr row_ptr(const at::Tensor& t) { return {t.data_ptr(), t.scalar_type() == at::kLong}; }

// Row bounds cutting rows 0 .. rows into `blocks` blocks of about the same number of edges
// (rows of very different degree, as in causal sets or global tokens, still balance).
std::vector<int64_t> balanced(RowPtr ptr, int64_t rows, int64_t blocks) {
  std::vector<int64_t> bounds(blocks + 1, rows);
  bounds[0] = 0;
  for (int64_t b = 1; b < blocks; ++b) {
    const int64_t target = ptr[rows] * b / blocks;
    int64_t lo = 0, hi = rows;  // the first row whose pointer is >= target (std::lower_bound)
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (ptr[mid] < target) lo = mid + 1; else hi = mid;
    }
    bounds[b] = std::max(bounds[b - 1], lo);
  }
  return bounds;
}

// Runs fn(scratch, head, block, first_row, last_row) for every head over the row blocks
// bounds[b] .. bounds[b + 1], all in one parallel region: a thread takes consecutive tasks, so it
// stays on one head and that head's rows stay in its cache, and it keeps one Scratch for all of
// them. Small problems run on the calling thread, where waking the pool would cost more than the work.
template <typename Scratch, typename F>
void for_head_blocks(const std::vector<int64_t>& bounds, RowPtr ptr, int64_t heads, const F& fn) {
  if (bounds.size() < 2 || heads <= 0) return;
  const int64_t blocks = int64_t(bounds.size()) - 1, rows = bounds.back();
  const int64_t tasks = heads * blocks;
  const int64_t grain = ptr[rows] * heads < (int64_t(1) << 15) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t)
      fn(scratch, t / blocks, t % blocks, bounds[t % blocks], bounds[t % blocks + 1]);
  });
}

// The same over `blocks` balanced row blocks.
template <typename Scratch, typename F>
void for_head_blocks(RowPtr ptr, int64_t rows, int64_t heads, int64_t blocks, const F& fn) {
  if (rows > 0) for_head_blocks<Scratch>(balanced(ptr, rows, std::min(rows, blocks)), ptr, heads, fn);
}

// Large buffers (outputs, gradients, scratch) kept for the next call. glibc returns blocks
// over 32 MB to the system when they are freed (smaller ones too, when the heap's top is
// trimmed), so every call wrote its outputs into fresh pages: at n = 1M (window 64), forward +
// backward spent 17 of its 48 s in the operating system clearing them (2.3M page faults).
// Like PyTorch's CUDA caching allocator, a freed block waits here for a request of its size
// (up to 1/8 larger). Free blocks are bounded by the most bytes the cache's blocks ever held
// in use at once (a training step's worth: what the next step asks for again) and by `limit`;
// the largest go first, and `clear` hands them all back.
class BufferCache final : public c10::Allocator {
 public:
  static constexpr size_t MIN_BYTES = size_t(1) << 20;  // smaller blocks: torch's allocator

  c10::DataPtr allocate(size_t bytes) override {
    if (bytes < MIN_BYTES) return c10::GetCPUAllocator()->allocate(bytes);
    Block* b = take(bytes);
    return {b->ptr, b, &BufferCache::release, c10::Device(c10::DeviceType::CPU)};
  }
  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  // [N, ...] tensor of dtype `like` whose storage comes from here.
  at::Tensor empty(at::IntArrayRef sizes, const at::Tensor& like) { return empty(sizes, like.scalar_type()); }
  at::Tensor empty(at::IntArrayRef sizes, at::ScalarType dtype) {
    return at::detail::empty_generic(sizes, this, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, c10::nullopt);
  }
  // (free bytes held, bytes in use, most bytes ever in use at once, hits, misses, limit)
  std::vector<int64_t> info() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {int64_t(held_), int64_t(live_), int64_t(peak_), hits_, misses_, int64_t(limit_)};
  }
  void set_limit(size_t limit) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_ = limit;
    shrink(0);
  }
  // Frees every free block; the bound starts again from the bytes in use now.
  void clear() {
    std::lock_guard<std::mutex> lock(mutex_);
    drop_all();
    peak_ = live_;
  }

  static BufferCache& get() {
    static BufferCache* cache = new BufferCache();  // never destroyed: tensors may outlive statics
    return *cache;
  }

 private:
  struct Block {
    void* ptr;  // base + this block's offset
    size_t size;
    void* base;
  };
  BufferCache() {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    limit_ = pages > 0 && page > 0 ? size_t(pages) * size_t(page) / 2 : size_t(8) << 30;
  }
  Block* take(size_t bytes) {
    const size_t size = (bytes + 4095) / 4096 * 4096;
    size_t offset = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= bytes + bytes / 8) {
        Block* b = it->second;
        held_ -= b->size;
        free_.erase(it);
        ++hits_;
        peak_ = std::max(peak_, live_ += b->size);
        return b;
      }
      // New blocks start at different offsets into their pages (0 to 63 cache lines): rows of
      // the same number in page-aligned blocks (a key pass reads q, dO and dq row i together)
      // share their L1 sets and their low address bits, which stalled loads behind unrelated
      // stores (random 1 %, n = 4096: the backward 1.09-1.13x slower than with glibc's blocks).
      offset = 64 * ((7 * misses_++) % 64);
      peak_ = std::max(peak_, live_ += size);
    }
    void* p = std::aligned_alloc(4096, size + 4096);
    if (!p) {  // the cache's free blocks may be what is missing
      { std::lock_guard<std::mutex> lock(mutex_); drop_all(); }
      p = std::aligned_alloc(4096, size + 4096);
    }
    if (!p) {
      std::lock_guard<std::mutex> lock(mutex_);
      live_ -= size;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, p, "tgattn fused: out of memory allocating ", size, " bytes");
    return new Block{static_cast<char*>(p) + offset, size, p};
  }
  static void release(void* ctx) {
    BufferCache& c = get();
    Block* b = static_cast<Block*>(ctx);
    std::lock_guard<std::mutex> lock(c.mutex_);
    c.live_ -= b->size;
    if (b->size > std::min(c.limit_, c.peak_)) return drop(b);
    c.shrink(b->size);
    c.free_.emplace(b->size, b);
    c.held_ += b->size;
  }
  // Evicts the largest free blocks until `room` more bytes fit under the bounds (lock held).
  void shrink(size_t room) {
    while (!free_.empty() && held_ + room > std::min(limit_, peak_)) {
      const auto last = std::prev(free_.end());
      held_ -= last->first;
      drop(last->second);
      free_.erase(last);
    }
  }
  void drop_all() {
    for (auto& [size, b] : free_) drop(b);
    free_.clear();
    held_ = 0;
  }
  static void drop(Block* b) {
    std::free(b->base);
    delete b;
  }

  std::mutex mutex_;
  std::multimap<size_t, Block*> free_;
  size_t held_ = 0, live_ = 0, peak_ = 0, limit_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

// The rows of one head of a per-node tensor [N, H, d], contiguous: the rows the kernels gather
// at random. In the caller's layout ([N, H, d] contiguous) a head's rows are H * d apart, and
// gathering them costs 1.3-1.6x more than gathering packed rows (a window of 64 touches 65
// pages per tensor instead of 9: more TLB misses, no help from the stream prefetchers), so
// a thread copies the head it works on here: the rows a block of work reads (local_keys), else
// the whole head, n * d numbers per thread, not a copy of the tensor. Where a copy would be read
// little (in_place: scattered edges among many nodes) the rows are read in place instead: 10
// edges among 10^7 keys copied 320 MB of K and V rows to read 10 of each.
template <typename T>
struct Slab {
  c10::DataPtr buf;  // from the BufferCache: aligned to a cache line at least
  int64_t size = 0, of = -1, lo = 0, hi = 0;  // rows lo .. hi of head `of` held (-1 for none)
  const T* rows = nullptr;  // row j at rows + j * stride, for lo <= j < hi
  int64_t stride = 0;

  T* data() const { return static_cast<T*>(buf.get()); }
  // Room for `count` numbers, aligned to a cache line: rows of 64 floats then fill whole lines
  // (new T[] aligns to 16 bytes, which split every row over five lines and its vector loads
  // over two; the forward at n = 4096 ran 1.1-1.2x slower so).
  void reserve(int64_t count) {
    if (size >= count) return;
    buf = BufferCache::get().allocate(count * sizeof(T));
    size = count;
  }
  // Rows first .. last of head h of t (a copy unless its rows are adjacent already), addressed
  // by their row numbers.
  void hold(const at::Tensor& t, int64_t h, int64_t first, int64_t last) {
    const int64_t n = t.size(0), d = t.size(2);
    if (t.stride(0) == d || n <= 1) {
      of = h, lo = 0, hi = n, rows = head<T>(t, h), stride = t.stride(0);
      return;
    }
    if (of == h && lo <= first && last <= hi) {  // held already (rows may have been a view since)
      rows = data() - lo * d, stride = d;
      return;
    }
    reserve((last - first) * d);
    const T* src = head<T>(t, h);
    const int64_t from = t.stride(0);
    T* to = data() - first * d;  // row j at to + j * d
    // Short rows (16 floats in a molecule model's heads) copy through vector registers, 32
    // bytes at a time (float16 / bfloat16 rows as they are): a memcpy call per row cost more
    // than the row.
    constexpr int L = 32 / sizeof(T);
    const bool vectors = d % L == 0 && d <= 8 * L;
    for (int64_t i = first; i < last; ++i) {
      if (i + AHEAD < last) fetch(src + (i + AHEAD) * from, d * sizeof(T));
      if (vectors) {
        for (int64_t c = 0; c < d; c += L) std::memcpy(to + i * d + c, src + i * from + c, 32);
      } else {
        std::memcpy(to + i * d, src + i * from, d * sizeof(T));
      }
    }
    of = h, lo = first, hi = last, rows = to, stride = d;
  }
  void hold(const at::Tensor& t, int64_t h) { hold(t, h, 0, t.size(0)); }
  // Head h of t read where it is, through its row stride: nothing copied, nothing allocated (a
  // copy held stays held for the next hold).
  void view(const at::Tensor& t, int64_t h) { rows = head<T>(t, h), stride = t.stride(0); }
  // A zeroed buffer of n rows of d numbers (for sums written back afterwards).
  T* zeros(int64_t n, int64_t d) {
    reserve(n * d);
    std::memset(data(), 0, n * d * sizeof(T));
    of = -1;
    return data();
  }
};

// Whether work that reads `reads` rows of a head (with repeats) out of `span` rows reads them in
// place rather than from a copy of the span (Slab::hold): where fewer than one row in eight
// would be read. A copy costs a pass over the span and its memory; reading strided rows in
// place costs more per row read than reading copied ones (the forward up to 1.2x at one read
// per two rows, H = 4, d = 16). One thread, random edges among 2^19 nodes, H = 1 / 4 / 8: at
// 1/16 edge per node in place took 0.62 / 0.75 / 0.54x the time of the copies forward, 0.90 /
// 0.88 / 0.72x forward + backward; from 1/8 on the rule copies, as before. Sets of many edges
// per node (every benchmark pattern, molecule batches) copy; 10 edges among 10^7 nodes do not.
inline bool in_place(int64_t reads, int64_t span) { return 8 * reads < span; }

// The blocks of one head that a thread runs one after another (for_head_blocks hands each
// thread a run of consecutive tasks, head by head): those one copy of the head serves, so
// their edges are the reads of in_place.
inline int64_t same_head_blocks(int64_t heads, int64_t blocks) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, std::min(blocks, (heads * blocks + threads - 1) / threads));
}

// The keys that query rows r0 .. r1 reference (each row's keys are sorted), as a range
// [lo, hi), when it spans at most a quarter of the n_k keys: a local pattern (windows, blocks,
// packed sequences), whose block then copies only those rows of K and V. Otherwise [0, n_k),
// and [0, 0) for rows without edges (nothing to copy).
std::pair<int64_t, int64_t> local_keys(RowPtr ptr, const int64_t* col, int64_t r0, int64_t r1, int64_t n_k) {
  int64_t lo = n_k, hi = 0;
  for (int64_t i = r0; i < r1; ++i)
    if (ptr[i] < ptr[i + 1]) lo = std::min(lo, col[ptr[i]]), hi = std::max(hi, col[ptr[i + 1] - 1] + 1);
  if (lo >= hi) return {0, 0};
  return 4 * (hi - lo) <= n_k ? std::make_pair(lo, hi) : std::make_pair(int64_t(0), n_k);
}

// Edges per forward block at most, on a local pattern: a window 64's block (about 2,000 rows)
// then reads about 2,200 keys, whose K and V rows (1.1 MB at d = 64) stay in L2 while the block
// runs, where a copy of the whole head (16 MB at n = 32,768) came from memory, into a fresh
// allocation, on every call.
constexpr int64_t BLOCK_EDGES = int64_t(1) << 18;

// The forward's row blocks (bounds) and the keys each reads (local_keys): blocks of at most
// BLOCK_EDGES edges when every one of them is local, else 4 per thread (a random pattern reads
// all keys from every block: its threads copy each head once, as before).
struct RowBlocks {
  std::vector<int64_t> bounds;
  std::vector<std::pair<int64_t, int64_t>> keys;
};

RowBlocks forward_blocks(RowPtr ptr, const int64_t* col, int64_t n_q, int64_t n_k) {
  RowBlocks rb;
  // Lays out `blocks` blocks; returns whether every one is local.
  const auto lay_out = [&](int64_t blocks) {
    rb.bounds = balanced(ptr, n_q, blocks);
    rb.keys.resize(blocks);
    bool local = true;
    for (int64_t b = 0; b < blocks; ++b) {
      rb.keys[b] = local_keys(ptr, col, rb.bounds[b], rb.bounds[b + 1], n_k);
      local &= rb.keys[b].second - rb.keys[b].first < n_k;
    }
    return local;
  };
  const int64_t coarse = std::min(n_q, 4 * int64_t(at::get_num_threads())), fine = std::min(n_q, ptr[n_q] / BLOCK_EDGES);
  if (!(fine > coarse && lay_out(fine)) && coarse > 0) lay_out(coarse);
  return rb;
}

// Attention dropout without a stored mask: whether edge e of head h is kept is a hash of
// (seed, h, e) (the SplitMix64 finaliser; Steele et al., "Fast splittable pseudorandom number
// generators", OOPSLA 2014), so the backward recomputes the forward's mask from the seed, and
// torch.manual_seed reproduces it (the seed is drawn from torch's generator).
struct Dropout {
  double p = 0;  // drop probability; 0 = no dropout
  uint64_t seed = 0;
  // keep(h, e) compares the hash's top 53 bits u with p: u * 2^-53 >= p exactly when
  // u >= ceil(p * 2^53) (both sides exact in double), so the comparison stays in integers and the
  // factor 1 / (1 - p) is divided once, not per edge (a double division and two conversions per
  // edge were a tenth of the forward's time on molecule batches).
  uint64_t threshold = 0;
  double kept = 1;  // the factor on a kept weight

  Dropout(double p_, uint64_t seed_) : p(p_), seed(seed_) {
    if (p > 0) threshold = uint64_t(std::ceil(p * 0x1.0p53)), kept = 1.0 / (1.0 - p);
  }
  bool on() const { return p > 0; }
  // The hash of edge e (or of a vector of edges, lane by lane: U uint64_t or a GCC vector of them).
  template <typename U>
  U hash(int64_t h, U e) const {
    U x = (seed ^ (uint64_t(h) * 0x9E3779B97F4A7C15ull)) ^ (e * 0xD1B54A32D192ED03ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  }
  bool keep(int64_t h, int64_t e) const {
    return (hash(h, uint64_t(e)) >> 11) >= threshold;  // uniform in [0, 2^53) from the top 53 bits
  }
  // The factor on a kept weight: 1 / (1 - p), 0 for a dropped one. A product, not a branch:
  // a branch on a coin flip misses about every other time (a third of the molecule forward).
  template <typename T>
  T factor(int64_t h, int64_t e) const {
    return !on() ? T(1) : T(kept) * T(keep(h, e));
  }
  // factor<float> of the edges e[0 .. 7] as one vector, the hash in eight 64-bit lanes (one
  // instruction per step where the CPU multiplies 64-bit lanes, AVX-512), bit for bit keep()'s:
  // lane by lane the hash was 15 % of the backward's eight-key path (molecule batches, p = 0.6).
  vec_t<float> factors8(int64_t h, const int64_t* e) const {
    typedef uint64_t u64x8 __attribute__((vector_size(64)));
    typedef int32_t i32x8 __attribute__((vector_size(32)));
    u64x8 x;
    for (int r = 0; r < 8; ++r) x[r] = uint64_t(e[r]);
    x = hash(h, x);
    const i32x8 kept8 = __builtin_convertvector((x >> 11) >= threshold, i32x8);  // -1 where kept
    const vec_t<float> f = vec_t<float>{} + float(kept);
    return kept8 ? f : vec_t<float>{};
  }
};

// The entries of one CSR row (positions ptr[i] .. ptr[i + 1]) that take part (keep(position))
// and their indices: the scratch of the row and column passes. When every entry is kept (the
// usual case) nothing is copied: the positions are a range and the indices a slice of idx.
template <typename T, typename I>
struct Entries {
  std::vector<int64_t> positions;
  std::vector<I> kept;
  std::vector<T> x, y;  // numbers per kept entry (scores, weights, d weights)
  int64_t first = 0;
  bool all = true;  // every entry kept
  const I* index = nullptr;

  int64_t position(int64_t r) const { return all ? first + r : positions[r]; }

  template <typename Keep>
  int64_t gather(RowPtr ptr, const I* idx, int64_t i, const Keep& keep) {
    first = ptr[i];
    const int64_t deg = ptr[i + 1] - first;
    if (int64_t(x.size()) < deg) x.resize(deg), y.resize(deg);  // grown only: a resize call per row cost 1-2 %
    int64_t n = 0;
    while (n < deg && keep(first + n)) ++n;
    all = n == deg;
    index = idx + first;
    if (all) return n;
    positions.resize(deg), kept.resize(deg);
    for (int64_t r = 0; r < n; ++r) positions[r] = first + r, kept[r] = idx[first + r];
    for (int64_t t = first + n; t < first + deg; ++t)
      if (keep(t)) positions[n] = t, kept[n++] = idx[t];
    index = kept.data();
    return n;
  }
};

// Whether the m <= 8 rows (or keys) from i on each have 1 to 8 edges: a group for the
// eight-lane paths (attend_rows8, key_pass8).
inline bool short_group(RowPtr ptr, int64_t i, int64_t m) {
  bool ok = true;
  for (int64_t r = i; ok && r < i + m; ++r) ok = ptr[r] < ptr[r + 1] && ptr[r + 1] - ptr[r] <= 8;
  return ok;
}

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
template <typename S, typename I, bool EDGE, bool AD, typename T = compute_t<S>>
void key_pass(int64_t c0, int64_t c1, RowPtr colptr, const I* row_t, const I* perm_t, const HeadGrad<S>& g,
              T scale, const Dropout& drop, int64_t h, Entries<T, I>& ce, std::vector<T>& a, std::vector<T>& sums,
              const Logits<T>& lg) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const auto edge = [&](int64_t t) -> int64_t { return perm_t ? int64_t(perm_t[t]) : t; };
  if constexpr (is_half_v<S>) sums.resize(g.dk + g.dv);
  for (int64_t j = c0; j < c1; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      const int64_t m = std::min<int64_t>(8, c1 - j);
      if (!g.gw && short_group(colptr, j, m)) {
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

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(rows_ok(q) && rows_ok(k) && rows_ok(v),
              "tgattn fused: q, k, v must be [N, H, d] CPU tensors with a contiguous last dimension");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "tgattn fused: q, k, v must share a dtype");
  TORCH_CHECK(q.size(1) == k.size(1) && k.size(1) == v.size(1) && q.size(2) == k.size(2) && k.size(0) == v.size(0),
              "tgattn fused: q, k, v must be [N, H, d] with matching heads, key nodes and head dims");
}

// The kernels index rows through ptr and idx without bounds checks, so a malformed structure
// must never reach them: ptr [rows + 1] runs from 0 to idx.size(0) without going down, and
// every idx is a row of a tensor with n rows. One pass over the indices, next to the
// O(E * H * d) work of the kernels; split over the threads, as a serial pass held the second
// thread idle for 0.3 ms of a 20 ms forward (n = 4096, window 64). ptr and idx are int64 or int32.
void check_structure(const at::Tensor& ptr, const at::Tensor& idx, int64_t rows, int64_t n, const char* what) {
  TORCH_CHECK(index_type(ptr) && index_type(idx) && ptr.is_contiguous() && idx.is_contiguous() && ptr.dim() == 1 &&
                  idx.dim() == 1 && ptr.device().is_cpu() && idx.device().is_cpu(),
              "tgattn fused: ", what, " must be contiguous int64 or int32 CPU vectors");
  TORCH_CHECK(ptr.size(0) == rows + 1, "tgattn fused: ", what, " pointer has ", ptr.size(0), " entries, expected ",
              rows + 1);
  const RowPtr p = row_ptr(ptr);
  const int64_t E = idx.size(0);
  TORCH_CHECK(p[0] == 0 && p[rows] == E, "tgattn fused: ", what, " pointer must run from 0 to ", E);
  // Whether good(i) holds for every i < count (in chunks of 2^16, on all threads).
  const auto every = [](int64_t count, const auto& good) {
    return at::parallel_reduce(
        0, count, int64_t(1) << 16, true,
        [&](int64_t a, int64_t b, bool ok) {
          for (int64_t i = a; i < b; ++i) ok &= good(i);
          return ok;
        },
        [](bool x, bool y) { return x && y; });
  };
  const auto rising = [&](const auto* x) { return every(rows, [&](int64_t r) { return x[r] <= x[r + 1]; }); };
  const bool up = p.wide ? rising(ptr.data_ptr<int64_t>()) : rising(ptr.data_ptr<int32_t>());
  TORCH_CHECK(up, "tgattn fused: ", what, " pointer goes down");
  const auto in_range = [&](const auto* x) {
    return every(E, [&](int64_t e) { return (x[e] >= 0) & (int64_t(x[e]) < n); });
  };
  const bool ok = idx.scalar_type() == at::kLong ? in_range(idx.data_ptr<int64_t>()) : in_range(idx.data_ptr<int32_t>());
  TORCH_CHECK(ok, "tgattn fused: ", what, " holds an index outside [0, ", n, ")");
}

// The dtype the kernels compute in: float for float16 / bfloat16 inputs (also the dtype of the
// log-sum-exp, a bias and its gradient), else the inputs' own.
at::ScalarType compute_type(const at::Tensor& q) {
  const at::ScalarType t = q.scalar_type();
  return t == at::kHalf || t == at::kBFloat16 ? at::kFloat : t;
}

at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, const at::Tensor& q, int64_t E) {
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.dim() == 2 && b.size(0) == E && (b.size(1) == 1 || b.size(1) == q.size(1)) &&
                               b.scalar_type() == compute_type(q)),
              "tgattn fused: bias must be [E, 1 or H] of the dtype of q (float32 for float16 / bfloat16 q)");
  return b;
}

at::Tensor checked_sinks(const c10::optional<at::Tensor>& sinks, const at::Tensor& q) {
  const at::Tensor t = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  TORCH_CHECK(!t.defined() || (t.dim() == 1 && t.size(0) == q.size(1) && t.scalar_type() == compute_type(q)),
              "tgattn fused: sinks must be [H] of the dtype of q (float32 for float16 / bfloat16 q)");
  return t;
}

void check_softcap(double softcap) {
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "tgattn fused: softcap must be finite and >= 0 (0: none)");
}

// The edge terms' features [E, F] (q's dtype) and, when given, a per-row tensor [n_q, H, F] of the
// compute dtype (qe, the value sums or their gradient), all contiguous; returns F (0 without features).
int64_t check_edge_terms(const at::Tensor& feat, std::initializer_list<const at::Tensor*> rows, const at::Tensor& q,
                         int64_t E) {
  for (const at::Tensor* t : rows)
    TORCH_CHECK(!t->defined() || feat.defined(), "tgattn fused: edge terms need edge_features");
  if (!feat.defined()) return 0;
  TORCH_CHECK(feat.dim() == 2 && feat.size(0) == E && feat.is_contiguous() && feat.scalar_type() == q.scalar_type() &&
                  feat.device().is_cpu(),
              "tgattn fused: edge_features must be a contiguous [E, F] CPU tensor of the dtype of q");
  const int64_t F = feat.size(1);
  for (const at::Tensor* t : rows)
    TORCH_CHECK(!t->defined() || (t->sizes() == at::IntArrayRef{q.size(0), q.size(1), F} && t->is_contiguous() &&
                                  t->scalar_type() == compute_type(q)),
                "tgattn fused: edge_q, edge_sums and their gradient must be contiguous [n_q, H, F] of the dtype of q "
                "(float32 for float16 / bfloat16 q)");
  return F;
}

at::Tensor optional_tensor(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

// The features' rows in sorted edge order (FeatureRows::perm): int64 [E] indices into [0, E), or null.
const int64_t* checked_feature_perm(const c10::optional<at::Tensor>& edge_perm, int64_t E) {
  if (!edge_perm.has_value()) return nullptr;
  const at::Tensor& p = *edge_perm;
  TORCH_CHECK(p.dim() == 1 && p.size(0) == E && p.scalar_type() == at::kLong && p.is_contiguous() && p.device().is_cpu(),
              "tgattn fused: edge_perm must be a contiguous int64 [E] CPU vector");
  const int64_t* x = p.data_ptr<int64_t>();
  bool ok = true;
  for (int64_t e = 0; e < E; ++e) ok &= (x[e] >= 0) & (x[e] < E);
  TORCH_CHECK(ok, "tgattn fused: edge_perm holds an index outside [0, ", E, ")");
  return x;
}

// The soft cap (0: none) and the sink of head h (sinks [H] or undefined).
template <typename T>
Logits<T> logits(double softcap, double scale, const at::Tensor& sinks, int64_t h) {
  Logits<T> lg;
  if (softcap > 0) lg.cap = T(softcap), lg.k = T(scale / softcap);
  if (sinks.defined()) lg.has_sink = true, lg.sink = sinks.data_ptr<T>()[h];
  return lg;
}

// q [n_q, H, dk], k [n_k, H, dk], v [n_k, H, dv] (any row and head strides); bias [E, 1 or H] or None;
// softcap > 0 caps the scaled scores (0: no cap); sinks [H] or None (see Logits). Edge terms
// (EdgeTerms): edge_features [E, F] in the caller's edge order, sorted edge e's row edge_perm[e] (None:
// sorted already), edge_q [n_q, H, F] (the key term) or None, edge_sums: compute the value term's sums.
// Returns (out [n_q, H, dv], lse [H, n_q], weights [H, E] if `weights` else an empty tensor), and the
// value sums s [n_q, H, F] (compute dtype) as a fourth tensor with edge_sums.
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& rowptr, const at::Tensor& col,
                                const c10::optional<at::Tensor>& bias, double scale, double dropout_p,
                                int64_t seed, bool weights, double softcap, const c10::optional<at::Tensor>& sinks,
                                const c10::optional<at::Tensor>& edge_q,
                                const c10::optional<at::Tensor>& edge_features, bool edge_sums,
                                const c10::optional<at::Tensor>& edge_perm) {
  check_inputs(q, k, v);
  const int64_t H = q.size(1), n_q = q.size(0), n_k = k.size(0), dk = q.size(2), dv = v.size(2), E = col.size(0);
  check_structure(rowptr, col, n_q, n_k, "rowptr / col");
  TORCH_CHECK(col.scalar_type() == at::kLong, "tgattn fused: col must be int64");
  const at::Tensor b = checked_bias(bias, q, E), sk = checked_sinks(sinks, q);
  check_softcap(softcap);
  const at::Tensor qe = optional_tensor(edge_q), feat = optional_tensor(edge_features);
  const int64_t F = check_edge_terms(feat, {&qe}, q, E);
  const int64_t* fperm = feat.defined() ? checked_feature_perm(edge_perm, E) : nullptr;
  TORCH_CHECK(!edge_sums || feat.defined(), "tgattn fused: edge_sums needs edge_features");
  TORCH_CHECK(!(qe.defined() && softcap > 0), "tgattn fused: softcap cannot be combined with edge_q");
  // Every row of out and lse is written by the kernel: no zero-filling pass, even on a reused block.
  BufferCache& cache = BufferCache::get();
  at::Tensor out = cache.empty({n_q, H, dv}, q), lse = cache.empty({H, n_q}, compute_type(q));
  at::Tensor w = weights ? cache.empty({H, E}, q).zero_() : at::empty({0}, q.options());
  // The value sums are added to row by row (rows without edges keep 0).
  at::Tensor sums = edge_sums ? cache.empty({n_q, H, F}, compute_type(q)).zero_() : at::Tensor();
  const RowPtr ptr = row_ptr(rowptr);
  const int64_t* cp = col.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tgattn_fused_forward", [&] {
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
      if (in_place((ptr[r1] - ptr[r0]) * runs, hi - lo))
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
  });
  if (edge_sums) return {out, lse, w, sums};
  return {out, lse, w};
}

// Key blocks per head in the backward pass: the dq rows a block writes may be another block's,
// so every block but the first gets its own dq (summed at the end). With 8 or more heads one
// block per head keeps every thread busy; fewer heads split keys, at (blocks - 1) copies of dq
// of a head each. A copy costs O(n_q d) to clear, write and sum against the O(E d / blocks) work
// of its block, so a block gets at least 4 edges per query row on average: a sparse graph
// (molecule batches: about 3.4) keeps one block per head, which measured faster than splitting.
// Fixed by H, E and n_q, never by the thread count, so results never depend on the thread count.
int64_t key_blocks(int64_t heads, int64_t edges, int64_t n_q) {
  const int64_t by_heads = 8 / std::max<int64_t>(heads, 1), by_work = edges / (4 * std::max<int64_t>(n_q, 1));
  return std::max<int64_t>(1, std::min(by_heads, by_work));
}

// The sinks' gradient [H]: the sink weighs exp(sink - lse_i) in row i, a logit without a value, so
// its gradient is -sum_i exp(sink - lse_i) delta_i.
at::Tensor sink_grads(const at::Tensor& sk, const at::Tensor& lse, const at::Tensor& delta, int64_t n_q) {
  const int64_t H = sk.size(0);
  at::Tensor grad_sinks = at::zeros({H}, sk.options());
  AT_DISPATCH_FLOATING_TYPES(sk.scalar_type(), "tgattn_fused_sinks", [&] {
    for (int64_t h = 0; h < H; ++h) {
      const scalar_t t = sk.data_ptr<scalar_t>()[h], *lh = lse.data_ptr<scalar_t>() + h * n_q;
      const scalar_t* dh = delta.data_ptr<scalar_t>() + h * n_q;
      scalar_t sum = 0;
      for (int64_t i = 0; i < n_q; ++i)
        if (lh[i] > -std::numeric_limits<scalar_t>::infinity())  // a row of lse -inf has no logit, the sink none
          sum += std::exp(t - lh[i]) * dh[i];
      grad_sinks.data_ptr<scalar_t>()[h] = -sum;
    }
  });
  return grad_sinks;
}

// grad_out, q, k, v, out [N, H, d] as in forward, lse [H, n_q]; weights and grad_weights [H, E]
// (grad_weights: the gradient that reached the returned weights, or None); bias as in forward.
// rowptr as in forward; colptr / row_t / perm_t: the transposed pattern (each int64 or int32,
// row_t and perm_t alike; perm_t is needed with a bias, dropout or grad_weights). Returns (dq, dk,
// dv, d_scores [H, E] when grad_bias, else empty); d_scores is the gradient of an additive bias (of the
// capped scores). softcap and sinks as in forward; with sinks a fifth tensor, their gradient [H]:
// the sink weighs exp(sink - lse_i) in row i, a logit without a value, so its gradient is
// -sum_i exp(sink - lse_i) delta_i. Edge terms as in forward, with the gradient of the value sums (grad_sums,
// [n_q, H, F] or None) and the forward's value sums (edge_sums) where `out` is the kernel's output
// without the value term (delta_i then adds <grad_sums_i, s_i>); None where `out` already holds it
// (o_i + W_h s_i: <dO_i, W_h s_i> is that term). Then two more tensors, the
// gradient of edge_q [n_q, H, F] (empty without edge_q) and of the features [E, F] (the caller's
// order), both of the compute dtype. col (int64 [E], as in forward) with perm_t lets dq be summed
// by a pass over query rows where that was measured faster (see query_pass below); None: never.
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse,
                                 const c10::optional<at::Tensor>& weights,
                                 const c10::optional<at::Tensor>& grad_weights,
                                 const c10::optional<at::Tensor>& bias, const at::Tensor& rowptr,
                                 const at::Tensor& colptr, const at::Tensor& row_t,
                                 const c10::optional<at::Tensor>& perm_t, double scale, double dropout_p,
                                 int64_t seed, bool grad_bias, double softcap,
                                 const c10::optional<at::Tensor>& sinks, const c10::optional<at::Tensor>& edge_q,
                                 const c10::optional<at::Tensor>& edge_features,
                                 const c10::optional<at::Tensor>& edge_sums,
                                 const c10::optional<at::Tensor>& grad_sums,
                                 const c10::optional<at::Tensor>& edge_perm, const c10::optional<at::Tensor>& col) {
  check_inputs(q, k, v);
  const at::Tensor sk = checked_sinks(sinks, q);
  check_softcap(softcap);
  const at::Tensor go = rows_ok(grad_out) ? grad_out : grad_out.contiguous();
  const at::Tensor o = rows_ok(out) ? out : out.contiguous();
  const int64_t H = q.size(1), n_q = q.size(0), n_k = k.size(0), dk = q.size(2), dv = v.size(2), E = row_t.size(0);
  const at::Tensor b = checked_bias(bias, q, E);
  const at::Tensor gw = grad_weights.has_value() ? grad_weights->contiguous() : at::Tensor();
  const at::Tensor w = weights.has_value() ? weights->contiguous() : at::Tensor();
  const at::Tensor perm = perm_t.has_value() ? *perm_t : at::Tensor();
  const at::Tensor qe = optional_tensor(edge_q), feat = optional_tensor(edge_features);
  const at::Tensor esums = optional_tensor(edge_sums), gsum = optional_tensor(grad_sums);
  const int64_t F = check_edge_terms(feat, {&qe, &esums, &gsum}, q, E);
  const int64_t* fperm = feat.defined() ? checked_feature_perm(edge_perm, E) : nullptr;
  const bool edge = feat.defined();
  TORCH_CHECK(!(qe.defined() && softcap > 0), "tgattn fused: softcap cannot be combined with edge_q");
  TORCH_CHECK(index_type(rowptr) && rowptr.is_contiguous() && rowptr.numel() == n_q + 1 &&
                  row_ptr(rowptr)[n_q] == E,
              "tgattn fused: rowptr must be int64 or int32 [n_q + 1] ending at E");
  check_structure(colptr, row_t, n_k, n_q, "colptr / row_t");
  const bool need_perm = b.defined() || dropout_p > 0 || gw.defined() || grad_bias || edge;
  TORCH_CHECK(!need_perm || perm.defined(), "tgattn fused: a bias, dropout, weight gradients or edge terms need perm_t");
  if (perm.defined()) {
    check_structure(colptr, perm, n_k, E, "colptr / perm_t");
    TORCH_CHECK(perm.scalar_type() == row_t.scalar_type(), "tgattn fused: row_t and perm_t must share a dtype");
  }
  const auto same = [&](const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dtype) {
    return t.sizes() == shape && t.scalar_type() == dtype;
  };
  const at::ScalarType dtype = q.scalar_type(), ct = compute_type(q);
  TORCH_CHECK(same(go, {n_q, H, dv}, dtype) && same(o, {n_q, H, dv}, dtype) && same(lse, {H, n_q}, ct) &&
                  lse.is_contiguous() &&
                  (!gw.defined() || (same(gw, {H, E}, dtype) && w.defined() && same(w, {H, E}, dtype))),
              "tgattn fused: grad_out and out [n_q, H, dv], weights and grad_weights [H, E] must match q, "
              "lse [H, n_q] (float32 for float16 / bfloat16 q)");
  const int64_t blocks = std::min(key_blocks(H, E, n_q), std::max<int64_t>(n_k, 1));
  const RowPtr ptr = row_ptr(rowptr), tptr = row_ptr(colptr);
  // dq by a query pass (query_rows), float16 / bfloat16: the key pass writes each edge's scale ds_e
  // (floats, by edge through perm_t) and each query row then sums its dq in registers from its keys'
  // rows, written once in the input dtype, instead of the key pass adding into float dq rows (a
  // read-modify-write of 4 bytes per number; each key block but the first into a dq of its own,
  // cleared and summed at the end; then rounded into dq). Backward op alone, n = 4096, d = 64, 1
  // thread, min of 20 interleaved rounds, 2fe6989's kernel (loaded under another name in the same
  // process) -> this one, H = 8: bfloat16 31.5 -> 28.5 ms (random 1 %), 32.3 -> 29.8 (top-k 1 %),
  // 64.5 -> 60.9 (window 64), float16 35.1 -> 32.9, 34.9 -> 33.7, 70.2 -> 67.2; random 1 %, H = 4
  // bfloat16 17.6 -> 15.1, H = 2 9.7 -> 7.7 (float32 at H = 8, the same code in both, 38.3 -> 38.6).
  // float32 keeps the scatter: with the query pass (same build, col given or not) random 1 % H = 4
  // 20.8 -> 23.3 ms, H = 2 11.0 -> 12.0, H = 1 5.5 -> 5.5, window 64 H = 4 38.4 -> 40.1, H = 8 slower
  // too: a float32 k row read per edge costs what its dq row's update did. float64 too (H = 4 45.2 ->
  // 44.9, H = 2 24.5 -> 23.6, H = 1 12.5 -> 10.1: not taken up). Every dq row is summed whole, in one
  // thread, in the order of its edges: deterministic, whatever the thread count.
  const at::Tensor cv = optional_tensor(col);
  const bool query_pass = cv.defined() && perm.defined() && compute_type(q) != q.scalar_type();
  if (query_pass) {
    TORCH_CHECK(cv.scalar_type() == at::kLong && cv.size(0) == E, "tgattn fused: col must be int64 [E]");
    check_structure(rowptr, cv, n_q, n_k, "rowptr / col");
  }
  const std::vector<int64_t> bounds = n_k > 0 ? balanced(tptr, n_k, blocks) : std::vector<int64_t>{};
  const int64_t runs = same_head_blocks(H, blocks);
  // A block with few edges for the queries (in_place) reads q and dO in place and sums dq where
  // it goes (cleared first); otherwise from copies of the head, into a packed dq copied there.
  const auto direct = [&](int64_t blk) { return in_place((tptr[bounds[blk + 1]] - tptr[bounds[blk]]) * runs, n_q); };
  bool any_direct = false;
  for (int64_t blk = 0; blk + 1 < int64_t(bounds.size()); ++blk) any_direct |= direct(blk);
  // Written in full by the kernel: no zero-filling pass, even on a reused block.
  BufferCache& cache = BufferCache::get();
  at::Tensor dq = cache.empty({n_q, H, dk}, q);
  if (n_k == 0) dq.zero_();
  at::Tensor dkt = cache.empty({n_k, H, dk}, q), dvt = cache.empty({n_k, H, dv}, q);
  // Each key block but the first sums its dq apart (extra, laid out like dq), added at the end.
  // float16 / bfloat16: dq is summed in float, by every block apart (sums) where there are several
  // or one sums in place; a single block's packed float dq is rounded into dq as it is copied there.
  const bool half = ct != dtype;
  at::Tensor extra = !query_pass && !half && blocks > 1 ? cache.empty({blocks - 1, n_q, H, dk}, q) : at::Tensor();
  at::Tensor sums =
      !query_pass && half && (blocks > 1 || any_direct) ? cache.empty({blocks, n_q, H, dk}, ct) : at::Tensor();
  // The score gradient per edge (a bias's gradient), and per position of the key pass what the edge
  // terms' gradients are summed from (see HeadGrad). The key pass writes them for every edge but those
  // of a -inf bias, which it skips (they keep 0): zero-filled first only with a bias.
  const auto per_edge = [&] {
    at::Tensor t = cache.empty({H, E}, ct);
    return b.defined() ? t.zero_() : t;
  };
  at::Tensor ds = grad_bias ? per_edge() : at::empty({0}, q.options().dtype(ct));
  at::Tensor as = qe.defined() ? per_edge() : at::Tensor();
  at::Tensor pw = gsum.defined() ? per_edge() : at::Tensor();
  at::Tensor delta = cache.empty({H, n_q}, ct);
  // The query pass's coefficients by edge: with one key block per head, a head's query pass runs in the
  // task of its key pass, right after it, from that thread's [E] (no [H, E] buffer: 4 bytes per edge and
  // head more than the old path held, which also pushed the buffer cache to give back float32's blocks
  // between float32 and bfloat16 calls in one process: 2050 page faults per float32 backward, 1.2x slower);
  // with several key blocks a head's query pass waits for all of them: [H, E], after every key pass.
  const bool fuse_q = query_pass && blocks == 1;
  at::Tensor ad = query_pass && !fuse_q ? per_edge() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tgattn_fused_backward", [&] {
    using S = scalar_t;
    using T = compute_t<S>;
    const Dropout drop{dropout_p, uint64_t(seed)};
    struct None {};
    const bool value_delta = gsum.defined() && esums.defined();  // out without the value term: delta adds it
    for_head_blocks<None>(ptr, n_q, H, 4 * at::get_num_threads(), [&](None&, int64_t h, int64_t, int64_t r0, int64_t r1) {
      deltas<S>(r0, r1, head<S>(go, h), go.stride(0), head<S>(o, h), o.stride(0), dv, ptr,
                w.defined() ? w.data_ptr<S>() + h * E : nullptr, gw.defined() ? gw.data_ptr<S>() + h * E : nullptr,
                delta.data_ptr<T>() + h * n_q, value_delta ? gsum.data_ptr<T>() + h * F : nullptr,
                value_delta ? esums.data_ptr<T>() + h * F : nullptr, F, H * F);
    });
    const int64_t bias_heads = b.defined() ? b.size(1) : 0;
    // Head h's HeadGrad over the q and dO rows the slabs hold, its dq rows at dqh, dqs apart (none for
    // the query pass), with the edge terms' rows where there are some.
    const auto head_grad = [&](const Slab<S>& sq, const Slab<S>& sgo, int64_t h, T* dqh, int64_t dqs) {
      HeadGrad<S> g{sq.rows, head<S>(k, h), head<S>(v, h), sgo.rows, lse.data_ptr<T>() + h * n_q,
                    delta.data_ptr<T>() + h * n_q,
                    b.defined() ? b.data_ptr<T>() + (bias_heads == 1 ? 0 : h) : nullptr,
                    gw.defined() ? gw.data_ptr<S>() + h * E : nullptr, sq.stride, k.stride(0), v.stride(0),
                    sgo.stride, bias_heads, dk, dv, dqh, head<S>(dkt, h), head<S>(dvt, h),
                    grad_bias ? ds.data_ptr<T>() + h * E : nullptr, dqs, dkt.stride(0), dvt.stride(0)};
      if (edge) {
        g.feat = {feat.data_ptr<S>(), fperm, F}, g.ers = H * F;
        if (qe.defined()) g.qe = qe.data_ptr<T>() + h * F, g.as = as.data_ptr<T>() + h * E;
        if (gsum.defined()) g.gsum = gsum.data_ptr<T>() + h * F, g.pw = pw.data_ptr<T>() + h * E;
      }
      return g;
    };
    const auto run = [&](const auto* rt, const auto* pt) {
      using I = std::remove_const_t<std::remove_pointer_t<decltype(rt)>>;
      struct Scratch {
        Slab<S> q, go, k;
        Slab<T> dq;
        Entries<T, I> ce;
        std::vector<T> a, sums, ad;
      };
      for_head_blocks<Scratch>(bounds, tptr, H, [&](Scratch& sc, int64_t h, int64_t blk, int64_t c0, int64_t c1) {
        if constexpr (is_half_v<S>) if (query_pass) {  // no dq here: the key pass writes ad
          if (direct(blk))
            sc.q.view(q, h), sc.go.view(go, h);
          else
            sc.q.hold(q, h), sc.go.hold(go, h);
          HeadGrad<S> g = head_grad(sc.q, sc.go, h, nullptr, 0);
          if (fuse_q) {
            if (int64_t(sc.ad.size()) < E) sc.ad.resize(E);
            if (b.defined()) std::fill(sc.ad.begin(), sc.ad.begin() + E, T(0));  // -inf-biased edges are skipped
            g.ad = sc.ad.data();
          } else {
            g.ad = ad.data_ptr<T>() + h * E;
          }
          (edge ? key_pass<S, I, true, true> : key_pass<S, I, false, true>)(
              c0, c1, tptr, rt, pt, g, static_cast<T>(scale), drop, h, sc.ce, sc.a, sc.sums, logits<T>(softcap, scale, sk, h));
          if (fuse_q) {  // the whole head's keys are done: its dq (see the query pass below)
            if (in_place(E, n_k))
              sc.k.view(k, h);
            else
              sc.k.hold(k, h);
            query_rows<S>(0, n_q, ptr, cv.data_ptr<int64_t>(), g.ad, sc.k.rows, sc.k.stride, dk, head<S>(dq, h),
                          dq.stride(0));
          }
          return;
        }
        // Where this block's dq of head h goes: T sums (dq itself for block 0 of float / double
        // inputs), or, for float16 / bfloat16 without `sums`, rounded into dq.
        T* dst = nullptr;
        S* rounded = nullptr;
        if constexpr (is_half_v<S>) {
          if (sums.defined()) dst = sums.data_ptr<T>() + blk * n_q * H * dk + h * dk;
          else rounded = dq.data_ptr<S>() + h * dk;
        } else {
          dst = (blk == 0 ? dq.data_ptr<T>() : extra.data_ptr<T>() + (blk - 1) * n_q * H * dk) + h * dk;
        }
        const bool in_place_dq = direct(blk);  // then dst is set: sums exists
        T* dqh = dst;
        int64_t dqs = H * dk;
        if (in_place_dq) {
          sc.q.view(q, h), sc.go.view(go, h);
          for (int64_t i = 0; i < n_q; ++i) {
            if (i + AHEAD < n_q) fetch<1>(dst + (i + AHEAD) * dqs, dk * sizeof(T));
            std::memset(dst + i * dqs, 0, dk * sizeof(T));
          }
        } else {
          sc.q.hold(q, h), sc.go.hold(go, h);
          dqh = sc.dq.zeros(n_q, dk), dqs = dk;  // this block's dq of head h, packed
        }
        const HeadGrad<S> g = head_grad(sc.q, sc.go, h, dqh, dqs);
        (edge ? key_pass<S, I, true, false> : key_pass<S, I, false, false>)(
            c0, c1, tptr, rt, pt, g, static_cast<T>(scale), drop, h, sc.ce, sc.a, sc.sums, logits<T>(softcap, scale, sk, h));
        if (in_place_dq) return;
        if (rounded) {
          for (int64_t i = 0; i < n_q; ++i) {
            if (i + AHEAD < n_q) fetch<1>(rounded + (i + AHEAD) * H * dk, dk * sizeof(S));
            convert(rounded + i * H * dk, dqh + i * dk, dk);
          }
          return;
        }
        for (int64_t i = 0; i < n_q; ++i) {
          if (i + AHEAD < n_q) fetch<1>(dst + (i + AHEAD) * H * dk, dk * sizeof(T));
          std::memcpy(dst + i * H * dk, dqh + i * dk, dk * sizeof(T));
        }
      });
    };
    if (row_t.scalar_type() == at::kInt)
      run(row_t.data_ptr<int32_t>(), perm.defined() ? perm.data_ptr<int32_t>() : nullptr);
    else
      run(row_t.data_ptr<int64_t>(), perm.defined() ? perm.data_ptr<int64_t>() : nullptr);
    if constexpr (is_half_v<S>) if (query_pass && !fuse_q) {
      // Over row blocks of every head, each block reading a packed copy of its head's k (Slab::hold)
      // unless it reads few of its rows (in_place). Tried and dropped (bfloat16 backward, random 1 %,
      // H = 8, as above): k read in place through its row stride (the pass about 1.5x slower, backward
      // 32.7 -> 35.2 ms), all heads of a row at once from the caller's layout, where a key's rows of
      // all heads are adjacent (31.0 -> 32.9 ms), and ad by key-pass position (written in runs) read
      // through the inverse of perm_t (key pass 28.1 -> 25.2 ms, query pass 3.5 -> 8.3 ms: 4-byte
      // reads all over ad cost more than the writes saved). Run right after each head's key pass
      // instead (fuse_q, one key block), the pass took the same time (29.7 / 29.7 ms).
      struct QScratch {
        Slab<S> k;
      };
      const int64_t* cp = cv.data_ptr<int64_t>();
      const int64_t qblocks = std::min(n_q, 4 * int64_t(at::get_num_threads()));
      const int64_t qruns = same_head_blocks(H, qblocks);
      for_head_blocks<QScratch>(ptr, n_q, H, qblocks, [&](QScratch& sc, int64_t h, int64_t, int64_t r0, int64_t r1) {
        if (in_place((ptr[r1] - ptr[r0]) * qruns, n_k))
          sc.k.view(k, h);
        else
          sc.k.hold(k, h);
        query_rows<S>(r0, r1, ptr, cp, ad.data_ptr<T>() + h * E, sc.k.rows, sc.k.stride, dk, head<S>(dq, h),
                      dq.stride(0));
      });
    }
  });
  if (extra.defined()) dq.add_(extra.sum(0));
  if (sums.defined())  // in the float32 path's order: block 0 plus the sum of the others
    dq.copy_(blocks > 1 ? sums[0].add_(sums.slice(0, 1).sum(0)) : sums[0]);
  std::vector<at::Tensor> grads{dq, dkt, dvt, grad_bias ? ds : at::empty({0}, q.options().dtype(ct))};
  if (sk.defined()) grads.push_back(sink_grads(sk, lse, delta, n_q));
  if (edge) {
    at::Tensor dqe = qe.defined() ? cache.empty({n_q, H, F}, ct) : at::empty({0}, q.options().dtype(ct));
    at::Tensor de = cache.empty({E, F}, ct);
    // Each edge's position in the key pass (the inverse of perm_t), where as and pw are read.
    at::Tensor pos_of = cache.empty({E}, perm);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "tgattn_fused_edge_grads", [&] {
      using T = compute_t<scalar_t>;
      const auto grads = [&](const auto* pt, auto* inv) {
        at::parallel_for(0, E, int64_t(1) << 14, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) inv[pt[t]] = t;
        });
        edge_grads<scalar_t>(ptr, n_q, H, E, FeatureRows<scalar_t>{feat.data_ptr<scalar_t>(), fperm, F}, inv,
                             qe.defined() ? qe.data_ptr<T>() : nullptr, gsum.defined() ? gsum.data_ptr<T>() : nullptr,
                             as.defined() ? as.data_ptr<T>() : nullptr, pw.defined() ? pw.data_ptr<T>() : nullptr,
                             qe.defined() ? dqe.data_ptr<T>() : nullptr, de.data_ptr<T>());
      };
      if (perm.scalar_type() == at::kInt)
        grads(perm.data_ptr<int32_t>(), pos_of.data_ptr<int32_t>());
      else
        grads(perm.data_ptr<int64_t>(), pos_of.data_ptr<int64_t>());
    });
    grads.push_back(dqe), grads.push_back(de);
  }
  return grads;
}

// A stable counting sort of E entries by key c[e] in [0, n): fills ptr [n + 1] (zeroed) with the
// pointer of the keys and calls place(e, t) with the sorted position t of each entry e, in the
// order of the entries. No array besides ptr: key j's next position is kept in ptr[j + 1], which
// holds its start after the prefix sum of the counts stored one place further on (key j's count
// in ptr[j + 2]; the last key's count is never needed), and ends as the start of key j + 1.
template <typename P, typename C, typename Place>
void counting_sort(const C* c, int64_t E, int64_t n, P* ptr, const Place& place) {
  for (int64_t e = 0; e < E; ++e)
    if (c[e] + 2 <= n) ++ptr[c[e] + 2];
  for (int64_t j = 2; j <= n; ++j) ptr[j] += ptr[j - 1];
  for (int64_t e = 0; e < E; ++e) place(e, int64_t(ptr[c[e] + 1]++));
}

// The transposed pattern of rowptr / col for the backward pass: (colptr [n_k + 1], row_t [E],
// perm_t [E] or empty) with row_t[t] the query and perm_t[t] the edge of the t-th edge in
// (source, target) order, all three int32 when `narrow` (half the memory) else int64. A stable
// counting sort on the keys, O(E + n_k) time and nothing besides its outputs: edges sorted by
// (target, source), sorted stably by source alone, are in (source, target) order.
std::vector<at::Tensor> transpose_rows(const at::Tensor& rowptr, const at::Tensor& col, int64_t n_k, bool with_perm,
                                       bool narrow) {
  const int64_t n_q = rowptr.numel() - 1, E = col.numel();
  check_structure(rowptr, col, n_q, n_k, "rowptr / col");
  TORCH_CHECK(col.scalar_type() == at::kLong, "tgattn transpose_rows: col must be int64");
  TORCH_CHECK(!narrow || (E < (int64_t(1) << 31) && n_q < (int64_t(1) << 31)),
              "tgattn transpose_rows: too many edges or queries for int32 indices");
  const int64_t* c = col.data_ptr<int64_t>();
  const auto opts = col.options().dtype(narrow ? at::kInt : at::kLong);
  at::Tensor colptr = at::zeros({n_k + 1}, opts);
  at::Tensor row_t = at::empty({E}, opts), perm = at::empty({with_perm ? E : 0}, opts);
  const RowPtr ptr = row_ptr(rowptr);
  const auto fill = [&](auto* cp, auto* rt, auto* pt) {
    int64_t i = 0;  // the query of edge e: edges come by query
    counting_sort(c, E, n_k, cp, [&](int64_t e, int64_t t) {
      while (ptr[i + 1] <= e) ++i;
      rt[t] = i;
      if (pt) pt[t] = e;
    });
  };
  if (narrow)
    fill(colptr.data_ptr<int32_t>(), row_t.data_ptr<int32_t>(), with_perm ? perm.data_ptr<int32_t>() : nullptr);
  else
    fill(colptr.data_ptr<int64_t>(), row_t.data_ptr<int64_t>(), with_perm ? perm.data_ptr<int64_t>() : nullptr);
  return {colptr, row_t, perm};
}

// A measuring stick, not attention (the benchmark's `floor` peer): out[h, i] = sum over the
// edges e of row i of a[idx[e], h] + b[idx[e], h], visiting rows, heads and edges in the order
// the row passes above do. Its time is what reading the gathered rows costs on this machine.
at::Tensor gather_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ptr_t, const at::Tensor& idx_t) {
  check_inputs(a, b, b);
  TORCH_CHECK(a.sizes() == b.sizes(), "tgattn gather_rows: a and b must have one shape");
  const int64_t H = a.size(1), n = a.size(0), d = a.size(2), rows = ptr_t.size(0) - 1;
  check_structure(ptr_t, idx_t, rows, n, "ptr / idx");
  TORCH_CHECK(idx_t.scalar_type() == at::kLong, "tgattn gather_rows: idx must be int64");
  at::Tensor out = at::zeros({rows, H, d}, a.options());
  const RowPtr ptr = row_ptr(ptr_t);
  const int64_t* idx = idx_t.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.scalar_type(), "tgattn_gather_rows", [&] {
    struct None {};
    for_head_blocks<None>(ptr, rows, H, 4 * at::get_num_threads(), [&](None&, int64_t h, int64_t, int64_t r0, int64_t r1) {
      std::vector<compute_t<scalar_t>> one;
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t e0 = ptr[i], deg = ptr[i + 1] - e0;
        one.assign(deg, 1);
        scalar_t* o = head<scalar_t>(out, h) + i * out.stride(0);
        accumulate(o, one.data(), Rows<const scalar_t>{head<scalar_t>(a, h), idx + e0, a.stride(0)}, deg, d);
        accumulate(o, one.data(), Rows<const scalar_t>{head<scalar_t>(b, h), idx + e0, b.stride(0)}, deg, d);
      }
    });
  });
  return out;
}

// The kept edges [H, E] of the dropout with this seed: what the kernels multiply by
// 1 / (1 - p), for tests and for recomputing a double backward.
at::Tensor dropout_keep(int64_t heads, int64_t edges, double dropout_p, int64_t seed) {
  const Dropout drop{dropout_p, uint64_t(seed)};
  at::Tensor keep = at::empty({heads, edges}, at::TensorOptions().dtype(at::kBool));
  bool* kp = keep.data_ptr<bool>();
  at::parallel_for(0, heads * edges, 1 << 14, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) kp[t] = drop.keep(t / edges, t % edges);
  });
  return keep;
}

// Edges in (target, source) order: (perm, src, dst, duplicates, rowptr) of the sorted edges, perm empty
// when they come sorted already, duplicates a bool scalar (some edge appears twice), rowptr [n_q + 1] the
// rows' pointer (int32 below 2^31 edges, else int64; the second sort's prefix sums, which PyTorch ops
// made again from dst in 30 us on a molecule batch). Two stable counting sorts (by source, then by
// target), O(E + n_q + n_k), and one pass over the edges when they are sorted: the analysis of every
// new edge set.
std::vector<at::Tensor> sort_edges(const at::Tensor& src, const at::Tensor& dst, int64_t n_q, int64_t n_k) {
  TORCH_CHECK(src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.dim() == 1 &&
                  src.sizes() == dst.sizes() && src.device().is_cpu() && dst.device().is_cpu(),
              "tgattn sort_edges: src and dst must be int64 CPU vectors of one length");
  const at::Tensor s = src.contiguous(), t = dst.contiguous();
  const int64_t E = s.size(0);
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t* tp = t.data_ptr<int64_t>();
  bool ok = true, sorted = true;
  for (int64_t e = 0; e < E; ++e) {
    ok &= (sp[e] >= 0) & (sp[e] < n_k) & (tp[e] >= 0) & (tp[e] < n_q);
    if (e) sorted &= (tp[e - 1] < tp[e]) | ((tp[e - 1] == tp[e]) & (sp[e - 1] <= sp[e]));
  }
  TORCH_CHECK(ok, "tgattn sort_edges: an index outside [0, n_k) x [0, n_q)");
  const auto repeats = [&](const int64_t* sp, const int64_t* tp) {
    bool dup = false;
    for (int64_t e = 1; e < E; ++e) dup |= (sp[e] == sp[e - 1]) & (tp[e] == tp[e - 1]);
    return at::scalar_tensor(dup, at::TensorOptions().dtype(at::kBool));
  };
  const bool narrow = E < (int64_t(1) << 31);
  at::Tensor rowptr = at::empty({n_q + 1}, s.options().dtype(narrow ? at::kInt : at::kLong));
  // The pointer from the starts of the rows (start[i], i <= n_q), before the placement moves them.
  const auto pointer = [&](const std::vector<int64_t>& start) {
    if (narrow)
      std::copy(start.begin(), start.begin() + n_q + 1, rowptr.data_ptr<int32_t>());
    else
      std::copy(start.begin(), start.begin() + n_q + 1, rowptr.data_ptr<int64_t>());
  };
  std::vector<int64_t> by_src(sorted ? 0 : E), start(std::max(n_q, n_k) + 1);
  const auto count_rows = [&] {
    std::fill(start.begin(), start.begin() + n_q + 1, 0);
    for (int64_t e = 0; e < E; ++e) ++start[tp[e] + 1];
    for (int64_t i = 0; i < n_q; ++i) start[i + 1] += start[i];
    pointer(start);
  };
  if (sorted) {
    count_rows();
    return {at::empty({0}, s.options()), s.clone(), t.clone(), repeats(sp, tp), rowptr};
  }
  std::fill(start.begin(), start.begin() + n_k + 1, 0);
  for (int64_t e = 0; e < E; ++e) ++start[sp[e] + 1];
  for (int64_t j = 0; j < n_k; ++j) start[j + 1] += start[j];
  for (int64_t e = 0; e < E; ++e) by_src[start[sp[e]]++] = e;
  count_rows();
  at::Tensor perm = at::empty({E}, s.options()), ss = at::empty({E}, s.options()), ts = at::empty({E}, s.options());
  int64_t* pp = perm.data_ptr<int64_t>();
  for (int64_t r = 0; r < E; ++r) pp[start[tp[by_src[r]]]++] = by_src[r];
  int64_t* ssp = ss.data_ptr<int64_t>();
  int64_t* tsp = ts.data_ptr<int64_t>();
  for (int64_t r = 0; r < E; ++r) ssp[r] = sp[pp[r]], tsp[r] = tp[pp[r]];
  return {perm, ss, ts, repeats(ssp, tsp), rowptr};
}

// Whether edge_index [2, E] (int64 or int32, any strides) still holds the sorted edges src, dst [E] (int64)
// of its analysis: src[t] = edge_index[0, perm[t]] (perm [E] int64, or empty for edges that came sorted).
// The analysis cache's check of every hit, in one pass: gathering edge_index through perm and comparing
// the copies took 84 us on a molecule batch, nearly what analysing the edges anew takes.
bool same_edges(const at::Tensor& edge_index, const at::Tensor& perm, const at::Tensor& src, const at::Tensor& dst) {
  const int64_t E = src.numel();
  TORCH_CHECK(edge_index.dim() == 2 && edge_index.size(0) == 2 && edge_index.size(1) == E && edge_index.device().is_cpu() &&
                  (edge_index.scalar_type() == at::kLong || edge_index.scalar_type() == at::kInt) &&
                  src.scalar_type() == at::kLong && dst.scalar_type() == at::kLong && src.is_contiguous() &&
                  dst.is_contiguous() && dst.numel() == E && (perm.numel() == 0 || (perm.numel() == E &&
                  perm.scalar_type() == at::kLong && perm.is_contiguous())),
              "tgattn same_edges: edge_index [2, E] (int64 or int32) and contiguous int64 src, dst and perm [E]");
  const int64_t* pp = perm.numel() ? perm.data_ptr<int64_t>() : nullptr;
  const int64_t *sp = src.data_ptr<int64_t>(), *tp = dst.data_ptr<int64_t>();
  const int64_t s0 = edge_index.stride(0), s1 = edge_index.stride(1);
  std::atomic<bool> same{true};
  const auto compare = [&](const auto* ei) {
    at::parallel_for(0, E, int64_t(1) << 16, [&](int64_t r0, int64_t r1) {
      for (int64_t t = r0; t < r1 && same; t += 4096) {  // stop at the first block that differs
        bool here = true;
        for (int64_t r = t; r < std::min(r1, t + 4096); ++r) {
          const int64_t e = pp ? pp[r] : r;
          here &= (int64_t(ei[e * s1]) == sp[r]) & (int64_t(ei[s0 + e * s1]) == tp[r]);
        }
        if (!here) same = false;
      }
    });
    return bool(same);
  };
  if (pp) {
    bool ok = true;
    for (int64_t r = 0; r < E; ++r) ok &= (pp[r] >= 0) & (pp[r] < E);
    TORCH_CHECK(ok, "tgattn same_edges: perm out of range");
  }
  return edge_index.scalar_type() == at::kLong ? compare(edge_index.data_ptr<int64_t>())
                                               : compare(edge_index.data_ptr<int32_t>());
}

// The edges of edge_index [2, E] (int64) without their self-loops, then one loop (i, i) per node i < n:
// the edge set of a conv with add_self_loops=True (PyG's remove_self_loops, then add_self_loops), in
// one pass and one allocation (PyTorch ops, through a boolean mask, took 100-270 us a molecule batch).
// Refuses a node id outside [0, n) (the caller names it).
at::Tensor self_loops(const at::Tensor& edge_index, int64_t n) {
  TORCH_CHECK(edge_index.dim() == 2 && edge_index.size(0) == 2 && edge_index.scalar_type() == at::kLong &&
                  edge_index.device().is_cpu(),
              "tgattn self_loops: edge_index must be an int64 CPU tensor [2, E]");
  const at::Tensor ei = edge_index.contiguous();
  const int64_t E = ei.size(1);
  const int64_t *sp = ei.data_ptr<int64_t>(), *tp = sp + E;
  bool ok = true;
  int64_t loops = 0;
  for (int64_t e = 0; e < E; ++e) {
    ok &= (sp[e] >= 0) & (sp[e] < n) & (tp[e] >= 0) & (tp[e] < n);
    loops += sp[e] == tp[e];
  }
  TORCH_CHECK(ok, "tgattn self_loops: a node id outside [0, ", n, ")");
  const int64_t kept = E - loops;
  at::Tensor out = at::empty({2, kept + n}, ei.options());
  int64_t *os = out.data_ptr<int64_t>(), *ot = os + kept + n;
  if (loops == 0) {
    std::copy(sp, sp + E, os), std::copy(tp, tp + E, ot);
  } else {
    for (int64_t e = 0, t = 0; e < E; ++e)
      if (sp[e] != tp[e]) os[t] = sp[e], ot[t] = tp[e], ++t;
  }
  for (int64_t i = 0; i < n; ++i) os[kept + i] = ot[kept + i] = i;
  return out;
}

// The transposed pattern by a stable counting sort on the keys, O(E + n_k) instead of an
// argsort: edges come sorted by (target, source), so a stable sort by source alone orders them
// by (source, target). Returns (colptr [n_k + 1], perm [E]) with perm[t] = the t-th edge of
// the transposed order.
std::vector<at::Tensor> transpose(const at::Tensor& col, int64_t n_k) {
  TORCH_CHECK(col.scalar_type() == at::kLong && col.dim() == 1 && col.is_contiguous() && col.device().is_cpu(),
              "tgattn transpose: col must be a contiguous int64 CPU vector");
  const int64_t E = col.size(0);
  const int64_t* c = col.data_ptr<int64_t>();
  bool ok = true;
  for (int64_t e = 0; e < E; ++e) ok &= (c[e] >= 0) & (c[e] < n_k);
  TORCH_CHECK(ok, "tgattn transpose: col holds an index outside [0, ", n_k, ")");
  at::Tensor colptr = at::zeros({n_k + 1}, col.options());
  at::Tensor perm = at::empty({E}, col.options());
  int64_t* pp = perm.data_ptr<int64_t>();
  counting_sort(c, E, n_k, colptr.data_ptr<int64_t>(), [&](int64_t e, int64_t t) { pp[t] = e; });
  return {colptr, perm};
}

// The per-head maps of the edge terms (TransformerConv's W_E, issue 30) around the kernel: W [H, d, F]
// maps head h's F features to its d channels. head_map: y_ih = W_h^T x_ih [N, H, F] for x [N, H, d] (the
// key term's qe = W_h^T q_i, the value term's gradient W_h^T dO_i); head_map_add: base_ih + W_h s_ih
// [N, H, d] for s [N, H, F] (the value term's W_h s_i, dq's W_h dqe_i); head_outer: sum_i x_ih s_ih^T
// [H, d, F] (W's gradients). x rows through their strides (a contiguous last dimension), s and W
// contiguous; float and double. As matrix products with the block-diagonal [H d, H F] matrix each did H
// times the work: on a molecule batch (3,040 x 4 x 16 by F = 4, one thread, warm caches) 80-98 us a
// product, six per layer, against 25 us (head_map, head_outer) and 30-38 us (head_map_add) here.
// d = 8 or 16 with up to 8 features run with W_h in registers (SmallMaps); other sizes in general loops
// of explicit vectors, rows of one head side by side: head_map broadcasts x_ih[c] against W_h's row c
// padded to whole vectors, head_map_add and head_outer broadcast s_ih[f] against d channels (a scalar
// tail where d is not a whole number of vectors).
template <int N>
using count_t = std::integral_constant<int, N>;  // a count as a type, for generic lambdas (and no comma in macros)

// A broadcast (vec_t<T>{} + x would add 0 to every lane).
inline vec_t<float> splat(float x) {
#if defined(__AVX__)
  return _mm256_set1_ps(x);
#else
  return vec_t<float>{x, x, x, x, x, x, x, x};
#endif
}
inline vec_t<double> splat(double x) {
#if defined(__AVX__)
  return _mm256_set1_pd(x);
#else
  return vec_t<double>{x, x, x, x};
#endif
}

// W [H, d, F] with each row of F padded with zeros to FP = nb * L numbers (nb vectors).
template <typename T>
std::vector<T> padded_rows(const T* w, int64_t rows, int64_t F, int64_t FP) {
  std::vector<T> out(rows * FP, T(0));
  for (int64_t r = 0; r < rows; ++r) std::copy(w + r * F, w + (r + 1) * F, out.data() + r * FP);
  return out;
}

// Rows i .. i + R - 1 of head h (rows of o, base and s `os`, `ss` apart): o_r[c] = base_r[c] (or 0) +
// sum_f s_r[f] wt[f * d + c], wt = W_h^T [F, d]. R rows share each load of wt and run R chains side by side.
template <int R, typename T>
inline void map_add_rows(T* o, const T* base, int64_t os, const T* s, int64_t ss, const T* wt, int64_t d, int64_t F) {
  constexpr int64_t L = Vec<T>::L;
  int64_t c = 0;
  for (; c + L <= d; c += L) {
    vec_t<T> acc[R];
    for (int r = 0; r < R; ++r) acc[r] = base ? load(base + r * os + c) : vec_t<T>{};
    for (int64_t f = 0; f < F; ++f) {
      const vec_t<T> wv = load(wt + f * d + c);
      for (int r = 0; r < R; ++r) acc[r] = madd(splat(s[r * ss + f]), wv, acc[r]);
    }
    for (int r = 0; r < R; ++r) store(o + r * os + c, acc[r]);
  }
  for (; c < d; ++c)
    for (int r = 0; r < R; ++r) {
      T acc = base ? base[r * os + c] : T(0);
      for (int64_t f = 0; f < F; ++f) acc = madd(s[r * ss + f], wt[f * d + c], acc);
      o[r * os + c] = acc;
    }
}

// acc[f * d + c] += sum_r s_r[f] x_r[c] over R rows (x and s rows `xs`, `ss` apart): the outer products of
// R rows added to a sum kept transposed, [F, d], each of its vectors loaded and stored once for R rows.
template <int R, typename T>
inline void outer_rows(T* acc, const T* x, int64_t xs, const T* s, int64_t ss, int64_t d, int64_t F) {
  constexpr int64_t L = Vec<T>::L;
  for (int64_t f = 0; f < F; ++f) {
    T* a = acc + f * d;
    int64_t c = 0;
    for (; c + L <= d; c += L) {
      vec_t<T> v = load(a + c);
      for (int r = 0; r < R; ++r) v = madd(splat(s[r * ss + f]), load(x + r * xs + c), v);
      store(a + c, v);
    }
    for (; c < d; ++c)
      for (int r = 0; r < R; ++r) a[c] = madd(s[r * ss + f], x[r * xs + c], a[c]);
  }
}

// Head h's maps with W_h in registers, for d = ND channels (8 or 16) and NF <= 8 features: the rows of
// the head one after the other, NB = ND / L vectors a row. head_map's dots <x_i, W_h[:, f]> are summed
// across lanes eight at a time (hsum8), 8 / NF rows a group; head_outer keeps its NF x NB sums in
// registers over all rows. Other sizes take the general loops above.
template <int ND, int NF, typename T>
struct SmallMaps {
  static constexpr int L = Vec<T>::L, NB = ND / L, G = 8 / NF;  // G rows per hsum8
  vec_t<T> wt[NF][NB];  // W_h^T: wt[f][b] lanes = W_h[b L + l, f]

  explicit SmallMaps(const T* w) {  // w: W_h [d, F]
    for (int f = 0; f < NF; ++f)
      for (int b = 0; b < NB; ++b)
        for (int l = 0; l < L; ++l) wt[f][b][l] = w[(b * L + l) * NF + f];
  }

  // y_i = W_h^T x_i for rows i0 .. i1 - 1 (x rows xs apart, y rows ys apart).
  void map(const T* x, int64_t xs, T* y, int64_t ys, int64_t i0, int64_t i1) const {
    int64_t i = i0;
    for (; i + G <= i1; i += G) group<G>(x + i * xs, xs, y + i * ys, ys);
    for (; i < i1; ++i) group<1>(x + i * xs, xs, y + i * ys, ys);
  }

  template <int R>
  __attribute__((always_inline)) void group(const T* x, int64_t xs, T* y, int64_t ys) const {
    vec_t<T> acc[8];
    for (int r = 0; r < R; ++r) {
      vec_t<T> xv[NB];
      for (int b = 0; b < NB; ++b) xv[b] = load(x + r * xs + b * L);
      for (int f = 0; f < NF; ++f) {
        vec_t<T> a = xv[0] * wt[f][0];
        for (int b = 1; b < NB; ++b) a = madd(xv[b], wt[f][b], a);
        acc[r * NF + f] = a;
      }
    }
    for (int k = R * NF; k < 8; ++k) acc[k] = vec_t<T>{};
    T sums[8];
    hsum8<T>(acc, sums);
    for (int r = 0; r < R; ++r)
      for (int f = 0; f < NF; ++f) y[r * ys + f] = sums[r * NF + f];
  }

  // o_i = base_i (or 0) + W_h s_i for rows i0 .. i1 - 1 (o and base rows os apart, s rows ss apart).
  void map_add(T* o, const T* base, int64_t os, const T* s, int64_t ss, int64_t i0, int64_t i1) const {
    for (int64_t i = i0; i < i1; ++i) {
      const T* sr = s + i * ss;
      vec_t<T> acc[NB];
      for (int b = 0; b < NB; ++b) acc[b] = base ? load(base + i * os + b * L) : vec_t<T>{};
      for (int f = 0; f < NF; ++f) {
        const vec_t<T> sf = splat(sr[f]);
        for (int b = 0; b < NB; ++b) acc[b] = madd(sf, wt[f][b], acc[b]);
      }
      for (int b = 0; b < NB; ++b) store(o + i * os + b * L, acc[b]);
    }
  }
};

// g = sum_i x_i s_i^T [ND, NF] over rows 0 .. n - 1 of head h, the sums in registers.
template <int ND, int NF, typename T>
void small_outer(const T* x, int64_t xs, const T* s, int64_t ss, int64_t n, T* g) {
  constexpr int L = Vec<T>::L, NB = ND / L;
  vec_t<T> acc[NF][NB];
  for (int f = 0; f < NF; ++f)
    for (int b = 0; b < NB; ++b) acc[f][b] = vec_t<T>{};
  for (int64_t i = 0; i < n; ++i) {
    vec_t<T> xv[NB];
    for (int b = 0; b < NB; ++b) xv[b] = load(x + i * xs + b * L);
    for (int f = 0; f < NF; ++f) {
      const vec_t<T> sf = splat(s[i * ss + f]);
      for (int b = 0; b < NB; ++b) acc[f][b] = madd(sf, xv[b], acc[f][b]);
    }
  }
  for (int f = 0; f < NF; ++f)
    for (int b = 0; b < NB; ++b)
      for (int l = 0; l < L; ++l) g[(b * L + l) * NF + f] = acc[f][b][l];
}

// Calls fn(count_t<ND>, count_t<NF>) where d is 8 or 16 and 1 <= F <= 8; returns false (nothing called) otherwise.
template <typename Fn>
bool small_maps(int64_t d, int64_t F, const Fn& fn) {
  const auto with_d = [&](auto nd) {
    switch (F) {
      case 1: fn(nd, count_t<1>{}); return true;
      case 2: fn(nd, count_t<2>{}); return true;
      case 3: fn(nd, count_t<3>{}); return true;
      case 4: fn(nd, count_t<4>{}); return true;
      case 5: fn(nd, count_t<5>{}); return true;
      case 6: fn(nd, count_t<6>{}); return true;
      case 7: fn(nd, count_t<7>{}); return true;
      case 8: fn(nd, count_t<8>{}); return true;
      default: return false;
    }
  };
  if (d == 8) return with_d(count_t<8>{});
  if (d == 16) return with_d(count_t<16>{});
  return false;
}

// x [N, H, n] against W [H, d, F]: n is W's size w_dim (d for head_map, F for head_map_add).
void check_maps(const at::Tensor& x, const at::Tensor& w, int64_t w_dim, const char* what) {
  TORCH_CHECK(rows_ok(x) && w.dim() == 3 && w.device().is_cpu() && w.size(0) == x.size(1) && w.size(w_dim) == x.size(2) &&
                  w.scalar_type() == x.scalar_type() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "tgattn fused: ", what);
}

at::Tensor head_map(const at::Tensor& x, const at::Tensor& w) {
  check_maps(x, w, 1, "head_map needs x [N, H, d] and W [H, d, F] of one dtype (float or double)");
  const int64_t N = x.size(0), H = x.size(1), d = x.size(2), F = w.size(2);
  const at::Tensor wc = w.contiguous();
  at::Tensor y = at::empty({N, H, F}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tgattn_head_map", [&] {
    using T = scalar_t;
    constexpr int64_t L = Vec<T>::L;
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    const int64_t xs = x.stride(0), xh = x.stride(1);
    const bool small = small_maps(d, F, [&](auto nd, auto nf) {
      constexpr int ND = decltype(nd)::value, NF = decltype(nf)::value;
      at::parallel_for(0, N, 256, [&](int64_t i0, int64_t i1) {
        for (int64_t h = 0; h < H; ++h)
          SmallMaps<ND, NF, T>(wc.data_ptr<T>() + h * d * F).map(xp + h * xh, xs, yp + h * F, H * F, i0, i1);
      });
    });
    if (small) return;
    const int64_t nb = (F + L - 1) / L, FP = nb * L;
    const std::vector<T> wp = padded_rows(wc.data_ptr<T>(), H * d, F, FP);
    // R rows of head h at once: R chains side by side, sharing each load of W_h's row c.
    const auto rows = [&](auto rr, int64_t i, int64_t h) {
      constexpr int R = decltype(rr)::value;
      const T* wh = wp.data() + h * d * FP;
      for (int64_t blk = 0; blk < nb; ++blk) {
        vec_t<T> acc[R];
        for (int r = 0; r < R; ++r) acc[r] = vec_t<T>{};
        for (int64_t c = 0; c < d; ++c) {
          const vec_t<T> wv = load(wh + c * FP + blk * L);
          for (int r = 0; r < R; ++r) acc[r] = madd(splat(xp[(i + r) * xs + h * xh + c]), wv, acc[r]);
        }
        const int64_t n = std::min(L, F - blk * L);
        for (int r = 0; r < R; ++r) {
          T* yr = yp + ((i + r) * H + h) * F + blk * L;
          for (int64_t l = 0; l < n; ++l) yr[l] = acc[r][l];
        }
      }
    };
    at::parallel_for(0, N, 256, [&](int64_t i0, int64_t i1) {
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8)
        for (int64_t h = 0; h < H; ++h) rows(count_t<8>{}, i, h);
      for (; i < i1; ++i)
        for (int64_t h = 0; h < H; ++h) rows(count_t<1>{}, i, h);
    });
  });
  return y;
}

// inplace: the sums go into base itself (contiguous), which a caller that owns it (a kernel's fresh output)
// saves a buffer and a pass over fresh memory with: each row is read before it is written.
at::Tensor head_map_add(const c10::optional<at::Tensor>& base, const at::Tensor& s, const at::Tensor& w, bool inplace) {
  check_maps(s, w, 2, "head_map_add needs s [N, H, F] and W [H, d, F] of one dtype (float or double)");
  const int64_t N = s.size(0), H = s.size(1), d = w.size(1), F = w.size(2);
  TORCH_CHECK(!base.has_value() || (base->sizes() == at::IntArrayRef{N, H, d} &&
                                    base->scalar_type() == s.scalar_type() && base->device().is_cpu()),
              "tgattn fused: head_map_add's base must be [N, H, d] of the dtype of s");
  TORCH_CHECK(!inplace || (base.has_value() && base->is_contiguous()), "tgattn fused: head_map_add in place needs a contiguous base");
  const at::Tensor sc = s.contiguous(), wc = w.contiguous(), wt = w.transpose(1, 2).contiguous();  // W_h^T [F, d]
  const at::Tensor bc = base.has_value() ? base->contiguous() : at::Tensor();
  at::Tensor out = inplace ? bc : at::empty({N, H, d}, s.options());
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "tgattn_head_map_add", [&] {
    const scalar_t *sp = sc.data_ptr<scalar_t>(), *wp = wt.data_ptr<scalar_t>();
    const scalar_t* bp = bc.defined() ? bc.data_ptr<scalar_t>() : nullptr;
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t os = H * d, ss = H * F;
    const bool small = small_maps(d, F, [&](auto nd, auto nf) {
      constexpr int ND = decltype(nd)::value, NF = decltype(nf)::value;
      const scalar_t* wn = wc.data_ptr<scalar_t>();
      at::parallel_for(0, N, 256, [&](int64_t i0, int64_t i1) {
        for (int64_t h = 0; h < H; ++h)
          SmallMaps<ND, NF, scalar_t>(wn + h * d * F)
              .map_add(op + h * d, bp ? bp + h * d : nullptr, os, sp + h * F, ss, i0, i1);
      });
    });
    if (small) return;
    at::parallel_for(0, N, 256, [&](int64_t i0, int64_t i1) {
      int64_t i = i0;
      for (; i + 8 <= i1; i += 8)
        for (int64_t h = 0; h < H; ++h)
          map_add_rows<8>(op + i * os + h * d, bp ? bp + i * os + h * d : nullptr, os, sp + i * ss + h * F, ss,
                          wp + h * F * d, d, F);
      for (; i < i1; ++i)
        for (int64_t h = 0; h < H; ++h)
          map_add_rows<1>(op + i * os + h * d, bp ? bp + i * os + h * d : nullptr, os, sp + i * ss + h * F, ss,
                          wp + h * F * d, d, F);
    });
  });
  return out;
}

at::Tensor head_outer(const at::Tensor& x, const at::Tensor& s) {
  TORCH_CHECK(rows_ok(x) && s.dim() == 3 && s.size(0) == x.size(0) && s.size(1) == x.size(1) &&
                  s.scalar_type() == x.scalar_type() && s.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble),
              "tgattn fused: head_outer needs x [N, H, d] and s [N, H, F] of one dtype (float or double)");
  const int64_t N = x.size(0), H = x.size(1), d = x.size(2), F = s.size(2);
  const at::Tensor sc = s.contiguous();
  at::Tensor g = at::empty({H, d, F}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "tgattn_head_outer", [&] {
    using T = scalar_t;
    const T *xp = x.data_ptr<T>(), *sp = sc.data_ptr<T>();
    const int64_t xs = x.stride(0), xh = x.stride(1);
    T* gp = g.data_ptr<T>();
    at::parallel_for(0, H, 1, [&](int64_t h0, int64_t h1) {
      std::vector<T> acc(F * d);  // the sum transposed, [F, d]: rows of d channels
      for (int64_t h = h0; h < h1; ++h) {
        const bool small = small_maps(d, F, [&](auto nd, auto nf) {
          small_outer<decltype(nd)::value, decltype(nf)::value, T>(xp + h * xh, xs, sp + h * F, H * F, N,
                                                                   gp + h * d * F);
        });
        if (small) continue;
        std::fill(acc.begin(), acc.end(), T(0));
        int64_t i = 0;
        for (; i + 4 <= N; i += 4)
          outer_rows<4>(acc.data(), xp + i * xs + h * xh, xs, sp + (i * H + h) * F, H * F, d, F);
        for (; i < N; ++i) outer_rows<1>(acc.data(), xp + i * xs + h * xh, xs, sp + (i * H + h) * F, H * F, d, F);
        for (int64_t c = 0; c < d; ++c)
          for (int64_t f = 0; f < F; ++f) gp[(h * d + c) * F + f] = acc[f * d + c];
      }
    });
  });
  return g;
}

// TransformerConv's beta gate (issue 30), for a conv's rows out_i (attention) and root_i (root term),
// [N, W] each, and lin_beta's weight w = [w_out, w_root, w_diff] ([3 W]):
//   y_i = out_i + s_i (root_i - out_i),  s_i = sigmoid(<out_i, a> + <root_i, b>),  a = w_out + w_diff, b = w_root - w_diff
// (w^T [o, r, o - r] regrouped: no [N, 3 W] concatenation). In PyTorch ops the forward and backward were
// twelve passes over [N, W] (a molecule batch, N = 3,040, W = 64, one thread: 0.5 ms a layer, more than
// the attention's forward); here one pass each, a row's numbers in registers.
constexpr int64_t GATE_ROWS = 256;  // rows per task; the weight gradient sums blocks in order (any thread count)

template <typename T>
inline T row_dot(const T* x, const T* y, int64_t W) {
  T sum;
  dots(x, Pointers<const T>{&y}, 1, W, &sum);
  return sum;
}

void check_gate(const at::Tensor& out, const at::Tensor& root, const at::Tensor& w) {
  TORCH_CHECK(out.dim() == 2 && out.sizes() == root.sizes() && out.is_contiguous() && root.is_contiguous() &&
                  w.is_contiguous() && w.numel() == 3 * out.size(1) && out.device().is_cpu() &&
                  root.scalar_type() == out.scalar_type() && w.scalar_type() == out.scalar_type() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble),
              "tgattn fused: beta_gate needs contiguous out and root [N, W] and w [3 W] of one dtype (float or double)");
}

// a = w_out + w_diff and b = w_root - w_diff, side by side [2 W].
template <typename T>
std::vector<T> gate_maps(const T* w, int64_t W) {
  std::vector<T> ab(2 * W);
  for (int64_t c = 0; c < W; ++c) ab[c] = w[c] + w[2 * W + c], ab[W + c] = w[W + c] - w[2 * W + c];
  return ab;
}

// Returns (y [N, W], s [N]: the gate of each row, for the backward).
std::vector<at::Tensor> beta_gate(const at::Tensor& out, const at::Tensor& root, const at::Tensor& w) {
  check_gate(out, root, w);
  const int64_t N = out.size(0), W = out.size(1);
  at::Tensor y = at::empty({N, W}, out.options()), gate = at::empty({N}, out.options());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "tgattn_beta_gate", [&] {
    using T = scalar_t;
    const std::vector<T> ab = gate_maps(w.data_ptr<T>(), W);
    const T *op = out.data_ptr<T>(), *rp = root.data_ptr<T>();
    T *yp = y.data_ptr<T>(), *sp = gate.data_ptr<T>();
    at::parallel_for(0, N, GATE_ROWS, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const T *o = op + i * W, *r = rp + i * W;
        const T s = T(1) / (T(1) + std::exp(-(row_dot(o, ab.data(), W) + row_dot(r, ab.data() + W, W))));
        sp[i] = s;
        for (int64_t c = 0; c < W; ++c) yp[i * W + c] = madd(s, r[c] - o[c], o[c]);
      }
    });
  });
  return {y, gate};
}

// The gradients (d_out [N, W], d_root [N, W], d_w [3 W]) from grad = dL/dy and the forward's gate s:
//   dz_i = s_i (1 - s_i) <grad_i, root_i - out_i>,  d_out_i = (1 - s_i) grad_i + dz_i a,
//   d_root_i = s_i grad_i + dz_i b,  d_w = [da, db, da - db] with da = sum_i dz_i out_i, db = sum_i dz_i root_i.
std::vector<at::Tensor> beta_gate_backward(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& root,
                                           const at::Tensor& w, const at::Tensor& gate) {
  check_gate(out, root, w);
  const int64_t N = out.size(0), W = out.size(1);
  TORCH_CHECK(grad.sizes() == out.sizes() && grad.is_contiguous() && grad.scalar_type() == out.scalar_type() &&
                  gate.is_contiguous() && gate.numel() == N && gate.scalar_type() == out.scalar_type(),
              "tgattn fused: beta_gate_backward needs a contiguous grad [N, W] and the gate [N] of out's dtype");
  at::Tensor d_out = at::empty({N, W}, out.options()), d_root = at::empty({N, W}, out.options());
  const int64_t blocks = (N + GATE_ROWS - 1) / GATE_ROWS;
  at::Tensor partial = at::zeros({std::max<int64_t>(blocks, 1), 2 * W}, out.options());
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "tgattn_beta_gate_backward", [&] {
    using T = scalar_t;
    constexpr int64_t L = Vec<T>::L;
    const std::vector<T> ab = gate_maps(w.data_ptr<T>(), W);
    const T *gp = grad.data_ptr<T>(), *op = out.data_ptr<T>(), *rp = root.data_ptr<T>(), *sp = gate.data_ptr<T>();
    T *dop = d_out.data_ptr<T>(), *drp = d_root.data_ptr<T>(), *pp = partial.data_ptr<T>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t blk = b0; blk < b1; ++blk) {
        T *da = pp + blk * 2 * W, *db = da + W;
        for (int64_t i = blk * GATE_ROWS; i < std::min(N, (blk + 1) * GATE_ROWS); ++i) {
          const T *g = gp + i * W, *o = op + i * W, *r = rp + i * W, s = sp[i];
          const T dz = s * (T(1) - s) * (row_dot(g, r, W) - row_dot(g, o, W));
          T *dor = dop + i * W, *drr = drp + i * W;
          int64_t c = 0;
          // Explicit vectors: with the sums da, db and the outputs all behind pointers the compiler
          // kept the loop scalar (the backward took 5x the forward's time).
          const vec_t<T> sv = splat(s), tv = splat(T(1) - s), zv = splat(dz);
          for (; c + L <= W; c += L) {
            const vec_t<T> gv = load(g + c), ov = load(o + c), rv = load(r + c);
            store(dor + c, madd(tv, gv, zv * load(ab.data() + c)));
            store(drr + c, madd(sv, gv, zv * load(ab.data() + W + c)));
            store(da + c, madd(zv, ov, load(da + c)));
            store(db + c, madd(zv, rv, load(db + c)));
          }
          for (; c < W; ++c) {
            dor[c] = madd(T(1) - s, g[c], dz * ab[c]);
            drr[c] = madd(s, g[c], dz * ab[W + c]);
            da[c] = madd(dz, o[c], da[c]);
            db[c] = madd(dz, r[c], db[c]);
          }
        }
      }
    });
  });
  const at::Tensor sums = partial.sum(0);  // [2 W], blocks added in one order whatever the threads
  const at::Tensor da = sums.narrow(0, 0, W), db = sums.narrow(0, W, W);
  return {d_out, d_root, at::cat({da, db, da - db})};
}

}  // namespace

// Schemas here, CPU kernels below: the Python side registers fake (meta) kernels and autograd
// for these ops, so that torch.compile can trace through them.
TORCH_LIBRARY(tgattn_fused, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor rowptr, Tensor col, Tensor? bias, float scale, "
        "float dropout_p, int seed, bool weights, float softcap=0.0, Tensor? sinks=None, Tensor? edge_q=None, "
        "Tensor? edge_features=None, bool edge_sums=False, Tensor? edge_perm=None) -> Tensor[]");
  m.def("backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? weights, "
        "Tensor? grad_weights, Tensor? bias, Tensor rowptr, Tensor colptr, Tensor row_t, Tensor? perm_t, float scale, "
        "float dropout_p, int seed, bool grad_bias, float softcap=0.0, Tensor? sinks=None, Tensor? edge_q=None, "
        "Tensor? edge_features=None, Tensor? edge_sums=None, Tensor? grad_sums=None, Tensor? edge_perm=None, "
        "Tensor? col=None) -> Tensor[]");
  m.def("transpose_rows(Tensor rowptr, Tensor col, int n_k, bool with_perm, bool narrow) -> Tensor[]");
  // No tensor argument to dispatch on and never traced: a catch-all kernel.
  m.def("dropout_keep(int heads, int edges, float dropout_p, int seed) -> Tensor", &dropout_keep);
  m.def("gather_rows(Tensor a, Tensor b, Tensor ptr, Tensor idx) -> Tensor");
  m.def("transpose(Tensor col, int n_k) -> Tensor[]");
  m.def("sort_edges(Tensor src, Tensor dst, int n_q, int n_k) -> Tensor[]");
  m.def("same_edges(Tensor edge_index, Tensor perm, Tensor src, Tensor dst) -> bool");
  m.def("self_loops(Tensor edge_index, int n) -> Tensor");
  m.def("head_map(Tensor x, Tensor w) -> Tensor");
  m.def("head_map_add(Tensor? base, Tensor s, Tensor w, bool inplace=False) -> Tensor");
  m.def("head_outer(Tensor x, Tensor s) -> Tensor");
  m.def("beta_gate(Tensor out, Tensor root, Tensor w) -> Tensor[]");
  m.def("beta_gate_backward(Tensor grad, Tensor out, Tensor root, Tensor w, Tensor gate) -> Tensor[]");
  m.def("cache_info() -> int[]", [] { return BufferCache::get().info(); });
  m.def("half_paths() -> str", &half_paths);
  m.def("cache_limit(int limit) -> ()", [](int64_t limit) {
    TORCH_CHECK(limit >= 0, "tgattn fused: the cache limit must be >= 0 bytes, got ", limit);
    BufferCache::get().set_limit(size_t(limit));
  });
  m.def("empty_cache() -> ()", [] { BufferCache::get().clear(); });
}

TORCH_LIBRARY_IMPL(tgattn_fused, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("gather_rows", &gather_rows);
  m.impl("transpose", &transpose);
  m.impl("transpose_rows", &transpose_rows);
  m.impl("sort_edges", &sort_edges);
  m.impl("same_edges", &same_edges);
  m.impl("self_loops", &self_loops);
  m.impl("head_map", &head_map);
  m.impl("head_map_add", &head_map_add);
  m.impl("head_outer", &head_outer);
  m.impl("beta_gate", &beta_gate);
  m.impl("beta_gate_backward", &beta_gate_backward);
}
