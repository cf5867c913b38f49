// See allocator.h. Public entry points and block placement.
#include "allocator.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

#include "capture.h"

namespace oxygen {

namespace {
std::size_t round_up(std::size_t v, std::size_t a) { return (v + a - 1) / a * a; }
}  // namespace

std::unique_ptr<Allocator> Allocator::create(std::shared_ptr<DeviceCtx> ctx,
                                             const AllocOptions& opt, Status* status) {
  double factor = opt.va_factor < 1.0 ? 1.0 : opt.va_factor;
  auto pages = static_cast<std::size_t>(static_cast<double>(ctx->max_pages()) * factor);
  auto range = std::make_unique<PageRange>(ctx, pages, status);
  if (*status != OK) return nullptr;
  std::unique_ptr<Allocator> a(new Allocator(std::move(range), opt));
  Allocator* raw = a.get();
  a->ctx().add_sweeper(raw, [raw] { raw->sweep(); });
  capture::add_listener(
      raw, [raw] { raw->before_capture(); }, [raw](std::uint64_t t) { raw->release_capture(t); });
  return a;
}

Allocator::Allocator(std::unique_ptr<PageRange> range, const AllocOptions& opt)
    : range_(std::move(range)),
      page_(range_->page()),
      slab_max_(std::min(kMaxSlabBlock, range_->page() / 2)),
      opt_(opt),
      streams_(range_->ctx().backend()),
      small_(range_->page()),
      small_live_(range_->pages(), 0),
      refcnt_(range_->pages(), 0),
      idle_since_(range_->pages(), 0),
      idle_(range_->pages()) {
  extents_.insert(range_->base(), range_->pages() * page_, Tag{});
}

Allocator::~Allocator() {
  capture::remove_listener(this);
  ctx().remove_sweeper(this);
  std::lock_guard<std::mutex> g(mu_);
  for (auto& kv : captures_)
    if (kv.second->active) capture::note_detected(-1);
  // range_ unmaps every page still mapped (leaked blocks included) and frees the reservation.
}

void Allocator::report(const char* kind, std::uintptr_t ptr, std::int64_t size) {
  std::fprintf(stderr,
               "oxygen_torch: %s (pointer 0x%" PRIxPTR ", size %" PRId64
               "); ignored. Further cases are only counted in memory_stats().\n",
               kind, ptr, size);
}

void* Allocator::malloc(std::int64_t size, void* stream, Status* status) {
  if (size < 0 || static_cast<std::size_t>(size) > va_bytes()) {
    bump(stats_.num_bad_sizes);
    std::lock_guard<std::mutex> g(mu_);
    if (!reported_bad_size_) report("absurd allocation size", 0, size);
    reported_bad_size_ = true;
    set_last_error("absurd allocation size " + std::to_string(size));
    *status = ERR_INVALID;
    return nullptr;
  }
  // PyTorch calls malloc(0): it gets a unique 512-byte block, never a shared address.
  std::size_t bytes = round_up(size == 0 ? 1 : static_cast<std::size_t>(size), kMinBlock);
  bool capturing = false;
  std::uint64_t cid = 0;
  if (ctx().backend().capture_info(stream, &capturing, &cid) != OK) capturing = false;

  waiters_.fetch_add(1, std::memory_order_relaxed);  // (a periodic sweep yields to it)
  std::lock_guard<std::mutex> g(mu_);
  waiters_.fetch_sub(1, std::memory_order_relaxed);
  if (!active_captures_.empty()) refresh_captures();
  StreamState* st = streams_.get(stream);
  CaptureState* cap = capturing ? capture_for(cid, stream) : nullptr;
  std::uint64_t now = now_ns();
  if (now - last_sweep_ > 4 * opt_.hysteresis_ns) sweep_locked(false);

  Block b;
  std::uintptr_t p = bytes <= ctx().max_pages() * page_ ? place(bytes, st, cap, &b) : 0;
  if (!p && bytes <= ctx().max_pages() * page_) {
    // Out of pages: wait for the device if allowed, drop cached slabs, unmap every safe idle page.
    flush_stash();
    poll_events(true);
    release_empty_slabs(false);
    bump(stats_.reclaims, reclaim_idle(SIZE_MAX, false));
    p = place(bytes, st, cap, &b);
  }
  if (!p) {
    bump(stats_.num_ooms);
    set_last_error("out of memory: requested " + std::to_string(size) + " bytes");
    *status = ERR_OOM;
    return nullptr;
  }
  b.addr = p;
  b.requested = static_cast<std::size_t>(size);
  b.bytes = bytes;
  b.stream = st;
  b.capture = cap ? cap->id : 0;
  if (spare_live_.empty()) {
    live_.emplace(p, b);
  } else {
    auto n = std::move(spare_live_.back());
    spare_live_.pop_back();
    n.key() = p;
    n.mapped() = b;
    live_.insert(std::move(n));
  }
  bump(stats_.num_allocs);
  bump(stats_.live_blocks);
  bump(stats_.requested_bytes, b.requested);
  bump(stats_.allocated_bytes, bytes);
  raise_peak(stats_.peak_allocated_bytes, get(stats_.allocated_bytes));
  note_live(now);
  if (cap) bump(stats_.capture_allocs);
  *status = OK;
  return reinterpret_cast<void*>(p);
}

Status Allocator::free(void* ptr, std::int64_t size, void* stream) {
  auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  waiters_.fetch_add(1, std::memory_order_relaxed);
  std::lock_guard<std::mutex> g(mu_);
  waiters_.fetch_sub(1, std::memory_order_relaxed);
  auto it = live_.find(addr);
  if (it == live_.end()) {
    bump(stats_.num_bad_frees);
    stats_.last_bad_pointer.store(addr, std::memory_order_relaxed);
    if (!reported_bad_free_) report("free of an unknown pointer or double free", addr, size);
    reported_bad_free_ = true;
    set_last_error("free of an unknown pointer or double free");
    return ERR_INVALID;
  }
  auto node = live_.extract(it);
  Block b = std::move(node.mapped());
  if (spare_live_.size() < 8) spare_live_.push_back(std::move(node));
  if (size > 0 && static_cast<std::size_t>(size) != b.requested) {
    bump(stats_.num_size_mismatch);
    if (!reported_mismatch_) report("free with a size other than the block's (block size used)",
                                    addr, size);
    reported_mismatch_ = true;
  }
  drop(stats_.live_blocks);
  drop(stats_.requested_bytes, b.requested);
  drop(stats_.allocated_bytes, b.bytes);
  bump(stats_.num_frees);
  if (!active_captures_.empty()) refresh_captures();
  StreamState* fs = stream == b.stream->stream ? b.stream : streams_.get(stream);
  if (!b.used_on.empty()) {
    Deferred d{b, fs, {}};
    for (StreamState* s : b.used_on) {
      if (s == fs) continue;
      d.after.push_back(streams_.on_free(s));
      try_record(s);
    }
    if (!d.after.empty()) {
      bump(stats_.deferred_bytes, b.bytes);
      deferred_.push_back(std::move(d));
      return OK;
    }
  }
  free_block(b, fs, true);  // (a user's free, in its stream's order: the block may be stashed)
  if (now_ns() - last_sweep_ > 4 * opt_.hysteresis_ns) sweep_locked(false);
  return OK;
}

Status Allocator::record_stream(void* ptr, void* stream) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == live_.end()) {
    set_last_error("record_stream: not the start of a live block of this pool");
    return ERR_INVALID;
  }
  Block& b = it->second;
  StreamState* s = streams_.get(stream);
  if (s != b.stream && std::find(b.used_on.begin(), b.used_on.end(), s) == b.used_on.end())
    b.used_on.push_back(s);
  return OK;
}

void Allocator::free_deferred() {
  // Caller holds mu_, after polling events.
  std::size_t kept = 0;
  for (std::size_t i = 0; i < deferred_.size(); ++i) {
    Deferred& d = deferred_[i];
    bool done = std::all_of(d.after.begin(), d.after.end(), is_safe);
    if (!done) {
      if (kept != i) deferred_[kept] = std::move(d);
      ++kept;
      continue;
    }
    drop(stats_.deferred_bytes, d.block.bytes);
    free_block(d.block, d.stream);
  }
  deferred_.resize(kept);
}

void Allocator::free_block(const Block& b, StreamState* fs, bool stash) {
  if (b.capture) return free_capture_block(b, fs);
  if (b.small) return small_free(b, fs, stash);
  large_free(b, fs);  // slab blocks are a capture's (free_capture_block)
}

std::uintptr_t Allocator::place(std::size_t bytes, StreamState* st, CaptureState* cap, Block* b) {
  if (bytes <= slab_max_) {
    if (!cap) return small_alloc(bytes, st, b);
    return slab_alloc(heap_for(st, cap->id), size_class(bytes), b);
  }
  return large_alloc(bytes, st, cap, b);
}

std::uintptr_t Allocator::large_alloc(std::size_t bytes, StreamState* st, CaptureState* cap,
                                      Block* b) {
  if (cap) {
    // Reuse inside the same capture: the graph replays in the order it was captured.
    auto it = cap->reusable.lower_bound(bytes);
    if (it != cap->reusable.end() && it->first <= bytes + bytes / 4) {
      std::uintptr_t a = it->second;
      b->span = it->first;
      cap->reusable.erase(it);
      return a;
    }
  }
  std::uintptr_t a = 0;
  Pieces taken;
  // A capture takes only memory that no stream can still touch: its graph may replay anywhere.
  StreamState* user = cap ? nullptr : st;
  if (!take_free(bytes, kMinBlock, user, &a, &taken)) return 0;
  std::size_t p0 = (a - base()) / page_, p1 = (a + bytes - 1 - base()) / page_;
  if (ref_pages(p0, p1, user) != OK) {
    give_back(taken);
    return 0;
  }
  b->span = bytes;
  return a;
}

bool Allocator::place_on_idle(std::size_t bytes, std::size_t align, const StreamState* user,
                              std::uintptr_t* addr, Pieces* pieces) {
  // Idle pages are mapped pages with nothing live. A block placed over them needs fewer new maps
  // (about 30 us each on the H200, plus the unmap of the idle page later), and while the device
  // still reads them only their last user's stream may take them -- which is what a generate()
  // step does next. Look at the free runs holding idle pages (a few, lowest addresses first) and
  // take the placement that leaves the fewest pages to map; best fit decides otherwise. A run is
  // adjacent free extents this user may take: a fresh free is not joined with a safe neighbour
  // (other streams keep the safe part), yet a block of its own stream may span both.
  constexpr int kCandidates = 32, kMaxJoin = 64;
  if (idle_.empty()) return false;
  auto usable = [user](const Tag& t) { return user ? usable_by(t, user) : is_safe(t); };
  std::size_t best_need = SIZE_MAX, best_size = 0;
  std::uintptr_t best = 0;
  int seen = 0;
  for (std::size_t q = idle_.next(0); q != PageSet::npos && seen < kCandidates && best_need;) {
    std::uintptr_t lo = base() + q * page_;
    std::uintptr_t rs = 0, s2 = 0;
    std::size_t n = 0, n2 = 0;
    Tag t, t2;
    if (!extents_.find(lo, &rs, &n, &t)) {
      q = idle_.next(q + 1);
      continue;
    }
    ++seen;
    std::uintptr_t re = rs + n;
    bool ok = usable(t);
    for (int k = 0; ok && k < kMaxJoin && extents_.find(re, &s2, &n2, &t2) && usable(t2); ++k)
      re = s2 + n2;
    for (int k = 0; ok && k < kMaxJoin && rs > base() && extents_.find(rs - 1, &s2, &n2, &t2) &&
                    usable(t2);
         ++k)
      rs = s2;
    q = idle_.next((re - base() + page_ - 1) / page_);  // the next run's idle pages
    if (!ok || re - rs < bytes) continue;
    const std::uintptr_t cands[3] = {round_up(rs, align), lo, (re - bytes) / align * align};
    for (std::uintptr_t c : cands) {
      if (c < rs || c + bytes > re || c % align) continue;
      std::size_t need = 0;  // (counting stops once it passes the best so far)
      for (std::size_t p = (c - base()) / page_, e = (c + bytes - 1 - base()) / page_;
           p <= e && need <= best_need; ++p)
        need += !range_->is_mapped(p);
      if (need < best_need || (need == best_need && re - rs < best_size)) {
        best_need = need;
        best_size = re - rs;
        best = c;
      }
    }
  }
  std::size_t span = (bytes + page_ - 1) / page_ + 1;  // pages a block can touch
  if (best_need == SIZE_MAX || best_need + 1 >= span) return false;  // saves nothing
  if (!extents_.take_range(best, best + bytes, usable, pieces)) return false;
  *addr = best;
  return true;
}

std::size_t Allocator::unmapped_pages(std::uintptr_t a, std::size_t bytes) const {
  std::size_t need = 0;
  for (std::size_t p = (a - base()) / page_; p <= (a + bytes - 1 - base()) / page_; ++p)
    need += !range_->is_mapped(p);
  return need;
}

bool Allocator::take_free(std::size_t bytes, std::size_t align, const StreamState* user,
                          std::uintptr_t* addr, Pieces* pieces) {
  if (place_on_idle(bytes, align, user, addr, pieces)) return true;
  // The few smallest holes that fit, the block at either end of each: the placement that maps
  // the fewest new pages (ties: best fit, low end). A hole that starts or ends inside a page a
  // live neighbour keeps mapped shares that page when the block is put against that neighbour;
  // at the other end it would leave the page partly used and map one more. Best fit alone, at
  // the low end: 5.4 % fragmentation for 8 threads x 200,000 random log-uniform malloc/free.
  constexpr int kFits = 4;
  fits_.clear();
  extents_.fits(bytes, align, user, kFits, &fits_);
  std::size_t best_need = SIZE_MAX;
  std::uintptr_t best = 0;
  for (const auto& f : fits_) {
    const std::uintptr_t ends[2] = {round_up(f.first, align),
                                    (f.first + f.second - bytes) / align * align};
    for (std::uintptr_t c : ends) {
      std::size_t need = unmapped_pages(c, bytes);
      if (need < best_need) {
        best_need = need;
        best = c;
      }
    }
    if (best_need == 0) break;
  }
  if (best_need == SIZE_MAX) return false;
  auto usable = [user](const Tag& t) { return user ? usable_by(t, user) : is_safe(t); };
  if (!extents_.take_range(best, best + bytes, usable, pieces)) return false;
  *addr = best;
  return true;
}

void Allocator::give_back(const Pieces& pieces) {
  for (const auto& pc : pieces) extents_.insert(pc.first, pc.second.size, pc.second.tag);
}

void Allocator::large_free(const Block& b, StreamState* fs) {
  std::uintptr_t a = b.addr;
  std::size_t p0 = (a - base()) / page_, p1 = (a + b.span - 1 - base()) / page_;
  unref_pages(p0, p1);
  extents_.insert(a, b.span, streams_.on_free(fs));
  try_record(fs);
}

Heap* Allocator::heap_for(StreamState* st, std::uint64_t capture) {
  if (last_heap_ && last_heap_->stream == st && last_heap_->capture == capture) return last_heap_;
  auto& h = heaps_[{st, capture}];
  if (!h) {
    h = std::make_unique<Heap>();
    h->stream = st;
    h->capture = capture;
    if (capture) captures_[capture]->heaps.push_back(h.get());
  }
  last_heap_ = h.get();
  return h.get();
}

std::uintptr_t Allocator::slab_alloc(Heap* heap, int cls, Block* b) {
  SlabPage* sp = nullptr;
  if (!heap->partial[cls].empty()) {
    sp = heap->partial[cls].back();
  } else if (heap->empty[cls]) {
    sp = heap->empty[cls];
    heap->empty[cls] = nullptr;
    drop(stats_.slab_cached_pages);
    heap->add_partial(sp);
  } else {
    if (!(sp = new_slab_page(heap, cls))) return 0;
    heap->add_partial(sp);
  }
  std::uint32_t slot = sp->pop();
  if (sp->full()) heap->remove_partial(sp);
  b->slab = sp;
  b->slot = slot;
  b->span = class_size(cls);
  return base() + sp->page * page_ + slot * class_size(cls);
}

SlabPage* Allocator::new_slab_page(Heap* heap, int cls) {
  std::uintptr_t a = 0;
  Pieces taken;
  StreamState* user = heap->capture ? nullptr : heap->stream;
  if (!take_free(page_, page_, user, &a, &taken)) return nullptr;
  std::size_t pi = (a - base()) / page_;
  if (ref_pages(pi, pi, user) != OK) {
    give_back(taken);
    return nullptr;
  }
  auto sp = std::make_unique<SlabPage>();
  sp->page = static_cast<std::uint32_t>(pi);
  sp->cls = static_cast<std::uint16_t>(cls);
  sp->nslots = sp->nfree = static_cast<std::uint32_t>(page_ / class_size(cls));
  sp->heap = heap;
  SlabPage* raw = sp.get();
  slabs_[pi] = std::move(sp);
  return raw;
}

void Allocator::slab_put(SlabPage* sp, std::uint32_t slot, Tag tag) {
  Heap* h = sp->heap;
  bool was_full = sp->full();
  sp->push(slot);
  Tag joined;
  sp->last_free = merge_tags(sp->last_free, tag, &joined) ? joined : tag;
  if (was_full) h->add_partial(sp);
  if (!sp->empty() || (h->capture && !h->released)) return;
  h->remove_partial(sp);
  if (h->released) return release_slab_page(sp, sp->last_free);
  if (!h->empty[sp->cls]) {
    // Keep one empty slab per class mapped for a while: a loop that frees and re-allocates one
    // small tensor must not map and unmap a page each time.
    h->empty[sp->cls] = sp;
    sp->empty_since = now_ns();
    bump(stats_.slab_cached_pages);
    return;
  }
  release_slab_page(sp, sp->last_free);
  try_record(h->stream);
}

void Allocator::release_slab_page(SlabPage* sp, Tag tag) {
  std::size_t pi = sp->page;
  extents_.insert(base() + pi * page_, page_, tag);
  unref_pages(pi, pi);
  slabs_.erase(pi);  // frees sp
}

void Allocator::empty_cache() {
  std::lock_guard<std::mutex> g(mu_);
  if (!active_captures_.empty()) refresh_captures();
  flush_stash();
  poll_events(true);
  release_empty_slabs(false);
  reclaim_idle(SIZE_MAX, false);
  if (!capture::maybe_active()) ctx().trim(0);
}

void Allocator::set_lending(bool on) {
  std::lock_guard<std::mutex> g(mu_);
  opt_.reclaim_on_grow = on;
}

void Allocator::reset_peak() {
  stats_.peak_allocated_bytes.store(get(stats_.allocated_bytes), std::memory_order_relaxed);
  PhysCounters& p = ctx().stats();
  p.peak_mapped_bytes.store(get(p.mapped_bytes), std::memory_order_relaxed);
}

void Allocator::before_capture() {
  // torch.cuda.graph synchronizes before capture_begin: polling now marks those frees safe, so
  // the capture (which takes only safe memory) can reuse them.
  std::lock_guard<std::mutex> g(mu_);
  poll_events(false);
  extents_.coalesce();
}

void Allocator::sweep() {
  // (a replay on its own clock: its operations sweep, not the wall clock's thread)
  if (g_virtual_now_ns.load(std::memory_order_relaxed)) return;
  std::unique_lock<std::mutex> g(mu_, std::try_to_lock);
  if (!g.owns_lock()) return;
  if (!active_captures_.empty()) refresh_captures();
  sweeping_ = true;
  yielded_ = false;
  sweep_locked(false);
  sweeping_ = false;
  if (yielded_) bump(stats_.sweeps_yielded);
}

std::size_t Allocator::free_va_bytes() {
  std::lock_guard<std::mutex> g(mu_);
  return extents_.free_bytes();
}

std::size_t Allocator::largest_free_va() {
  std::lock_guard<std::mutex> g(mu_);
  return extents_.largest();
}

}  // namespace oxygen
