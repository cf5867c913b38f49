// Physical pages of one device: a DeviceCtx owns the backend, a cache of physical handles created
// ahead by a background refill thread, and the counters; a PageRange is one reserved virtual range
// (the pool's, or a KV arena's) whose pages are mapped and unmapped with handles from that cache.
//
// Why handles are created ahead: on the H200 a 2 MiB page costs create 12.7 us + map 3.7 us +
// set-access 30.1 us; creating on a background thread takes the first term off the allocating
// thread (set-access is per mapping and cannot be prepared without choosing the address).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "fork.h"
#include "stats.h"
#include "vmm_backend.h"

namespace oxygen {

struct CtxOptions {
  std::size_t page_size = 2u << 20;  // 2 MiB: the VMM granularity the H200 reports
  std::size_t capacity = 0;          // physical bytes; 0 = total device memory x reserve_fraction
  double reserve_fraction = 0.9;
  std::size_t low_pages = 4;         // refill wakes below this many cached handles...
  std::size_t high_pages = 16;       // ...and fills up to this many (32 MiB held unmapped)
};

class DeviceCtx {
 public:
  // kind: "host" or "cuda". On failure returns nullptr with *status and last_error() set.
  static std::shared_ptr<DeviceCtx> create(const std::string& kind, int device,
                                           const CtxOptions& opt, Status* status);
  // The context shared by the global allocator and the KV arenas of (kind, device, page size).
  static std::shared_ptr<DeviceCtx> shared(const std::string& kind, int device,
                                           const CtxOptions& opt, Status* status);
  ~DeviceCtx();
  DeviceCtx(const DeviceCtx&) = delete;
  DeviceCtx& operator=(const DeviceCtx&) = delete;

  Backend& backend() { return *backend_; }
  const std::string& kind() const { return kind_; }
  int device() const { return device_; }
  std::size_t page() const { return page_; }
  std::size_t max_pages() const { return max_pages_; }
  std::size_t owned_pages() const { return owned_.load(std::memory_order_relaxed); }
  PhysCounters& stats() { return stats_; }
  // Created before a fork() this process is the child of: it belongs to the parent (fork.h).
  bool inherited() const { return generation_ != fork_state::generation(); }

  // A handle for one page: cached if any, else created here (counted as inline). ERR_OOM when the
  // capacity is reached or the device has no memory left.
  Status acquire(PhysHandle* handle);
  // Return an unmapped page's handle: cached up to the high watermark, released beyond it (kept
  // while a capture may be in progress: release is not on the list of calls proven safe there).
  void give_back(PhysHandle handle);
  // Release cached handles down to `keep`.
  void trim(std::size_t keep);
  // Create handles now until `pages` are cached (the benchmark's "prepared ahead").
  Status prepare(std::size_t pages);

  // Stops the background thread for good (process exit: the driver may be torn down next).
  void stop_thread();
  // Every live context's stop_thread(): called from Python's atexit.
  static void stop_all_threads();

  // Periodic work run on the background thread (the allocator's hysteresis sweep).
  void add_sweeper(void* key, std::function<void()> fn);
  void remove_sweeper(void* key);

 private:
  DeviceCtx(std::unique_ptr<Backend> be, std::string kind, int device, const CtxOptions& opt,
            std::size_t max_pages);
  void run();
  void refill();
  void start_thread();

  std::unique_ptr<Backend> backend_;
  std::uint64_t generation_;
  std::string kind_;
  int device_;
  std::size_t page_;
  std::size_t max_pages_;
  std::size_t low_, high_;
  PhysCounters stats_;

  std::mutex mu_;  // the per-device lock for physical pages
  std::condition_variable cv_;
  std::vector<PhysHandle> cache_;
  std::atomic<std::size_t> owned_{0};  // handles alive: mapped + cached + being created
  // Handles the refill thread is creating (counted in owned_, not yet in cache_). An acquire that
  // finds the cache empty and owned_ at capacity waits for them instead of reporting OOM: the
  // last pages of the capacity may be on their way (a spurious OOM seen on a loaded CI machine).
  std::size_t creating_ = 0;
  std::condition_variable created_cv_;
  bool stop_ = false;
  bool refill_failed_ = false;  // device out of memory: wait for a give_back before retrying
  // trim(0) (empty_cache, teardown) asked for every cached handle back: the refill thread stays
  // idle until the next acquire or prepare, instead of re-creating 32 MiB a few ms later.
  bool refill_paused_ = false;
  std::thread thread_;

  std::mutex sweep_mu_;
  std::vector<std::pair<void*, std::function<void()>>> sweepers_;
};

// One reserved virtual range, mapped page by page. Not thread-safe: the owner serialises calls
// (the allocator's lock, or the arena's); is_mapped() and mapped_pages() may be read from anywhere.
class PageRange {
 public:
  PageRange(std::shared_ptr<DeviceCtx> ctx, std::size_t pages, Status* status);
  ~PageRange();
  PageRange(const PageRange&) = delete;
  PageRange& operator=(const PageRange&) = delete;

  std::uintptr_t base() const { return base_; }
  std::size_t pages() const { return pages_; }
  std::size_t page() const { return ctx_->page(); }
  DeviceCtx& ctx() { return *ctx_; }

  // Map `count` unmapped pages from `first`, all or nothing; set-access once over the run.
  Status map(std::size_t first, std::size_t count);
  // Unmap mapped pages; their handles go back to the cache (a page that lent its handle keeps
  // nothing: the handle now belongs to the borrower).
  Status unmap(std::size_t first, std::size_t count);
  // Whether [first, first + count) is a non-empty run of this range's pages; written so that no
  // sum can wrap (a first of SIZE_MAX, from -1 in Python, once passed `first + count > pages`).
  bool in_range(std::size_t first, std::size_t count) const {
    return count > 0 && first < pages_ && count <= pages_ - first;
  }
  // Map unmapped page `dst` onto the physical handle of mapped page `src`, which stays mapped (its
  // old contents are seen through both addresses) until unmap(src). Physical memory: unchanged.
  Status lend(std::size_t src, std::size_t dst);
  bool is_mapped(std::size_t i) const {
    return i < pages_ && mapped_[i].load(std::memory_order_acquire) != 0;
  }
  std::size_t mapped_pages() const { return nmapped_.load(std::memory_order_relaxed); }
  // This range's own share of the context's num_maps / num_unmaps / map_ns / unmap_ns (the
  // context's counters add the pool's range and every KV arena's together).
  struct Moves {
    Counter maps{0}, unmaps{0}, map_ns{0}, unmap_ns{0};
  };
  const Moves& moves() const { return moves_; }

 private:
  Status map_one(std::size_t i);
  void unmap_one(std::size_t i);

  std::shared_ptr<DeviceCtx> ctx_;
  std::size_t pages_ = 0;
  std::uintptr_t base_ = 0;
  std::vector<PhysHandle> handles_;
  std::vector<std::uint8_t> lent_;  // mapped, but its handle was lent (see lend())
  std::unique_ptr<std::atomic<std::uint8_t>[]> mapped_;
  std::atomic<std::size_t> nmapped_{0};
  Moves moves_;
};

}  // namespace oxygen
