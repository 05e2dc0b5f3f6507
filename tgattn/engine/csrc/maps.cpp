// The edge terms' per-head maps (head_map, head_map_add, head_outer) and TransformerConv's beta gate:
// float and double rows in explicit vectors, around the attention kernels.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <type_traits>
#include <vector>

#include "heads.h"
#include "ops.h"

namespace tgattn_fused {

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
namespace {

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

}  // namespace

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
namespace {

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

}  // namespace

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

}  // namespace tgattn_fused
