// A set of page indices in [0, n): two-level bitmap. insert/erase/contains are O(1), next(p)
// (the smallest member >= p) reads at most a few words: one bit per page, one summary bit per
// 64 pages. Replaces std::set for the allocator's idle pages, which a 64 MiB malloc/free pair
// inserts and erases 32 times.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace oxygen {

class PageSet {
 public:
  static constexpr std::size_t npos = static_cast<std::size_t>(-1);

  explicit PageSet(std::size_t n) : bits_((n + 63) / 64, 0), summary_((bits_.size() + 63) / 64, 0) {}

  bool contains(std::size_t p) const { return bits_[p / 64] >> (p % 64) & 1; }
  bool empty() const { return count_ == 0; }
  std::size_t size() const { return count_; }

  bool insert(std::size_t p) {
    std::uint64_t& w = bits_[p / 64];
    std::uint64_t bit = std::uint64_t{1} << (p % 64);
    if (w & bit) return false;
    w |= bit;
    summary_[p / 4096] |= std::uint64_t{1} << (p / 64 % 64);
    ++count_;
    return true;
  }

  bool erase(std::size_t p) {
    std::uint64_t& w = bits_[p / 64];
    std::uint64_t bit = std::uint64_t{1} << (p % 64);
    if (!(w & bit)) return false;
    w &= ~bit;
    if (!w) summary_[p / 4096] &= ~(std::uint64_t{1} << (p / 64 % 64));
    --count_;
    return true;
  }

  // The largest member <= p (p < the set's size), or npos.
  std::size_t prev(std::size_t p) const {
    if (count_ == 0) return npos;
    std::size_t wi = p / 64;
    std::uint64_t w = bits_[wi] & (~std::uint64_t{0} >> (63 - p % 64));
    if (w) return wi * 64 + 63 - static_cast<std::size_t>(__builtin_clzll(w));
    if (wi == 0) return npos;
    std::size_t s = (wi - 1) / 64, bit = (wi - 1) % 64;
    std::uint64_t sw = summary_[s] & (~std::uint64_t{0} >> (63 - bit));
    while (!sw) {
      if (s == 0) return npos;
      sw = summary_[--s];
    }
    wi = s * 64 + 63 - static_cast<std::size_t>(__builtin_clzll(sw));
    return wi * 64 + 63 - static_cast<std::size_t>(__builtin_clzll(bits_[wi]));
  }

  std::size_t last() const { return count_ ? prev(bits_.size() * 64 - 1) : npos; }

  // The smallest member >= p, or npos.
  std::size_t next(std::size_t p) const {
    std::size_t wi = p / 64;
    if (wi >= bits_.size() || count_ == 0) return npos;
    std::uint64_t w = bits_[wi] & (~std::uint64_t{0} << (p % 64));
    if (w) return wi * 64 + static_cast<std::size_t>(__builtin_ctzll(w));
    // the next non-empty word, through the summary
    std::size_t s = (wi + 1) / 64, bit = (wi + 1) % 64;
    if (s >= summary_.size()) return npos;
    std::uint64_t sw = bit ? summary_[s] & (~std::uint64_t{0} << bit) : summary_[s];
    while (!sw) {
      if (++s >= summary_.size()) return npos;
      sw = summary_[s];
    }
    wi = s * 64 + static_cast<std::size_t>(__builtin_ctzll(sw));
    return wi * 64 + static_cast<std::size_t>(__builtin_ctzll(bits_[wi]));
  }

 private:
  std::vector<std::uint64_t> bits_;
  std::vector<std::uint64_t> summary_;
  std::size_t count_ = 0;
};

}  // namespace oxygen
