// See allocator.h. Small blocks (<= 1 MiB): best fit at 512 B granularity inside pages kept for
// small blocks only, shared by every size and stream.
//
// Why not one slab page per size class (what this replaced, and what captures still use): a
// class costs a whole 2 MiB page as soon as one block of it is live, so a program using a few
// blocks of many sizes held tens of pages for a few MiB. 4 threads of log-uniform 512 B - 45 MiB
// random malloc/free: 62 small blocks (7.2 MiB) held 32 slab pages (64 MiB), 14 % fragmentation
// (benchmarks/RESULTS.md, seventh session). PyTorch's caching allocator also packs every small
// size into shared 2 MiB segments by best fit.
//
// Small pages never carry large blocks (a small long-lived tensor never pins a page in the middle
// of large ones, so large frees still unmap their pages) and a block never straddles two of them
// (small_ does not join across pages): a page whose last block is freed goes back whole.
#include "allocator.h"

namespace oxygen {

std::uintptr_t Allocator::small_alloc(std::size_t bytes, StreamState* st, Block* b) {
  std::uintptr_t a = 0;
  if (stash_.addr && stash_.span == bytes && stash_.stream == st) {
    // freed on st: st's later work runs after what it queued on the block (its page still
    // counts it, so nothing to count again)
    a = stash_.addr;
    stash_ = SmallStash{};
    b->small = true;
    b->span = bytes;
    return a;
  }
  Tag t;
  if (!small_.take(bytes, kMinBlock, st, &a, &t)) {
    // A fresh page is wholly usable by st, so the second take cannot miss.
    if (!new_small_page(st) || !small_.take(bytes, kMinBlock, st, &a, &t)) return 0;
  }
  std::size_t p = (a - base()) / page_;
  if (small_live_[p]++ == 0 && p == small_empty_) {
    small_empty_ = PageSet::npos;
    drop(stats_.slab_cached_pages);
  }
  b->small = true;
  b->span = bytes;
  return a;
}

bool Allocator::new_small_page(StreamState* st) {
  std::uintptr_t a = 0;
  Pieces taken;
  if (!take_free(page_, page_, st, &a, &taken)) return false;
  std::size_t p = (a - base()) / page_;
  if (ref_pages(p, p, st) != OK) {
    give_back(taken);
    return false;
  }
  // Every piece is st's own free or safe for everyone: the page as one range takes st's latest
  // ticket (the safe parts wait for st's event too: never earlier than allowed).
  Tag tag;
  for (const auto& pc : taken)
    if (!is_safe(pc.second.tag) && pc.second.tag.ticket > tag.ticket) tag = pc.second.tag;
  small_.insert(a, page_, tag);
  bump(stats_.small_pages);
  return true;
}

void Allocator::small_free(const Block& b, StreamState* fs, bool stash) {
  // Stashed only beside other live blocks of its page: a page never holds a stashed block
  // alone (its last block goes back at once, and the page to small_empty_ or out, as before).
  if (stash && fs == b.stream && small_live_[(b.addr - base()) / page_] > 1) {
    SmallStash old = stash_;
    stash_ = SmallStash{b.addr, b.span, fs};
    if (old.addr) small_give_back(old.addr, old.span, old.stream);
    return;
  }
  small_give_back(b.addr, b.span, fs);
}

void Allocator::small_give_back(std::uintptr_t addr, std::size_t span, StreamState* fs) {
  // (a stashed block gets its stream's ticket of now, not of its free: later, never earlier
  // than allowed for the other streams)
  small_.insert(addr, span, streams_.on_free(fs));
  std::size_t p = (addr - base()) / page_;
  if (--small_live_[p] == 1 && stash_.addr && (stash_.addr - base()) / page_ == p) {
    flush_stash();  // (the stashed block is the page's last: it goes back, the page empties)
  } else if (small_live_[p] == 0) {
    if (small_empty_ == PageSet::npos) {
      // Keep one empty page a while: a loop that frees and re-allocates one small tensor must
      // not map and unmap a page each time (the sweep returns it after the hysteresis).
      small_empty_ = p;
      small_empty_since_ = now_ns();
      bump(stats_.slab_cached_pages);
    } else {
      release_small_page(p);
    }
  }
  try_record(fs);
}

void Allocator::release_small_page(std::size_t p) {
  std::uintptr_t lo = base() + p * page_;
  Pieces pieces;
  // Nothing live on it: the whole page is free in small_ (pieces keep who freed them).
  small_.take_range(lo, lo + page_, [](const Tag&) { return true; }, &pieces);
  give_back(pieces);
  unref_pages(p, p);
  drop(stats_.small_pages);
}

void Allocator::flush_stash() {
  if (!stash_.addr) return;
  SmallStash old = stash_;
  stash_ = SmallStash{};
  small_give_back(old.addr, old.span, old.stream);
}

void Allocator::release_cached_small(bool aged_only) {
  if (small_empty_ == PageSet::npos) return;
  if (aged_only && now_ns() - small_empty_since_ < opt_.hysteresis_ns) return;
  std::size_t p = small_empty_;
  small_empty_ = PageSet::npos;
  drop(stats_.slab_cached_pages);
  release_small_page(p);
}

}  // namespace oxygen
