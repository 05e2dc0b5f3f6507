// Rows of many nodes at once: prefetching, gathered dot products (dots8, dots), weighted sums of rows
// (accumulate) and their transpose (scatter), the softmax's scaling, and dtype conversions.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <string>

#include "vec.h"

namespace tgattn_fused {
namespace {

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

}  // namespace
}  // namespace tgattn_fused
