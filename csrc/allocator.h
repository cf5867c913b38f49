// The pool's sub-allocator: one reserved virtual range per pool, blocks placed in it, physical
// pages mapped exactly while a live block (or a slab) touches them.
//
//   small (<= 1 MiB and <= half a page): best fit at 512 B granularity inside pages kept for
//          small blocks only (allocator_small.cpp), shared by every size and stream; a capture's
//          small blocks come from size-classed slabs private to it (slab.h);
//   large: best fit over the free ranges at 512 B granularity, not rounded to pages, so the only
//          waste is the unused part of boundary pages; a per-page reference count says when a page
//          has nothing live (it then idles for a short hysteresis and is unmapped once safe).
//
// Stream order (streams.h), CUDA-graph captures (capture.h) and errors are handled here; all of it
// under one lock per pool (PyTorch's caching allocator also serialises per device). Counters are
// atomics in stats.h, read without the lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "extents.h"
#include "page_pool.h"
#include "page_set.h"
#include "slab.h"
#include "stats.h"
#include "streams.h"

namespace oxygen {

struct AllocOptions {
  double va_factor = 2.0;                  // virtual range = capacity x this (holes never starve it)
  std::uint64_t hysteresis_ns = 2000000;   // an idle page stays mapped this long (2 ms)
  bool reclaim_on_grow = true;             // lend idle pages' handles before mapping new ones
};

struct Block {
  std::uintptr_t addr = 0;
  std::size_t requested = 0;  // as asked
  std::size_t bytes = 0;      // rounded to 512 B: what allocated_bytes counts, as in PyTorch
  std::size_t span = 0;       // virtual bytes held (slab: the class size)
  StreamState* stream = nullptr;
  SlabPage* slab = nullptr;   // small blocks of a capture
  bool small = false;         // on a small-block page (allocator_small.cpp)
  std::uint32_t slot = 0;
  std::uint64_t capture = 0;  // capture sequence id that allocated it, 0 = general
  std::vector<StreamState*> used_on;  // other streams recorded on it (record_stream)
};

struct CaptureState {
  std::uint64_t id = 0;
  void* stream = nullptr;
  std::uint64_t token = 0;   // announced by Python (0: unannounced, see allocator_capture.cpp)
  bool active = true;
  bool released = false;
  std::multimap<std::size_t, std::uintptr_t> reusable;           // large, freed inside capture
  std::vector<std::pair<std::uintptr_t, std::size_t>> quarantine;  // freed after it ended
  std::size_t quarantined = 0;  // bytes counted in quarantined_bytes for this capture
  bool release_queued = false;
  std::vector<Heap*> heaps;
};

class Allocator {
 public:
  static std::unique_ptr<Allocator> create(std::shared_ptr<DeviceCtx> ctx,
                                           const AllocOptions& opt, Status* status);
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // nullptr with *status ERR_OOM (after reclaiming) or ERR_INVALID (absurd size, reported once).
  void* malloc(std::int64_t size, void* stream, Status* status);
  // ERR_INVALID for an unknown pointer or a double free (reported once, counted, ignored).
  Status free(void* ptr, std::int64_t size, void* stream);
  // The live block starting at ptr is used on `stream` too (torch's record_stream): when it is
  // freed, no one reuses it before `stream` has passed the free. ERR_INVALID: not a live block.
  Status record_stream(void* ptr, void* stream);
  // Waits for the device, then unmaps every idle page, drops cached slabs and cached handles.
  void empty_cache();
  void reset_peak();
  void set_lending(bool on);  // opt_.reclaim_on_grow, under the lock
  // Periodic hysteresis work (background thread); skips if the lock is busy, and stops its
  // unmaps early for an allocating thread waiting on the lock (yield_to_waiter).
  void sweep();
  void release_capture(std::uint64_t token);
  void before_capture();

  AllocCounters& counters() { return stats_; }
  DeviceCtx& ctx() { return range_->ctx(); }
  std::uintptr_t base() const { return range_->base(); }
  std::size_t va_bytes() const { return range_->pages() * page_; }
  // Physical bytes this pool maps (its share of the device context's mapped_bytes, which the KV
  // arenas share): a page that lent its handle is mapped twice but counted once. Lock-free.
  std::size_t mapped_bytes() const {
    std::size_t m = range_->mapped_pages(), lent = get(stats_.lent_pending);
    return (m > lent ? m - lent : 0) * page_;
  }
  const PageRange::Moves& range_moves() const { return range_->moves(); }
  std::size_t free_va_bytes();
  std::size_t largest_free_va();

 private:
  Allocator(std::unique_ptr<PageRange> range, const AllocOptions& opt);

  // placement (allocator.cpp)
  std::uintptr_t place(std::size_t bytes, StreamState* st, CaptureState* cap, Block* b);
  std::uintptr_t large_alloc(std::size_t bytes, StreamState* st, CaptureState* cap, Block* b);
  using Pieces = FreeExtents::Pieces;
  // Carves a free range for a new block (placement over idle pages first, then best fit); the
  // pieces it came from, with their tags, go back with give_back() if mapping fails.
  bool take_free(std::size_t bytes, std::size_t align, const StreamState* user,
                 std::uintptr_t* addr, Pieces* pieces);
  bool place_on_idle(std::size_t bytes, std::size_t align, const StreamState* user,
                     std::uintptr_t* addr, Pieces* pieces);
  void give_back(const Pieces& pieces);
  std::size_t unmapped_pages(std::uintptr_t a, std::size_t bytes) const;
  // small blocks (allocator_small.cpp)
  std::uintptr_t small_alloc(std::size_t bytes, StreamState* st, Block* b);
  bool new_small_page(StreamState* st);
  void small_free(const Block& b, StreamState* fs, bool stash);
  void release_small_page(std::size_t p);
  void release_cached_small(bool aged_only);
  std::uintptr_t slab_alloc(Heap* heap, int cls, Block* b);
  SlabPage* new_slab_page(Heap* heap, int cls);
  void slab_put(SlabPage* sp, std::uint32_t slot, Tag tag);
  void release_slab_page(SlabPage* sp, Tag tag);
  void large_free(const Block& b, StreamState* fs);
  void free_block(const Block& b, StreamState* fs, bool stash = false);
  Heap* heap_for(StreamState* st, std::uint64_t capture);
  void report(const char* kind, std::uintptr_t ptr, std::int64_t size);

  // pages (allocator_pages.cpp)
  Status ref_pages(std::size_t p0, std::size_t p1, const StreamState* user);
  void lend_idle(std::size_t p0, std::size_t p1, const StreamState* user,
                 std::size_t most = SIZE_MAX);
  void retire_lent(std::size_t max_pages);
  static constexpr std::size_t kSweepUnmaps = 128;
  // A periodic sweep's unmaps (20-50 us each on an H100 / H200) hold the lock that malloc and
  // free wait on: past kSweepFloor of them it stops for a thread waiting there (the next sweep,
  // 5 ms on, goes on). The floor keeps memory coming back under a steady stream of mallocs.
  static constexpr std::size_t kSweepFloor = 8;
  bool yield_to_waiter(std::size_t done);
  std::atomic<int> waiters_{0};  // threads in malloc / free waiting for mu_
  bool sweeping_ = false;        // in sweep() (the background thread's): it may yield
  bool yielded_ = false;         // this sweep stopped early for a waiter
  void unref_pages(std::size_t p0, std::size_t p1);
  void make_idle(std::size_t p, std::uint64_t now);  // idle since `now` (now_ns())
  void unidle(std::size_t p);
  Status map_missing(std::size_t p0, std::size_t p1);
  std::size_t reclaim_idle(std::size_t max_pages, bool aged_only);
  void release_empty_slabs(bool aged_only);
  void sweep_locked(bool force);
  void poll_events(bool sync);
  void try_record(StreamState* s);

  // captures (allocator_capture.cpp)
  CaptureState* capture_for(std::uint64_t id, void* stream);
  void refresh_captures();
  void end_capture(CaptureState* c);
  void free_capture_block(const Block& b, StreamState* fs);
  void finish_release(CaptureState* c);
  void process_pending_releases();

  std::mutex mu_;
  std::unique_ptr<PageRange> range_;
  std::size_t page_;
  std::size_t slab_max_;
  AllocOptions opt_;
  AllocCounters stats_;
  Streams streams_;
  FreeExtents extents_;
  std::vector<std::pair<std::uintptr_t, std::size_t>> fits_;  // take_free's scratch
  FreeExtents small_;                      // free space on small-block pages (never joined
                                           // across pages: a block stays on one page)
  std::vector<std::uint32_t> small_live_;  // live small blocks on each small-block page
  std::size_t small_empty_ = PageSet::npos;  // one empty small-block page kept for reuse
  std::uint64_t small_empty_since_ = 0;
  // The last small block freed on the stream it was allocated on, not yet given back to small_
  // (still counted on its page): a malloc of the same bytes on that stream takes it as it is,
  // the common free-then-allocate of one tensor shape skipping both indexes. Given back at the
  // next such free and first thing in every sweep, reclaim and empty_cache (flush_stash: before
  // their event polls, so that a synchronizing one finds the block's ticket done).
  struct SmallStash {
    std::uintptr_t addr = 0;
    std::size_t span = 0;
    StreamState* stream = nullptr;
  } stash_;
  void small_give_back(std::uintptr_t addr, std::size_t span, StreamState* fs);
  void flush_stash();
  std::vector<std::uint32_t> refcnt_;      // live blocks / slabs touching each page
  std::vector<std::uint64_t> idle_since_;  // when each idle page became idle
  PageSet idle_;                           // mapped pages with refcnt 0
  struct Lent {
    std::size_t page;  // still mapped, its handle now backs another page; unmapped once safe
    Pieces pieces;     // its free ranges, out of extents_ meanwhile
  };
  std::vector<Lent> lent_;
  struct Deferred {  // a freed block recorded on other streams: freed once each has passed
    Block block;
    StreamState* stream;     // the stream it was freed on
    std::vector<Tag> after;  // a ticket on each recorded stream, taken at the free
  };
  std::vector<Deferred> deferred_;
  void free_deferred();  // those whose streams have passed (caller polled events)
  std::unordered_map<std::uintptr_t, Block> live_;
  // Nodes of freed blocks, reused by the next mallocs (a heap allocation and free a block saved;
  // the same for FreeExtents' indexes, extents.h).
  std::vector<std::unordered_map<std::uintptr_t, Block>::node_type> spare_live_;
  std::unordered_map<std::size_t, std::unique_ptr<SlabPage>> slabs_;
  std::map<std::pair<StreamState*, std::uint64_t>, std::unique_ptr<Heap>> heaps_;
  Heap* last_heap_ = nullptr;
  std::map<std::uint64_t, std::unique_ptr<CaptureState>> captures_;
  std::vector<CaptureState*> active_captures_;
  std::vector<CaptureState*> pending_release_;
  std::uint64_t last_sweep_ = 0;
  // The live bytes' recent peak: the larger of this epoch's and the last one's (epochs of
  // kPeakEpochNs), and when the last allocation came. While allocations come, idle pages that
  // keep mapped bytes within the recent peak stay mapped past their hysteresis (reclaim_idle).
  static constexpr std::uint64_t kPeakEpochNs = 1000000000;  // 1 s
  std::uint64_t last_alloc_ns_ = 0;
  std::uint64_t epoch_start_ns_ = 0;
  std::size_t live_peak_cur_ = 0, live_peak_prev_ = 0;
  std::size_t live_peak_ever_ = 0;  // (not reset by reset_peak(): the lending rule's bound)
  void note_live(std::uint64_t now);
  std::size_t keep_pages(std::uint64_t now) const;
  std::size_t recent_peak() const {
    return live_peak_cur_ > live_peak_prev_ ? live_peak_cur_ : live_peak_prev_;
  }
  bool reported_bad_free_ = false;
  bool reported_bad_size_ = false;
  bool reported_mismatch_ = false;
};

}  // namespace oxygen
