// Counters of one device context and one allocator, as relaxed atomics: metric readers (the C ABI,
// the Prometheus exporter) read them without taking any allocation lock, so a reader can never
// stall a malloc, and a malloc never waits for a reader.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>

namespace oxygen {

using Counter = std::atomic<std::uint64_t>;

inline void bump(Counter& c, std::uint64_t by = 1) { c.fetch_add(by, std::memory_order_relaxed); }
inline void drop(Counter& c, std::uint64_t by = 1) { c.fetch_sub(by, std::memory_order_relaxed); }
inline std::uint64_t get(const Counter& c) { return c.load(std::memory_order_relaxed); }

inline void raise_peak(Counter& peak, std::uint64_t value) {
  std::uint64_t p = peak.load(std::memory_order_relaxed);
  while (value > p && !peak.compare_exchange_weak(p, value, std::memory_order_relaxed)) {
  }
}

// A replay's own clock (oxygen_set_virtual_clock; 0: the steady clock). While it is set, every
// time the pools read (hysteresis, the recent peak's epochs, the host backend's events) is the
// replay's, and the background sweeps skip: a single-threaded replay makes the same decisions
// on every run, however fast it runs (benchmarks/host_random.py).
extern std::atomic<std::uint64_t> g_virtual_now_ns;

inline std::uint64_t now_ns() {
  std::uint64_t v = g_virtual_now_ns.load(std::memory_order_relaxed);
  if (v) return v;
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                        std::chrono::steady_clock::now().time_since_epoch())
                                        .count());
}

// Map-latency histogram: bucket i counts per-page latencies below 2^i microseconds (the last
// bucket takes everything slower). Per page because one map call may cover many pages.
constexpr int kLatencyBuckets = 16;

inline int latency_bucket(std::uint64_t ns) {
  std::uint64_t us = ns / 1000;
  int b = 0;
  while (b < kLatencyBuckets - 1 && (std::uint64_t{1} << b) <= us) ++b;
  return b;
}

// Physical side, shared by the pool and the KV arenas of one device context.
struct PhysCounters {
  Counter mapped_bytes{0};
  Counter peak_mapped_bytes{0};
  Counter reserved_va_bytes{0};
  Counter live_ranges{0};          // reserved virtual ranges (pool + arenas)
  Counter handle_cache_pages{0};   // created handles not mapped anywhere
  Counter handles_created{0};
  Counter handles_released{0};
  Counter handles_created_inline{0};  // created on an allocating thread (refill was behind)
  Counter num_maps{0};             // pages mapped
  Counter num_unmaps{0};           // pages unmapped
  Counter map_ns{0};               // total time of map + set_access, summed per page
  Counter unmap_ns{0};
  Counter map_hist[kLatencyBuckets]{};
};

// Sub-allocation side, one per allocator (VirtualPool or the global route's per-device pool).
struct AllocCounters {
  Counter allocated_bytes{0};      // live blocks, sizes rounded up to 512 B as PyTorch counts
  Counter peak_allocated_bytes{0};
  Counter requested_bytes{0};      // live blocks, sizes as requested
  Counter live_blocks{0};
  Counter num_allocs{0};
  Counter num_frees{0};
  Counter num_ooms{0};
  Counter num_bad_frees{0};        // double free or unknown pointer (ignored)
  Counter num_bad_sizes{0};        // negative or larger than the reservation (NULL returned)
  Counter num_size_mismatch{0};    // free() told a size other than the block's (recorded used)
  Counter last_bad_pointer{0};
  Counter capture_allocs{0};       // blocks handed out while their stream was capturing
  Counter quarantined_bytes{0};    // freed capture blocks held until their graph is released
  Counter idle_pages{0};           // mapped pages with nothing live, waiting for hysteresis
  Counter slab_cached_pages{0};    // empty small-block / slab pages kept for reuse
  Counter small_pages{0};          // pages holding small blocks (<= 1 MiB), cached one included
  Counter events_recorded{0};
  Counter reclaims{0};             // idle pages unmapped to make room (OOM path)
  Counter pages_lent{0};           // idle pages whose handle backed a new block (see lend_idle)
  Counter lent_pending{0};         // of those, still mapped at their old address (not retired)
  Counter deferred_bytes{0};       // freed blocks held until the streams recorded on them pass
  Counter sweeps_yielded{0};       // periodic sweeps that stopped unmapping for a waiting malloc
};

}  // namespace oxygen
