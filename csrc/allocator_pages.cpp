// See allocator.h. Page reference counts, idle pages, hysteresis, event polling.
#include <cstdint>

#include "allocator.h"
#include "capture.h"

namespace oxygen {

Status Allocator::map_missing(std::size_t p0, std::size_t p1) {
  std::size_t p = p0;
  while (p <= p1) {
    if (range_->is_mapped(p)) {
      ++p;
      continue;
    }
    std::size_t q = p;
    while (q + 1 <= p1 && !range_->is_mapped(q + 1)) ++q;
    Status s = range_->map(p, q - p + 1);
    if (s != OK) return s;
    p = q + 1;
  }
  return OK;
}

Status Allocator::ref_pages(std::size_t p0, std::size_t p1, const StreamState* user) {
  std::size_t need = 0;
  for (std::size_t p = p0; p <= p1; ++p) {
    if (refcnt_[p]++ != 0) continue;
    if (range_->is_mapped(p))
      unidle(p);
    else
      ++need;
  }
  if (need == 0) return OK;
  // Hand idle pages' handles to this block rather than grow: mapped bytes stay at what live
  // blocks touch, which is the fragmentation figure.
  if (opt_.reclaim_on_grow && user && !idle_.empty()) {
    // Only the pages that would raise mapped bytes past the peak of live bytes are lent: below
    // it new pages cost one map each, as a lent page does, and the idle pages stay where later
    // blocks can sit on them with no map at all (lending every page walked large blocks across
    // the address range, each moving its pages again: 4x the maps of the recorded generate()
    // trace). Past the peak, lending keeps mapped bytes at what live blocks touch.
    // The peak since the pool began, kept apart from peak_allocated_bytes: reset_peak()
    // (PyTorch's reset_peak_memory_stats, which benchmarks call before a timed run) drops that
    // to the live bytes of the moment, and every growth after it lent: the engine's trace
    // recorded on the H200 (device_logs/2026-12-03_s20_allocs_*) mapped 2,800-3,300 pages in
    // its timed run so, ~440 with this bound (fragmentation 1.9-2.1 %).
    std::size_t pages = (mapped_bytes() + page_ - 1) / page_ + need;
    std::size_t high = (live_peak_ever_ + page_ - 1) / page_ + 1;
    if (pages > high) lend_idle(p0, p1, user, pages - high);
  }
  Status s = map_missing(p0, p1);
  if (s != OK) unref_pages(p0, p1);
  return s;
}

void Allocator::lend_idle(std::size_t p0, std::size_t p1, const StreamState* user,
                          std::size_t most) {
  // An idle page this stream may use -- safe, or freed by this stream with the device perhaps
  // still reading it -- lends its physical handle to an unmapped page of the new block. Its old
  // address stays mapped (and out of the free ranges) until every reader is done, then
  // retire_lent() unmaps it. The stream runs the old readers before the new writers, so the
  // shared memory is never used by both at once. One map on this thread instead of a fresh page
  // (or an unmap and a map), and mapped bytes do not grow while the GPU lags the CPU.
  auto usable = [user](const Tag& t) { return usable_by(t, user); };
  // Highest idle pages first: placement looks at the lowest ones, and a lent page's address
  // stays out of the free ranges until it retires.
  std::size_t q = idle_.last();
  auto down = [this](std::size_t x) { return x == 0 ? PageSet::npos : idle_.prev(x - 1); };
  std::size_t lent = 0;
  for (std::size_t p = p0; p <= p1 && q != PageSet::npos && lent < most; ++p) {
    if (range_->is_mapped(p)) continue;
    while (q != PageSet::npos) {
      std::uintptr_t lo = base() + q * page_;
      Lent l{q, {}};
      if (!extents_.take_range(lo, lo + page_, usable, &l.pieces)) {
        q = down(q);
        continue;
      }
      if (range_->lend(q, p) != OK) {
        give_back(l.pieces);
        return;  // map_missing maps the rest (and reports the error if it persists)
      }
      idle_.erase(q);
      drop(stats_.idle_pages);
      bump(stats_.pages_lent);
      bump(stats_.lent_pending);
      ++lent;
      q = down(q);
      lent_.push_back(std::move(l));
      break;
    }
  }
}

void Allocator::retire_lent(std::size_t max_pages) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < lent_.size() && n < max_pages && !yield_to_waiter(n);) {
    Lent& l = lent_[i];
    bool safe = true;
    for (auto& pc : l.pieces) safe = safe && is_safe(pc.second.tag);
    if (!safe || range_->unmap(l.page, 1) != OK) {
      ++i;
      continue;
    }
    for (auto& pc : l.pieces) extents_.insert(pc.first, pc.second.size, Tag{});
    drop(stats_.lent_pending);
    lent_[i] = std::move(lent_.back());
    lent_.pop_back();
    ++n;
  }
}

void Allocator::unref_pages(std::size_t p0, std::size_t p1) {
  std::uint64_t now = 0;  // one reading for every page (a 64 MiB free read the clock 32 times)
  for (std::size_t p = p0; p <= p1; ++p)
    if (--refcnt_[p] == 0 && range_->is_mapped(p)) make_idle(p, now ? now : (now = now_ns()));
}

void Allocator::make_idle(std::size_t p, std::uint64_t now) {
  idle_since_[p] = now;
  if (idle_.insert(p)) bump(stats_.idle_pages);
}

void Allocator::unidle(std::size_t p) {
  if (idle_.erase(p)) drop(stats_.idle_pages);
}

void Allocator::note_live(std::uint64_t now) {
  last_alloc_ns_ = now;
  if (now - epoch_start_ns_ > kPeakEpochNs) {
    live_peak_prev_ = live_peak_cur_;
    live_peak_cur_ = 0;
    epoch_start_ns_ = now;
  }
  std::size_t live = get(stats_.allocated_bytes);
  if (live > live_peak_cur_) live_peak_cur_ = live;
  if (live > live_peak_ever_) live_peak_ever_ = live;
}

std::size_t Allocator::keep_pages(std::uint64_t now) const {
  // While allocations come (the last within the hysteresis), the pages of the live bytes'
  // recent peak: idle pages within it are the ones the next blocks of a periodic workload sit
  // on (a decode or prefill step's activations, layer after layer); unmapped by age they were
  // mapped again a step later, 45-70 us a page on the H200. Once allocations stop, none: every
  // idle page goes after its hysteresis, as before.
  if (now - last_alloc_ns_ > opt_.hysteresis_ns) return 0;
  return (recent_peak() + page_ - 1) / page_ + 1;
}

std::size_t Allocator::reclaim_idle(std::size_t max_pages, bool aged_only) {
  // A page is unmapped only when every free range on it is safe: no stream can still touch it
  // (cuMemUnmap does not wait for kernels in flight).
  std::uint64_t now = now_ns();
  std::size_t n = 0;
  std::size_t keep = aged_only ? keep_pages(now) : 0;
  for (std::size_t p = idle_.next(0); p != PageSet::npos && n < max_pages; p = idle_.next(p + 1)) {
    if (keep && mapped_bytes() <= keep * page_) break;  // within the recent peak: kept
    if (yield_to_waiter(n)) break;
    std::uintptr_t lo = base() + p * page_;
    if ((aged_only && now - idle_since_[p] < opt_.hysteresis_ns) ||
        !extents_.all_safe(lo, lo + page_) || range_->unmap(p, 1) != OK)
      continue;
    idle_.erase(p);
    drop(stats_.idle_pages);
    ++n;
  }
  return n;
}

void Allocator::release_empty_slabs(bool aged_only) {
  release_cached_small(aged_only);
  std::uint64_t now = now_ns();
  for (auto& kv : heaps_) {
    Heap* h = kv.second.get();
    if (h->capture) continue;
    bool released = false;
    for (int c = 0; c < kNumClasses; ++c) {
      SlabPage* sp = h->empty[c];
      if (!sp || (aged_only && now - sp->empty_since < opt_.hysteresis_ns)) continue;
      h->empty[c] = nullptr;
      drop(stats_.slab_cached_pages);
      release_slab_page(sp, sp->last_free);
      released = true;
    }
    if (released) try_record(h->stream);
  }
}

void Allocator::try_record(StreamState* s) {
  if (s->issued <= s->recorded || s->inflight.size() >= 2) return;
  capture::QueryGuard q;
  if (q.allowed() && streams_.record(s)) bump(stats_.events_recorded);
}

void Allocator::poll_events(bool sync) {
  bool complete = false;  // the device has finished everything issued so far
  {
    capture::QueryGuard q;
    if (!q.allowed()) return;  // a capture may be in progress: no event calls at all
    if (sync && streams_.any_unsafe()) {
      if ((complete = ctx().backend().synchronize() == OK)) streams_.all_complete();
    } else {
      complete = sync;
      streams_.poll();
    }
    retire_lent(sync ? SIZE_MAX : kSweepUnmaps);
    process_pending_releases();  // may synchronize: allowed, we hold the query guard
  }
  // Outside the guard (not reentrant): freeing a block records an event through its own guard.
  if (!deferred_.empty()) {
    free_deferred();
    if (complete) streams_.all_complete();  // those frees were issued before the synchronize
  }
}

bool Allocator::yield_to_waiter(std::size_t done) {
  if (!sweeping_ || done < kSweepFloor || waiters_.load(std::memory_order_relaxed) == 0)
    return false;
  yielded_ = true;
  return true;
}

void Allocator::sweep_locked(bool force) {
  flush_stash();
  poll_events(false);
  extents_.coalesce();
  release_empty_slabs(!force);
  // A periodic sweep holds the lock the allocating thread waits on: at most kSweepUnmaps
  // retirements of lent pages (poll_events) and as many hysteresis unmaps, each ~20-30 us on the
  // H200. A large free (a KV cache at the end of generate()) drains over a few sweeps instead
  // of stalling one malloc; before the bound on retirements, a burst of lent pages becoming
  // safe at once was unmapped in one sweep.
  reclaim_idle(force ? SIZE_MAX : kSweepUnmaps, !force);
  last_sweep_ = now_ns();
}

}  // namespace oxygen
