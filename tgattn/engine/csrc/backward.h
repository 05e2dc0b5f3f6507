// The backward's kernels over every head (backward_heads) and the edge terms' gradients
// (backward_edge_grads) for one input dtype: included by the units that instantiate them (backward.cpp,
// backward_half.cpp, backward_bfloat16.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "heads.h"
#include "key_pass.h"
#include "ops.h"

namespace tgattn_fused {

template <typename scalar_t>
void backward_heads(const BackwardCall& c) {
  const at::Tensor &go = c.go, &o = c.o, &q = c.q, &k = c.k, &v = c.v, &lse = c.lse, &w = c.w, &gw = c.gw, &b = c.b;
  const at::Tensor &sk = c.sk, &qe = c.qe, &feat = c.feat, &esums = c.esums, &gsum = c.gsum, &row_t = c.row_t;
  const at::Tensor &perm = c.perm, &cv = c.cv, &dq = c.dq, &dkt = c.dkt, &dvt = c.dvt, &ds = c.ds, &as = c.as;
  const at::Tensor &pw = c.pw, &delta = c.delta, &ad = c.ad, &extra = c.extra, &sums = c.sums;
  const RowPtr ptr = c.ptr, tptr = c.tptr;
  const int64_t* fperm = c.fperm;
  const std::vector<int64_t>& bounds = c.bounds;
  const std::vector<char>& direct = c.direct;
  const int64_t H = c.H, n_q = c.n_q, n_k = c.n_k, dk = c.dk, dv = c.dv, E = c.E, F = c.F;
  const double scale = c.scale, dropout_p = c.dropout_p, softcap = c.softcap;
  const int64_t seed = c.seed;
  const bool grad_bias = c.grad_bias, edge = c.edge, query_pass = c.query_pass, fuse_q = c.fuse_q;
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
    // One key block whose q and dO are read in place (direct, as on small sparse graphs): a task's heads go
    // through the keys together (key_pass_heads), min(H, threads) tasks of consecutive heads. One thread,
    // the molecule step's first layer (3,079 nodes, 9,967 edges, H = 4, d = 16, dropout 0.6), the backward
    // op alone, seven alternating processes: 1.23-1.32 ms one head at a time, 1.10-1.12 ms together.
    if constexpr (!is_half_v<S>) if (H > 1 && bounds.size() == 2 && direct[0]) {
      const int64_t tasks = std::min<int64_t>(H, at::get_num_threads());
      at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
        Scratch sc;
        std::vector<HeadGrad<S>> gs;
        std::vector<Logits<T>> lgs;
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t h0 = t * H / tasks, h1 = (t + 1) * H / tasks;
          gs.clear(), lgs.clear();
          for (int64_t h = h0; h < h1; ++h) {
            T* dst = dq.data_ptr<T>() + h * dk;  // summed in place: cleared first
            for (int64_t i = 0; i < n_q; ++i) std::memset(dst + i * H * dk, 0, dk * sizeof(T));
            sc.q.view(q, h), sc.go.view(go, h);
            gs.push_back(head_grad(sc.q, sc.go, h, dst, H * dk));
            lgs.push_back(logits<T>(softcap, scale, sk, h));
          }
          (edge ? key_pass_heads<S, I, true> : key_pass_heads<S, I, false>)(
              bounds[0], bounds[1], tptr, rt, pt, gs.data(), h0, h1, static_cast<T>(scale), drop, sc.ce, sc.a, sc.sums,
              lgs.data());
        }
      });
      return;
    }
    for_head_blocks<Scratch>(bounds, tptr, H, [&](Scratch& sc, int64_t h, int64_t blk, int64_t c0, int64_t c1) {
      if constexpr (is_half_v<S>) if (query_pass) {  // no dq here: the key pass writes ad
        if (direct[blk])
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
            c0, c1, tptr, rt, pt, g, static_cast<T>(scale), drop, h, sc.ce, sc.a, sc.sums, logits<T>(softcap, scale, sk, h),
            /*groups=*/true);
        if (fuse_q) {  // the whole head's keys are done: its dq (see the query pass below)
          if (in_place(E, n_k, k.stride(0) * int64_t(sizeof(S))))
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
      const bool in_place_dq = direct[blk];  // then dst is set: sums exists
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
          c0, c1, tptr, rt, pt, g, static_cast<T>(scale), drop, h, sc.ce, sc.a, sc.sums, logits<T>(softcap, scale, sk, h),
          /*groups=*/true);
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
      if (in_place((ptr[r1] - ptr[r0]) * qruns, n_k, k.stride(0) * int64_t(sizeof(S))))
        sc.k.view(k, h);
      else
        sc.k.hold(k, h);
      query_rows<S>(r0, r1, ptr, cp, ad.data_ptr<T>() + h * E, sc.k.rows, sc.k.stride, dk, head<S>(dq, h),
                    dq.stride(0));
    });
  }
}

template <typename scalar_t>
void backward_edge_grads(const BackwardCall& c, const at::Tensor& dqe, const at::Tensor& de, const at::Tensor& pos_of) {
  const at::Tensor &qe = c.qe, &feat = c.feat, &gsum = c.gsum, &as = c.as, &pw = c.pw, &perm = c.perm;
  const RowPtr ptr = c.ptr;
  const int64_t* fperm = c.fperm;
  const int64_t H = c.H, n_q = c.n_q, E = c.E, F = c.F;
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
}

}  // namespace tgattn_fused
