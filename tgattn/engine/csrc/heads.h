// The kernels' view of per-node tensors and work: a head's rows (head, Slab), tasks over (head, row
// block) in one parallel region (for_head_blocks), dropout by hash, and the entries of a CSR row.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "buffer_cache.h"
#include "ops.h"
#include "rows.h"

namespace tgattn_fused {
namespace {

// Per-node tensors [N, H, d] are read in place through their strides (the caller's layout:
// the view of a projection's output), so only the feature dimension must be contiguous.
bool rows_ok(const at::Tensor& t) { return t.dim() == 3 && t.device().is_cpu() && (t.size(2) <= 1 || t.stride(2) == 1); }

// The first row of head h of a per-node tensor [N, H, d] (rows are t.stride(0) apart).
template <typename T>
T* head(const at::Tensor& t, int64_t h) {
  return t.data_ptr<T>() + h * t.stride(1);
}

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
// per node (every benchmark pattern) copy; 10 edges among 10^7 nodes do not. Nor does a span of at
// most RESIDENT_BYTES in the caller's layout (`row_bytes` a node's row, all heads), whatever the reads:
// it stays in L2 while a head is worked on, so a strided row costs what a copied one does there, and
// the copy is only a pass more. One thread, dropout 0.6, forward + backward, copies -> in place, three
// alternating runs: a molecule batch with self-loops (3,040 nodes, 9,844 edges, H = 4, d = 16: 778 KB
// a tensor) 2.42 -> 2.19-2.25 ms, Cora with self-loops (H = 8, d = 8: 693 KB) 4.43-4.57 -> 4.16-4.25 ms.
constexpr int64_t RESIDENT_BYTES = int64_t(1) << 20;
inline bool in_place(int64_t reads, int64_t span, int64_t row_bytes) {
  return 8 * reads < span || span * row_bytes <= RESIDENT_BYTES;
}

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

}  // namespace
}  // namespace tgattn_fused
