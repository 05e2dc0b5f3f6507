// What the translation units of the fused extension share: the CSR pointer, the input checks, the
// per-dtype kernels' arguments (ForwardCall, BackwardCall: forward() and backward() in ops.cpp check
// their inputs and allocate; forward.cpp, backward.cpp and, in the half library below, forward_half.cpp,
// backward_half.cpp and backward_bfloat16.cpp run the kernels), and the other ops that ops.cpp registers.
//
// The kernels were one file, fused.cpp, a single translation unit that one core compiled while the
// others idled; split, ninja compiles the units side by side. Each unit keeps its own copy of the
// inline helpers (anonymous namespaces in vec.h, rows.h, terms.h, heads.h), as the single file had,
// so the compiler sees the same code around every kernel and the results are bit for bit the same.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace tgattn_fused {

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

inline bool index_type(const at::Tensor& t) { return t.scalar_type() == at::kLong || t.scalar_type() == at::kInt; }
inline RowPtr row_ptr(const at::Tensor& t) { return {t.data_ptr(), t.scalar_type() == at::kLong}; }


void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
void check_structure(const at::Tensor& ptr, const at::Tensor& idx, int64_t rows, int64_t n, const char* what);

// The forward's inputs, checked, and its outputs, allocated (see forward in ops.cpp); b, sk, qe, feat and
// sums are undefined where not given, w empty unless `weights`.
struct ForwardCall {
  const at::Tensor &q, &k, &v, &b, &sk, &qe, &feat, &out, &lse, &w, &sums;
  RowPtr ptr;
  const int64_t* cp;     // col
  const int64_t* fperm;  // the features' rows in sorted edge order, or null
  int64_t H, n_q, n_k, dk, dv, E, F;
  double scale, dropout_p, softcap;
  int64_t seed;
  bool weights, edge_sums;
};

// Runs the forward's kernels on every head for inputs of dtype S (float, double, c10::Half,
// c10::BFloat16): forward.h, instantiated in forward.cpp (float, double) and forward_half.cpp.
template <typename S>
void forward_heads(const ForwardCall& c);

// The backward's inputs, checked, and its outputs and scratch, allocated (see backward in ops.cpp).
struct BackwardCall {
  const at::Tensor &go, &o, &q, &k, &v, &lse, &w, &gw, &b, &sk, &qe, &feat, &esums, &gsum, &row_t, &perm, &cv;
  const at::Tensor &dq, &dkt, &dvt, &ds, &as, &pw, &delta, &ad, &extra, &sums;
  RowPtr ptr, tptr;
  const int64_t* fperm;
  const std::vector<int64_t>& bounds;  // the key blocks
  const std::vector<char>& direct;     // per key block: q, dO and dq read in place (in_place)
  int64_t H, n_q, n_k, dk, dv, E, F;
  double scale, dropout_p, softcap;
  int64_t seed;
  bool grad_bias, edge, query_pass, fuse_q;
};

// The backward's kernels on every head (deltas, key passes, the query pass) for inputs of dtype S,
// then the edge terms' gradients (dqe [n_q, H, F] or empty, de [E, F], pos_of [E] scratch like perm):
// backward.h, instantiated in backward.cpp (float, double), backward_half.cpp and backward_bfloat16.cpp.
template <typename S>
void backward_heads(const BackwardCall& c);
template <typename S>
void backward_edge_grads(const BackwardCall& c, const at::Tensor& dqe, const at::Tensor& de, const at::Tensor& pos_of);

// The float16 / bfloat16 kernels are a library of their own, tgattn_fused_half (forward_half.cpp,
// backward_half.cpp, backward_bfloat16.cpp, half_kernels.cpp), which tgattn/engine/build.py compiles when a
// float16 / bfloat16 call first needs it: they were 64 s of the kernel's 134 s of compiler CPU, and most
// calls are float32. Loading that library fills this table through set_half_kernels (it links against this
// one); forward() and backward() in ops.cpp run float and double here, float16 and bfloat16 through the table.
struct HalfKernels {
  void (*forward)(const ForwardCall&);
  void (*backward)(const BackwardCall&);
  void (*edge_grads)(const BackwardCall&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
};
void set_half_kernels(at::ScalarType dtype, const HalfKernels& kernels);
// The table's kernels for dtype (float16 or bfloat16); a clear error while their library is not loaded.
const HalfKernels& half_kernels(at::ScalarType dtype);

// Sorting and transposing edges, self-loops, the benchmark's floor, dropout masks (graph.cpp).
std::vector<at::Tensor> transpose_rows(const at::Tensor& rowptr, const at::Tensor& col, int64_t n_k, bool with_perm,
                                       bool narrow);
at::Tensor gather_rows(const at::Tensor& a, const at::Tensor& b, const at::Tensor& ptr_t, const at::Tensor& idx_t);
at::Tensor dropout_keep(int64_t heads, int64_t edges, double dropout_p, int64_t seed);
std::vector<at::Tensor> sort_edges(const at::Tensor& src, const at::Tensor& dst, int64_t n_q, int64_t n_k);
bool same_edges(const at::Tensor& edge_index, const at::Tensor& perm, const at::Tensor& src, const at::Tensor& dst);
at::Tensor self_loops(const at::Tensor& edge_index, int64_t n);
std::vector<at::Tensor> transpose(const at::Tensor& col, int64_t n_k);

// The edge terms' per-head maps and TransformerConv's beta gate (maps.cpp).
at::Tensor head_map(const at::Tensor& x, const at::Tensor& w);
at::Tensor head_map_add(const c10::optional<at::Tensor>& base, const at::Tensor& s, const at::Tensor& w, bool inplace);
at::Tensor head_outer(const at::Tensor& x, const at::Tensor& s);
std::vector<at::Tensor> beta_gate(const at::Tensor& out, const at::Tensor& root, const at::Tensor& w);
std::vector<at::Tensor> beta_gate_backward(const at::Tensor& grad, const at::Tensor& out, const at::Tensor& root,
                                           const at::Tensor& w, const at::Tensor& gate);

}  // namespace tgattn_fused
