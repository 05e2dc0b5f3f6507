// Fused edge attention on the CPU: one pass over each query's CSR row per direction.
//
// The CSR backend runs every step (scores, softmax, aggregation) as a separate PyTorch
// kernel over [E, H] tensors; here a thread walks a block of query rows of one head and,
// for each row, computes its edges' scores, softmax and weighted sum of values while the
// row's numbers are in registers and L1. Nothing of size [E, H, d] is ever formed; the
// forward saves the weights [E, H] for the backward.
//
// Edges are sorted by (target, source): rowptr [n_q + 1], col [E] (the key of each edge).
// The backward's key-side pass walks the transposed pattern (colptr, row_t, perm_t), so each
// thread owns the rows of dk / dv it writes: no atomics, deterministic results.
//
// Where the time goes (n = 4096, 5 % random edges, d = 64): reading each edge's key and
// value rows, 512 bytes per edge and head from all over K and V. The forward takes 1.1-1.3x
// the time of those reads alone (gather_rows below, the benchmark's floor peer); blocking the
// keys so that a block stays in L2 (128 to 4096 keys per block, measured) did not make the
// reads cheaper.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
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

template <typename T>
inline T hsum(vec_t<T> v) {
  T s = 0;
  for (int l = 0; l < Vec<T>::L; ++l) s += v[l];
  return s;
}

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
// a denormal. Scalar std::exp costs a call per edge.
inline vec_t<float> exp_nonpositive(vec_t<float> x) {
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

// x[r] = exp(x[r] - shift) for r < n; returns the sum.
template <typename T>
inline T exp_shifted(T* x, int64_t n, T shift) {
  T sum = 0;
  int64_t r = 0;
  if constexpr (std::is_same_v<T, float>) {
    vec_t<float> acc = {};
    for (; r + 8 <= n; r += 8) {
      const vec_t<float> e = exp_nonpositive(load(x + r) - shift);
      store(x + r, e);
      acc += e;
    }
    sum = hsum<float>(acc);
  }
  for (; r < n; ++r) sum += (x[r] = std::exp(x[r] - shift));
  return sum;
}

// The rows of a per-node tensor picked by index: rows[r] = base + idx[r] * stride.
template <typename T>
struct Rows {
  const T* base;
  const int64_t* idx;
  int64_t stride;
  const T* operator[](int64_t r) const { return base + idx[r] * stride; }
};

// out[r] = <x, rows[r]> for n rows, eight at a time: eight independent accumulators hide the
// latency of the multiply-adds, and each piece of x is loaded once for all eight rows.
// No software prefetch here or in accumulate: prefetching the next group's rows made the
// forward 1.3-1.6x slower on the 2-core AMD EPYC we measure on (the loads of the current group
// already keep the memory system busy; the benchmark's floor peer shows how busy).
template <typename T>
inline void dots(const T* x, const Rows<T>& rows, int64_t n, int64_t d, T* out) {
  constexpr int L = Vec<T>::L, R = 8;
  const int64_t dl = d - d % L;
  int64_t r = 0;
  for (; r + R <= n; r += R) {
    const T* p[R];
#pragma GCC unroll 8
    for (int k = 0; k < R; ++k) p[k] = rows[r + k];
    vec_t<T> acc[R] = {};
    for (int64_t t = 0; t < dl; t += L) {
      const vec_t<T> xv = load(x + t);
#pragma GCC unroll 8
      for (int k = 0; k < R; ++k) acc[k] += xv * load(p[k] + t);
    }
    hsum8<T>(acc, out + r);
    for (int64_t t = dl; t < d; ++t)
      for (int k = 0; k < R; ++k) out[r + k] += x[t] * p[k][t];
  }
  for (; r < n; ++r) {
    const T* p = rows[r];
    vec_t<T> acc = {};
    for (int64_t t = 0; t < dl; t += L) acc += load(x + t) * load(p + t);
    T s = hsum<T>(acc);
    for (int64_t t = dl; t < d; ++t) s += x[t] * p[t];
    out[r] = s;
  }
}

// y[0 : NV * L] += sum_r coef[r] * rows[r][offset : offset + NV * L], y held in registers.
template <typename T, int NV>
inline void accumulate_chunk(T* y, const T* coef, const Rows<T>& rows, int64_t n, int64_t offset) {
  constexpr int L = Vec<T>::L;
  vec_t<T> acc[NV];
#pragma GCC unroll 8
  for (int k = 0; k < NV; ++k) acc[k] = load(y + k * L);
  for (int64_t r = 0; r < n; ++r) {
    const vec_t<T> c = vec_t<T>{} + coef[r];
    const T* x = rows[r] + offset;
#pragma GCC unroll 8
    for (int k = 0; k < NV; ++k) acc[k] += c * load(x + k * L);
  }
#pragma GCC unroll 8
  for (int k = 0; k < NV; ++k) store(y + k * L, acc[k]);
}

// y += sum_r coef[r] * rows[r], for rows of length d.
template <typename T>
inline void accumulate(T* y, const T* coef, const Rows<T>& rows, int64_t n, int64_t d) {
  constexpr int L = Vec<T>::L, NV = 8;
  int64_t c = 0;
  for (; c + NV * L <= d; c += NV * L) accumulate_chunk<T, NV>(y + c, coef, rows, n, c);
  for (; c + L <= d; c += L) accumulate_chunk<T, 1>(y + c, coef, rows, n, c);
  for (int64_t r = 0; c < d && r < n; ++r)
    for (int64_t t = c; t < d; ++t) y[t] += coef[r] * rows[r][t];
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
  for (int l = 0; l < L; ++l) m = std::max(m, mv[l]);
  for (; r < n; ++r) m = std::max(m, x[r] *= scale);
  return m;
}

// Runs fn(head, first_row, last_row) for every head over row blocks holding about the same
// number of edges (rows of very different degree, as in causal sets or global tokens, still
// balance), all in one parallel region: a thread takes consecutive tasks, so it stays on one
// head and that head's keys and values stay in its cache. Small problems run on the calling
// thread, where waking the pool would cost more than the work.
template <typename F>
void for_head_blocks(const int64_t* ptr, int64_t rows, int64_t heads, const F& fn) {
  const int64_t edges = ptr[rows];
  const int64_t blocks = std::min<int64_t>(rows, 4 * at::get_num_threads());
  if (blocks <= 0 || heads <= 0) return;
  std::vector<int64_t> bounds(blocks + 1, rows);
  bounds[0] = 0;
  for (int64_t b = 1; b < blocks; ++b) {
    const int64_t target = edges * b / blocks;
    bounds[b] = std::max(bounds[b - 1], int64_t(std::lower_bound(ptr, ptr + rows, target) - ptr));
  }
  const int64_t tasks = heads * blocks;
  const int64_t grain = edges * heads < (int64_t(1) << 15) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(t / blocks, bounds[t % blocks], bounds[t % blocks + 1]);
  });
}

// Attention dropout without a stored mask: whether edge e of head h is kept is a hash of
// (seed, h, e) (the SplitMix64 finaliser; Steele et al., "Fast splittable pseudorandom number
// generators", OOPSLA 2014), so the backward recomputes the forward's mask from the seed, and
// torch.manual_seed reproduces it (the seed is drawn from torch's generator).
struct Dropout {
  double p = 0;  // drop probability; 0 = no dropout
  uint64_t seed = 0;

  bool on() const { return p > 0; }
  bool keep(int64_t h, int64_t e) const {
    uint64_t x = seed ^ (uint64_t(h) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(e) * 0xD1B54A32D192ED03ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return double(x >> 11) * 0x1.0p-53 >= p;  // uniform in [0, 1) from the top 53 bits
  }
  // The factor on a kept weight: 1 / (1 - p), 0 for a dropped one.
  template <typename T>
  T factor(int64_t h, int64_t e) const {
    return !on() ? T(1) : keep(h, e) ? T(1.0 / (1.0 - p)) : T(0);
  }
};

// Key-side gradients of one head, over each key's edges (the transposed pattern: colptr,
// row_t, and perm_t mapping to the edge): dk_j += scale * sum_e ds_e q_i, dv_j += sum_e w_e dO_i.
template <typename T>
void key_rows(int64_t c0, int64_t c1, const int64_t* colptr, const int64_t* row_t, const int64_t* perm_t,
              const T* q, int64_t qs, int64_t dk, const T* go, int64_t gs, int64_t dv, const T* w, const T* ds, T scale,
              T* dkey, int64_t dks, T* dval, int64_t dvs, const Dropout& drop, int64_t h) {
  std::vector<int64_t> query;
  std::vector<T> a, b;
  for (int64_t j = c0; j < c1; ++j) {
    const int64_t deg = colptr[j + 1] - colptr[j];
    query.resize(deg), a.resize(deg), b.resize(deg);
    int64_t n = 0;
    for (int64_t t = colptr[j]; t < colptr[j + 1]; ++t) {
      const int64_t e = perm_t[t];
      if (w[e] == 0) continue;  // then ds_e = 0 too
      a[n] = ds[e] * scale, b[n] = w[e] * drop.factor<T>(h, e), query[n++] = row_t[t];
    }
    accumulate(dkey + j * dks, a.data(), Rows<T>{q, query.data(), qs}, n, dk);
    accumulate(dval + j * dvs, b.data(), Rows<T>{go, query.data(), gs}, n, dv);
  }
}

// The edges of query row i that take part (keep(e)) and their keys: the scratch of both row
// passes. When every edge of the row is kept (the usual case) nothing is copied: the edges
// are ptr[i] .. ptr[i + 1] and their keys a slice of col.
template <typename T>
struct RowEdges {
  std::vector<int64_t> edges, keys;
  std::vector<T> x;  // one number per kept edge (scores, then weights or d weights)
  int64_t first = 0;
  bool all = true;  // every edge of the row kept
  const int64_t* key = nullptr;

  int64_t edge(int64_t r) const { return all ? first + r : edges[r]; }

  template <typename Keep>
  int64_t gather(const int64_t* ptr, const int64_t* col, int64_t i, const Keep& keep) {
    first = ptr[i];
    const int64_t deg = ptr[i + 1] - first;
    x.resize(deg);
    int64_t n = 0;
    while (n < deg && keep(first + n)) ++n;
    all = n == deg;
    key = col + first;
    if (all) return n;
    edges.resize(deg), keys.resize(deg);
    for (int64_t r = 0; r < n; ++r) edges[r] = first + r, keys[r] = col[first + r];
    for (int64_t e = first + n; e < first + deg; ++e)
      if (keep(e)) edges[n] = e, keys[n++] = col[e];
    key = keys.data();
    return n;
  }
};

// Forward of one head: w_e = softmax over row i of (<q_i, k_j> * scale + bias_e), and
// out_i = sum_e w_e v_j (w_e times the dropout factor under dropout), in one visit of each row.
// Edges with a -inf bias are skipped before their dot product, so a top-k pattern (a per-head
// -inf mask over the union of the heads' edges) pays only for the edges each head keeps.
template <typename T>
void attend_rows(int64_t r0, int64_t r1, const int64_t* ptr, const int64_t* col, const T* q, int64_t qs, const T* k,
                 int64_t ks, int64_t d, const T* bias, int64_t bias_stride, T scale, T* w, const T* v, int64_t vs,
                 int64_t dv, T* out, int64_t os, const Dropout& drop, int64_t h) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  RowEdges<T> re;
  for (int64_t i = r0; i < r1; ++i) {
    const int64_t n = re.gather(ptr, col, i, [&](int64_t e) {
      return !(bias && bias[e * bias_stride] == neg_inf);  // a -inf edge keeps weight 0
    });
    T* x = re.x.data();
    dots(q + i * qs, Rows<T>{k, re.key, ks}, n, d, x);
    T row_max = neg_inf;
    if (bias) {
      for (int64_t r = 0; r < n; ++r) row_max = std::max(row_max, x[r] = x[r] * scale + bias[re.edge(r) * bias_stride]);
    } else {
      row_max = scale_max(x, n, scale);
    }
    if (row_max == neg_inf) continue;  // no finite score: every weight stays 0
    const T inv_sum = T(1) / exp_shifted(x, n, row_max);
    for (int64_t r = 0; r < n; ++r) x[r] *= inv_sum;
    for (int64_t r = 0; r < n; ++r) w[re.edge(r)] = x[r];
    if (drop.on())
      for (int64_t r = 0; r < n; ++r) x[r] *= drop.factor<T>(h, re.edge(r));
    accumulate(out + i * os, x, Rows<T>{v, re.key, vs}, n, dv);
  }
}

// Softmax backward of one head, and dq: ds_e = w_e (dw_e - sum_e' w_e' dw_e') with
// dw_e = <dO_i, v_j> (times the dropout factor) (+ gw_e, the gradient that reached the
// returned weights), then dq_i += scale * sum_e ds_e k_j. Edges of weight 0 keep ds = 0.
template <typename T>
void backward_rows(int64_t r0, int64_t r1, const int64_t* ptr, const int64_t* col, const T* go, int64_t gs,
                   const T* v, int64_t vs, int64_t dv, const T* k, int64_t ks, int64_t dk, const T* w, const T* gw,
                   T scale, T* ds, T* dq, int64_t dqs, const Dropout& drop, int64_t h) {
  RowEdges<T> re;
  for (int64_t i = r0; i < r1; ++i) {
    const int64_t n = re.gather(ptr, col, i, [&](int64_t e) { return w[e] != 0; });
    T* x = re.x.data();
    dots(go + i * gs, Rows<T>{v, re.key, vs}, n, dv, x);
    T delta = 0;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t e = re.edge(r);
      if (drop.on()) x[r] *= drop.factor<T>(h, e);
      if (gw) x[r] += gw[e];
      delta += w[e] * x[r];
    }
    for (int64_t r = 0; r < n; ++r) {
      const int64_t e = re.edge(r);
      ds[e] = w[e] * (x[r] - delta);
      x[r] = ds[e] * scale;
    }
    accumulate(dq + i * dqs, x, Rows<T>{k, re.key, ks}, n, dk);
  }
}

// Per-node tensors [N, H, d] are read in place through their strides (the caller's layout:
// the view of a projection's output), so only the feature dimension must be contiguous.
bool rows_ok(const at::Tensor& t) { return t.dim() == 3 && t.device().is_cpu() && (t.size(2) <= 1 || t.stride(2) == 1); }

// The first row of head h of a per-node tensor [N, H, d] (rows are t.stride(0) apart).
template <typename T>
T* head(const at::Tensor& t, int64_t h) {
  return t.data_ptr<T>() + h * t.stride(1);
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
// O(E * H * d) work of the kernels.
void check_structure(const at::Tensor& ptr, const at::Tensor& idx, int64_t rows, int64_t n, const char* what) {
  TORCH_CHECK(ptr.scalar_type() == at::kLong && idx.scalar_type() == at::kLong && ptr.is_contiguous() &&
                  idx.is_contiguous() && ptr.dim() == 1 && idx.dim() == 1 && ptr.device().is_cpu() && idx.device().is_cpu(),
              "tgattn fused: ", what, " must be contiguous int64 CPU vectors");
  TORCH_CHECK(ptr.size(0) == rows + 1, "tgattn fused: ", what, " pointer has ", ptr.size(0), " entries, expected ",
              rows + 1);
  const int64_t* p = ptr.data_ptr<int64_t>();
  const int64_t* x = idx.data_ptr<int64_t>();
  const int64_t E = idx.size(0);
  TORCH_CHECK(p[0] == 0 && p[rows] == E, "tgattn fused: ", what, " pointer must run from 0 to ", E);
  bool ok = true;
  for (int64_t r = 0; r < rows; ++r) ok &= p[r] <= p[r + 1];
  TORCH_CHECK(ok, "tgattn fused: ", what, " pointer goes down");
  ok = true;
  for (int64_t e = 0; e < E; ++e) ok &= (x[e] >= 0) & (x[e] < n);
  TORCH_CHECK(ok, "tgattn fused: ", what, " holds an index outside [0, ", n, ")");
}

// q [n_q, H, dk], k [n_k, H, dk], v [n_k, H, dv] (any row and head strides); bias [E, 1 or H] or None.
// Returns (out [n_q, H, dv], weights [H, E]).
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& rowptr, const at::Tensor& col,
                                const c10::optional<at::Tensor>& bias, double scale, double dropout_p,
                                int64_t seed) {
  check_inputs(q, k, v);
  const int64_t H = q.size(1), n_q = q.size(0), n_k = k.size(0), dk = q.size(2), dv = v.size(2), E = col.size(0);
  check_structure(rowptr, col, n_q, n_k, "rowptr / col");
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.dim() == 2 && b.size(0) == E && (b.size(1) == 1 || b.size(1) == H) &&
                               b.scalar_type() == q.scalar_type()),
              "tgattn fused: bias must be [E, 1 or H] of the dtype of q");
  at::Tensor out = at::zeros({n_q, H, dv}, q.options());
  at::Tensor w = at::zeros({H, E}, q.options());
  const int64_t* ptr = rowptr.data_ptr<int64_t>();
  const int64_t* cp = col.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "tgattn_fused_forward", [&] {
    const int64_t bias_heads = b.defined() ? b.size(1) : 0;
    for_head_blocks(ptr, n_q, H, [&](int64_t h, int64_t r0, int64_t r1) {
      const Dropout drop{dropout_p, uint64_t(seed)};
      const scalar_t* bh = b.defined() ? b.data_ptr<scalar_t>() + (bias_heads == 1 ? 0 : h) : nullptr;
      attend_rows<scalar_t>(r0, r1, ptr, cp, head<scalar_t>(q, h), q.stride(0), head<scalar_t>(k, h), k.stride(0), dk,
                            bh, bias_heads, static_cast<scalar_t>(scale), w.data_ptr<scalar_t>() + h * E,
                            head<scalar_t>(v, h), v.stride(0), dv, head<scalar_t>(out, h), out.stride(0), drop, h);
    });
  });
  return {out, w};
}

// Inputs [N, H, d] as in forward; weights and grad_weights [H, E].
// Returns (dq, dk, dv, d_scores [H, E]); d_scores is also the gradient of an additive bias.
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                 const at::Tensor& v, const at::Tensor& weights,
                                 const c10::optional<at::Tensor>& grad_weights, const at::Tensor& rowptr,
                                 const at::Tensor& col, const at::Tensor& colptr, const at::Tensor& row_t,
                                 const at::Tensor& perm_t, double scale, double dropout_p, int64_t seed) {
  check_inputs(q, k, v);
  const at::Tensor go = rows_ok(grad_out) ? grad_out : grad_out.contiguous();
  const at::Tensor gw = grad_weights.has_value() ? grad_weights->contiguous() : at::Tensor();
  const int64_t H = q.size(1), n_q = q.size(0), n_k = k.size(0), dk = q.size(2), dv = v.size(2), E = col.size(0);
  check_structure(rowptr, col, n_q, n_k, "rowptr / col");
  check_structure(colptr, row_t, n_k, n_q, "colptr / row_t");
  check_structure(colptr, perm_t, n_k, E, "colptr / perm_t");
  const auto same = [&](const at::Tensor& t, at::IntArrayRef shape) {
    return t.sizes() == shape && t.scalar_type() == q.scalar_type();
  };
  TORCH_CHECK(same(go, {n_q, H, dv}) && same(weights, {H, E}) && (!gw.defined() || same(gw, {H, E})),
              "tgattn fused: grad_out [n_q, H, dv], weights and grad_weights [H, E] must match q");
  at::Tensor dq = at::zeros({n_q, H, dk}, q.options()), dkt = at::zeros({n_k, H, dk}, q.options());
  at::Tensor dvt = at::zeros({n_k, H, dv}, q.options());
  at::Tensor ds = at::zeros_like(weights);
  const int64_t* ptr = rowptr.data_ptr<int64_t>();
  const int64_t* cp = col.data_ptr<int64_t>();
  const int64_t* tptr = colptr.data_ptr<int64_t>();
  const int64_t* rt = row_t.data_ptr<int64_t>();
  const int64_t* pt = perm_t.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "tgattn_fused_backward", [&] {
    const scalar_t s = static_cast<scalar_t>(scale);
    const Dropout drop{dropout_p, uint64_t(seed)};
    const scalar_t* wp = weights.data_ptr<scalar_t>();
    scalar_t* dsp = ds.data_ptr<scalar_t>();
    for_head_blocks(ptr, n_q, H, [&](int64_t h, int64_t r0, int64_t r1) {
      backward_rows<scalar_t>(r0, r1, ptr, cp, head<scalar_t>(go, h), go.stride(0), head<scalar_t>(v, h), v.stride(0),
                              dv, head<scalar_t>(k, h), k.stride(0), dk, wp + h * E,
                              gw.defined() ? gw.data_ptr<scalar_t>() + h * E : nullptr, s, dsp + h * E,
                              head<scalar_t>(dq, h), dq.stride(0), drop, h);
    });
    // The key side needs every d score of a head: a second region, over the transposed pattern.
    for_head_blocks(tptr, n_k, H, [&](int64_t h, int64_t c0, int64_t c1) {
      key_rows<scalar_t>(c0, c1, tptr, rt, pt, head<scalar_t>(q, h), q.stride(0), dk, head<scalar_t>(go, h),
                         go.stride(0), dv, wp + h * E, dsp + h * E, s, head<scalar_t>(dkt, h), dkt.stride(0),
                         head<scalar_t>(dvt, h), dvt.stride(0), drop, h);
    });
  });
  return {dq, dkt, dvt, ds};
}

// A measuring stick, not attention (the benchmark's `floor` peer): out[h, i] = sum over the
// edges e of row i of a[idx[e], h] + b[idx[e], h], visiting rows, heads and edges in the order
// the row passes above do. Its time is what reading the gathered rows costs on this machine.
at::Tensor gather_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ptr_t, const at::Tensor& idx_t) {
  check_inputs(a, b, b);
  TORCH_CHECK(a.sizes() == b.sizes(), "tgattn gather_rows: a and b must have one shape");
  const int64_t H = a.size(1), n = a.size(0), d = a.size(2), rows = ptr_t.size(0) - 1;
  check_structure(ptr_t, idx_t, rows, n, "ptr / idx");
  at::Tensor out = at::zeros({rows, H, d}, a.options());
  const int64_t* ptr = ptr_t.data_ptr<int64_t>();
  const int64_t* idx = idx_t.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "tgattn_gather_rows", [&] {
    for_head_blocks(ptr, rows, H, [&](int64_t h, int64_t r0, int64_t r1) {
      std::vector<scalar_t> one;
      for (int64_t i = r0; i < r1; ++i) {
        const int64_t e0 = ptr[i], deg = ptr[i + 1] - e0;
        one.assign(deg, scalar_t(1));
        scalar_t* o = head<scalar_t>(out, h) + i * out.stride(0);
        accumulate(o, one.data(), Rows<scalar_t>{head<scalar_t>(a, h), idx + e0, a.stride(0)}, deg, d);
        accumulate(o, one.data(), Rows<scalar_t>{head<scalar_t>(b, h), idx + e0, b.stride(0)}, deg, d);
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

// Edges in (target, source) order: (perm, src, dst) of the sorted edges, perm empty when they
// come sorted already. Two stable counting sorts (by source, then by target), O(E + n_q + n_k),
// and one pass over the edges when they are sorted: the analysis of every new edge set.
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
  if (sorted) return {at::empty({0}, s.options()), s.clone(), t.clone()};
  std::vector<int64_t> by_src(E), start(std::max(n_q, n_k) + 1);
  std::fill(start.begin(), start.begin() + n_k + 1, 0);
  for (int64_t e = 0; e < E; ++e) ++start[sp[e] + 1];
  for (int64_t j = 0; j < n_k; ++j) start[j + 1] += start[j];
  for (int64_t e = 0; e < E; ++e) by_src[start[sp[e]]++] = e;
  std::fill(start.begin(), start.begin() + n_q + 1, 0);
  for (int64_t e = 0; e < E; ++e) ++start[tp[e] + 1];
  for (int64_t i = 0; i < n_q; ++i) start[i + 1] += start[i];
  at::Tensor perm = at::empty({E}, s.options()), ss = at::empty({E}, s.options()), ts = at::empty({E}, s.options());
  int64_t* pp = perm.data_ptr<int64_t>();
  for (int64_t r = 0; r < E; ++r) pp[start[tp[by_src[r]]]++] = by_src[r];
  int64_t* ssp = ss.data_ptr<int64_t>();
  int64_t* tsp = ts.data_ptr<int64_t>();
  for (int64_t r = 0; r < E; ++r) ssp[r] = sp[pp[r]], tsp[r] = tp[pp[r]];
  return {perm, ss, ts};
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
  at::Tensor colptr = at::zeros({n_k + 1}, col.options());
  at::Tensor perm = at::empty({E}, col.options());
  int64_t* cp = colptr.data_ptr<int64_t>();
  int64_t* pp = perm.data_ptr<int64_t>();
  bool ok = true;
  for (int64_t e = 0; e < E; ++e) ok &= (c[e] >= 0) & (c[e] < n_k);
  TORCH_CHECK(ok, "tgattn transpose: col holds an index outside [0, ", n_k, ")");
  for (int64_t e = 0; e < E; ++e) ++cp[c[e] + 1];
  for (int64_t j = 0; j < n_k; ++j) cp[j + 1] += cp[j];
  std::vector<int64_t> next(cp, cp + n_k);
  for (int64_t e = 0; e < E; ++e) pp[next[c[e]]++] = e;
  return {colptr, perm};
}

}  // namespace

// Schemas here, CPU kernels below: the Python side registers fake (meta) kernels and autograd
// for these ops, so that torch.compile can trace through them.
TORCH_LIBRARY(tgattn_fused, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor rowptr, Tensor col, Tensor? bias, float scale, "
        "float dropout_p, int seed) -> Tensor[]");
  m.def("backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor weights, Tensor? grad_weights, "
        "Tensor rowptr, Tensor col, Tensor colptr, Tensor row_t, Tensor perm_t, float scale, float dropout_p, "
        "int seed) -> Tensor[]");
  // No tensor argument to dispatch on and never traced: a catch-all kernel.
  m.def("dropout_keep(int heads, int edges, float dropout_p, int seed) -> Tensor", &dropout_keep);
  m.def("gather_rows(Tensor a, Tensor b, Tensor ptr, Tensor idx) -> Tensor");
  m.def("transpose(Tensor col, int n_k) -> Tensor[]");
  m.def("sort_edges(Tensor src, Tensor dst, int n_q, int n_k) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(tgattn_fused, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("gather_rows", &gather_rows);
  m.impl("transpose", &transpose);
  m.impl("sort_edges", &sort_edges);
}
