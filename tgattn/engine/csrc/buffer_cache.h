// Large buffers kept for the next call (one cache for the whole extension: every translation unit
// shares BufferCache::get()'s instance).
#pragma once

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <vector>

namespace tgattn_fused {

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

}  // namespace tgattn_fused
