// Size-classed slabs for small requests (<= 1 MiB, and at most half a page): each slab is one
// whole physical page cut into equal slots. Keeping small blocks on their own pages means a small
// long-lived tensor never pins a page in the middle of large ones, which is what lets large frees
// unmap their pages.
//
// Classes: 512 B steps up to 4 KiB, then four steps per power of two up to 1 MiB (40 classes, at
// most 25 % rounding, all multiples of 512 B like PyTorch's block sizes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "streams.h"

namespace oxygen {

constexpr std::size_t kMinBlock = 512;
constexpr int kNumClasses = 40;
constexpr std::size_t kMaxSlabBlock = std::size_t{1} << 20;

std::size_t class_size(int cls);
// The class of a request of `bytes` (already >= 1), or -1 when above kMaxSlabBlock.
int size_class(std::size_t bytes);

struct Heap;

struct SlabPage {
  std::uint32_t page = 0;   // index of the page in the pool's range
  std::uint16_t cls = 0;
  std::uint32_t nslots = 0;
  std::uint32_t nfree = 0;
  std::uint32_t bump = 0;   // slots [bump, nslots) were never handed out
  std::vector<std::uint32_t> free_slots;
  Heap* heap = nullptr;
  std::int32_t partial_pos = -1;  // index in heap->partial[cls], -1 when full or cached empty
  std::uint64_t empty_since = 0;  // when it became the heap's cached empty page
  Tag last_free;                  // ticket of the latest slot free: the page is safe after it

  bool full() const { return nfree == 0; }
  bool empty() const { return nfree == nslots; }
  std::uint32_t pop() {
    --nfree;
    if (!free_slots.empty()) {
      std::uint32_t s = free_slots.back();
      free_slots.pop_back();
      return s;
    }
    return bump++;
  }
  void push(std::uint32_t slot) {
    ++nfree;
    free_slots.push_back(slot);
  }
};

// The slabs of one (stream, capture) pair. General heaps have capture == 0; a capture's heaps are
// private to it and never serve anyone else (their slots may be replayed by the graph).
struct Heap {
  StreamState* stream = nullptr;
  std::uint64_t capture = 0;
  bool released = false;  // capture heap whose graph is gone: pages go back as they empty
  std::vector<SlabPage*> partial[kNumClasses];
  SlabPage* empty[kNumClasses] = {};

  void add_partial(SlabPage* p) {
    p->partial_pos = static_cast<std::int32_t>(partial[p->cls].size());
    partial[p->cls].push_back(p);
  }
  void remove_partial(SlabPage* p) {
    auto& v = partial[p->cls];
    SlabPage* last = v.back();
    v[p->partial_pos] = last;
    last->partial_pos = p->partial_pos;
    v.pop_back();
    p->partial_pos = -1;
  }
};

}  // namespace oxygen
