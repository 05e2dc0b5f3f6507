// SIMD vectors and the numerics every kernel shares: loads and stores of float, double, float16 and
// bfloat16 rows, horizontal sums, fused multiply-adds, exp and tanh (see hsum for why one rounding
// sequence everywhere). Internal to each translation unit (an anonymous namespace), as in the single
// fused.cpp these came from: each unit inlines them as that file did.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX__)
#include <immintrin.h>
#endif

namespace tgattn_fused {
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

}  // namespace
}  // namespace tgattn_fused
