// See extents.h.
#include "extents.h"

namespace oxygen {

void FreeExtents::add(std::uintptr_t addr, std::size_t size, Tag tag) {
  if (spare_addr_.empty()) {
    by_addr_.emplace(addr, Extent{size, tag});
  } else {
    ByAddr::node_type n = std::move(spare_addr_.back());
    spare_addr_.pop_back();
    n.key() = addr;
    n.mapped() = Extent{size, tag};
    by_addr_.insert(std::move(n));
  }
  if (spare_size_.empty()) {
    by_size_.emplace(size, addr);
  } else {
    BySize::node_type n = std::move(spare_size_.back());
    spare_size_.pop_back();
    n.value() = {size, addr};
    by_size_.insert(std::move(n));
  }
  free_bytes_ += size;
}

void FreeExtents::erase(ByAddr::iterator it) {
  BySize::node_type s = by_size_.extract({it->second.size, it->first});
  if (s && spare_size_.size() < kSpare) spare_size_.push_back(std::move(s));
  free_bytes_ -= it->second.size;
  ByAddr::node_type a = by_addr_.extract(it);
  if (spare_addr_.size() < kSpare) spare_addr_.push_back(std::move(a));
}

void FreeExtents::insert(std::uintptr_t addr, std::size_t size, Tag tag) {
  if (size == 0) return;
  auto next = by_addr_.lower_bound(addr);
  // Join the left neighbour if it ends exactly here.
  if (next != by_addr_.begin()) {
    auto prev = std::prev(next);
    Tag joined;
    if (prev->first + prev->second.size == addr && joinable_at(addr) &&
        merge_tags(prev->second.tag, tag, &joined)) {
      addr = prev->first;
      size += prev->second.size;
      tag = joined;
      erase(prev);
    }
  }
  next = by_addr_.lower_bound(addr + size);
  Tag joined;
  if (next != by_addr_.end() && next->first == addr + size && joinable_at(next->first) &&
      merge_tags(tag, next->second.tag, &joined)) {
    size += next->second.size;
    tag = joined;
    erase(next);
  }
  add(addr, size, tag);
}

bool FreeExtents::take(std::size_t size, std::size_t align, const StreamState* user,
                       std::uintptr_t* addr, Tag* tag) {
  for (auto it = by_size_.lower_bound({size, 0}); it != by_size_.end(); ++it) {
    auto ext = by_addr_.find(it->second);
    const Extent& e = ext->second;
    if (user ? !usable_by(e.tag, user) : !is_safe(e.tag)) continue;
    std::uintptr_t start = (ext->first + align - 1) / align * align;
    std::uintptr_t end = ext->first + e.size;
    if (start + size > end) continue;
    Tag t = e.tag;
    std::uintptr_t lo = ext->first;
    erase(ext);
    if (start > lo) add(lo, start - lo, t);
    if (start + size < end) add(start + size, end - (start + size), t);
    *addr = start;
    *tag = t;
    return true;
  }
  return false;
}

void FreeExtents::fits(std::size_t size, std::size_t align, const StreamState* user, int k,
                       std::vector<std::pair<std::uintptr_t, std::size_t>>* out) const {
  for (auto it = by_size_.lower_bound({size, 0}); it != by_size_.end() && k > 0; ++it) {
    const Extent& e = by_addr_.find(it->second)->second;
    if (user ? !usable_by(e.tag, user) : !is_safe(e.tag)) continue;
    if ((it->second + align - 1) / align * align + size > it->second + e.size) continue;
    out->push_back({it->second, e.size});
    --k;
  }
}

bool FreeExtents::find(std::uintptr_t addr, std::uintptr_t* start, std::size_t* size,
                       Tag* tag) const {
  auto it = by_addr_.upper_bound(addr);
  if (it == by_addr_.begin()) return false;
  --it;
  if (it->first + it->second.size <= addr) return false;
  *start = it->first;
  *size = it->second.size;
  *tag = it->second.tag;
  return true;
}

void FreeExtents::coalesce() {
  auto it = by_addr_.begin();
  while (it != by_addr_.end()) {
    auto next = std::next(it);
    Tag joined;
    if (next != by_addr_.end() && it->first + it->second.size == next->first &&
        joinable_at(next->first) && merge_tags(it->second.tag, next->second.tag, &joined)) {
      std::uintptr_t addr = it->first;
      std::size_t size = it->second.size + next->second.size;
      erase(next);
      erase(it);
      add(addr, size, joined);
      it = by_addr_.find(addr);  // may join the following one too
      continue;
    }
    it = next;
  }
}

bool FreeExtents::all_safe(std::uintptr_t lo, std::uintptr_t hi) const {
  auto it = by_addr_.upper_bound(lo);
  if (it != by_addr_.begin()) --it;
  for (; it != by_addr_.end() && it->first < hi; ++it) {
    if (it->first + it->second.size <= lo) continue;
    if (!is_safe(it->second.tag)) return false;
  }
  return true;
}

}  // namespace oxygen
