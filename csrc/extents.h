// Free virtual address ranges of the pool, each tagged with who freed it last (streams.h), indexed
// by address (to merge neighbours and to ask "is this page all free and safe?") and by size (best
// fit). Mapped or not does not matter here: the page layer maps exactly the pages live blocks touch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "streams.h"

namespace oxygen {

class FreeExtents {
 public:
  // boundary != 0: ranges never join across a multiple of it (the small-block pages: a block
  // never straddles two of them, so each page goes back whole when its last block is freed).
  explicit FreeExtents(std::size_t boundary = 0) : boundary_(boundary) {
    spare_addr_.reserve(kSpare);
    spare_size_.reserve(kSpare);
  }

  struct Extent {
    std::size_t size;
    Tag tag;
  };
  using Pieces = std::vector<std::pair<std::uintptr_t, Extent>>;  // free ranges taken out

  // Adds [addr, addr+size) and joins it with neighbours whose tags allow it.
  void insert(std::uintptr_t addr, std::size_t size, Tag tag);

  // Best fit: the smallest extent holding `size` bytes at an `align`-aligned address that `user`
  // may use (nullptr user: only safe extents). Carves the block out, returns its address and the
  // extent's tag; false if none.
  bool take(std::size_t size, std::size_t align, const StreamState* user, std::uintptr_t* addr,
            Tag* tag);

  // Up to `k` free extents (start, size) that hold `size` bytes at an `align`-aligned address and
  // that `user` may use (nullptr: safe ones only), smallest first: best fit and its runners-up.
  void fits(std::size_t size, std::size_t align, const StreamState* user, int k,
            std::vector<std::pair<std::uintptr_t, std::size_t>>* out) const;

  // The free extent holding `addr`, or false. Sets its start, size and tag.
  bool find(std::uintptr_t addr, std::uintptr_t* start, std::size_t* size, Tag* tag) const;

  // Takes every free piece of [lo, hi) out if the whole range is free and each piece's tag
  // satisfies `ok`; appends the pieces to `out`. False (nothing changed) otherwise.
  template <class Ok>
  bool take_range(std::uintptr_t lo, std::uintptr_t hi, Ok ok, Pieces* out);

  // Join neighbours whose tags became compatible (events completed since they were freed).
  void coalesce();

  // True when every free range overlapping [lo, hi) is safe for everyone.
  bool all_safe(std::uintptr_t lo, std::uintptr_t hi) const;

  std::size_t count() const { return by_addr_.size(); }
  std::size_t free_bytes() const { return free_bytes_; }
  std::size_t largest() const { return by_size_.empty() ? 0 : by_size_.rbegin()->first; }

 private:
  void erase(std::map<std::uintptr_t, Extent>::iterator it);
  void add(std::uintptr_t addr, std::size_t size, Tag tag);
  bool joinable_at(std::uintptr_t addr) const { return boundary_ == 0 || addr % boundary_ != 0; }

  std::size_t boundary_;

  using ByAddr = std::map<std::uintptr_t, Extent>;
  using BySize = std::set<std::pair<std::size_t, std::uintptr_t>>;
  ByAddr by_addr_;
  BySize by_size_;
  std::size_t free_bytes_ = 0;
  // Nodes of erased extents, reused by the next adds: a malloc carves one extent into at most
  // two and a free joins at most three into one, so a few spares make the index allocation-free
  // in steady state (a heap allocation and free a node saved, ~15 % of a small malloc + free).
  static constexpr std::size_t kSpare = 8;
  std::vector<ByAddr::node_type> spare_addr_;
  std::vector<BySize::node_type> spare_size_;
};

template <class Ok>
bool FreeExtents::take_range(std::uintptr_t lo, std::uintptr_t hi, Ok ok, Pieces* out) {
  auto first = by_addr_.upper_bound(lo);
  if (first == by_addr_.begin()) return false;
  --first;
  std::uintptr_t at = lo;
  for (auto it = first; at < hi; ++it) {  // covered without gaps, every tag acceptable?
    if (it == by_addr_.end() || it->first > at || it->first + it->second.size <= at ||
        !ok(it->second.tag))
      return false;
    at = it->first + it->second.size;
  }
  std::size_t before = out->size();
  for (auto it = first; it != by_addr_.end() && it->first < hi;) {
    std::uintptr_t s = it->first, e = s + it->second.size;
    Tag t = it->second.tag;
    auto next = std::next(it);
    erase(it);
    if (s < lo) add(s, lo - s, t);
    if (e > hi) add(hi, e - hi, t);
    std::uintptr_t ps = s < lo ? lo : s, pe = e > hi ? hi : e;
    out->push_back({ps, Extent{pe - ps, t}});
    it = next;
  }
  return out->size() > before;
}

}  // namespace oxygen
