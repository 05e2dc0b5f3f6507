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
//
// This unit checks the ops' inputs, allocates their outputs and registers them; the kernels are compiled
// in units of their own (forward.cpp and backward.cpp for float and double; forward_half.cpp,
// backward_half.cpp and backward_bfloat16.cpp, the largest, in a library of their own built on first need;
// through forward.h and backward.h), the other ops in graph.cpp and maps.cpp, so that ninja compiles them on
// every core (ops.h says what they share).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <limits>
#include <vector>

#include "buffer_cache.h"
#include "heads.h"
#include "ops.h"
#include "rows.h"

namespace tgattn_fused {

namespace {
HalfKernels half_table[2];  // float16, bfloat16: filled as the half library loads
int half_slot(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "tgattn fused: no kernels for ", dtype);
  return dtype == at::kBFloat16;
}
}  // namespace

void set_half_kernels(at::ScalarType dtype, const HalfKernels& kernels) { half_table[half_slot(dtype)] = kernels; }

const HalfKernels& half_kernels(at::ScalarType dtype) {
  const HalfKernels& kernels = half_table[half_slot(dtype)];
  TORCH_CHECK(kernels.forward != nullptr, "tgattn fused: the ", dtype, " kernels are not loaded ",
              "(tgattn.engine.native.half_available() builds and loads them)");
  return kernels;
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

namespace {

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
  const ForwardCall call{q, k, v, b, sk, qe, feat, out, lse, w, sums, ptr, cp, fperm, H, n_q, n_k, dk, dv, E, F,
                         scale, dropout_p, softcap, seed, weights, edge_sums};
  switch (q.scalar_type()) {  // float16 / bfloat16: the half library's kernels (ops.h)
    case at::kFloat: forward_heads<float>(call); break;
    case at::kDouble: forward_heads<double>(call); break;
    default: half_kernels(q.scalar_type()).forward(call);
  }
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
  std::vector<char> direct(bounds.empty() ? 0 : bounds.size() - 1);
  const int64_t row_bytes = std::max(q.stride(0), go.stride(0)) * int64_t(q.element_size());  // q and dO rows
  bool any_direct = false;
  for (int64_t blk = 0; blk + 1 < int64_t(bounds.size()); ++blk)
    any_direct |= direct[blk] = in_place((tptr[bounds[blk + 1]] - tptr[bounds[blk]]) * runs, n_q, row_bytes);
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
  const BackwardCall call{go, o, q, k, v, lse, w, gw, b, sk, qe, feat, esums, gsum, row_t, perm, cv,
                          dq, dkt, dvt, ds, as, pw, delta, ad, extra, sums, ptr, tptr, fperm, bounds, direct,
                          H, n_q, n_k, dk, dv, E, F, scale, dropout_p, softcap, seed, grad_bias, edge, query_pass, fuse_q};
  switch (q.scalar_type()) {
    case at::kFloat: backward_heads<float>(call); break;
    case at::kDouble: backward_heads<double>(call); break;
    default: half_kernels(q.scalar_type()).backward(call);
  }
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
    switch (q.scalar_type()) {
      case at::kFloat: backward_edge_grads<float>(call, dqe, de, pos_of); break;
      case at::kDouble: backward_edge_grads<double>(call, dqe, de, pos_of); break;
      default: half_kernels(q.scalar_type()).edge_grads(call, dqe, de, pos_of);
    }
    grads.push_back(dqe), grads.push_back(de);
  }
  return grads;
}

}  // namespace
}  // namespace tgattn_fused

using namespace tgattn_fused;

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
