// C ABI of the pool: PyTorch's CUDAPluggableAllocator entry points (oxygen_malloc / oxygen_free,
// one lazily created pool per device, configured by oxygen_configure first) and the functions
// oxygen_torch/allocator.py calls through ctypes (VirtualPool, stats, captures, test knobs).
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <mutex>
#include <new>
#include <set>
#include <stdexcept>
#include <string>
#include <sys/types.h>

#include "allocator.h"
#include "capi_guard.h"
#include "capture.h"
#include "page_set.h"
#include "stats_export.h"

#define OXY_API extern "C" __attribute__((visibility("default")))

using namespace oxygen;

namespace {

struct GlobalConfig {
  std::string kind = "cuda";
  CtxOptions ctx;
  AllocOptions alloc;
  bool oom_throws = true;
};

constexpr int kMaxDevices = 64;
std::mutex g_mu;
GlobalConfig g_cfg;
// Leaked on purpose: PyTorch frees tensors during interpreter shutdown, after static destructors
// would have run, so the global pools must outlive everything.
std::atomic<Allocator*> g_pools[kMaxDevices] = {};
bool g_reported_no_pool = false;

Allocator* global_pool(int device, Status* s) {
  if (device < 0 || device >= kMaxDevices) {
    set_last_error("device index out of range");
    *s = ERR_INVALID;
    return nullptr;
  }
  if (Allocator* a = g_pools[device].load(std::memory_order_acquire)) return a;
  std::lock_guard<std::mutex> g(g_mu);
  if (Allocator* a = g_pools[device].load()) return a;
  auto ctx = DeviceCtx::shared(g_cfg.kind, device, g_cfg.ctx, s);
  if (!ctx) return nullptr;
  auto a = Allocator::create(ctx, g_cfg.alloc, s);
  if (!a) return nullptr;
  g_pools[device].store(a.get(), std::memory_order_release);
  return a.release();
}

std::string oom_message(Allocator* a, std::int64_t size) {
  const AllocCounters& s = a->counters();
  PhysCounters& p = a->ctx().stats();
  std::size_t fb = 0, tb = 0;
  if (!capture::maybe_active()) a->ctx().backend().mem_info(&fb, &tb);
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "CUDA out of memory (oxygen_torch pool, device %d). Tried to allocate %.2f MiB; "
                "live %.2f MiB, mapped %.2f MiB, reserved VA %.2f GiB, device free %.2f MiB of "
                "%.2f MiB. %s",
                a->ctx().device(), size / 1048576.0, get(s.allocated_bytes) / 1048576.0,
                get(p.mapped_bytes) / 1048576.0, get(p.reserved_va_bytes) / 1073741824.0,
                fb / 1048576.0, tb / 1048576.0, last_error());
  return buf;
}

// Status-returning body on a usable VirtualPool handle.
template <typename F>
int on_pool(void* pool, const char* where, F&& body) noexcept {
  return on_handle<Allocator>(
      pool, where, "pool", [](Allocator& a) { return a.ctx().inherited(); }, body);
}

// Counter exports answer how many values they wrote, or -status.
template <typename F>
int counted(void* pool, const char* where, F&& body) noexcept {
  int n = 0;
  int s = on_pool(pool, where, [&](Allocator* a) {
    n = body(a);
    return OK;
  });
  return s == OK ? n : -s;
}

int pageset_selftest(std::uint64_t seed, int pages, int ops) {
  PageSet ps(static_cast<std::size_t>(pages));
  std::set<std::size_t> ref;
  std::uint64_t x = seed | 1;
  auto rnd = [&x](std::size_t n) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<std::size_t>(x % n);
  };
  int bad = 0;
  for (int i = 0; i < ops; ++i) {
    std::size_t p = rnd(static_cast<std::size_t>(pages));
    if (rnd(3)) {
      bad += ps.insert(p) != ref.insert(p).second;
    } else {
      bad += ps.erase(p) != (ref.erase(p) == 1);
    }
    std::size_t q = rnd(static_cast<std::size_t>(pages));
    auto it = ref.lower_bound(q);
    bad += ps.next(q) != (it == ref.end() ? PageSet::npos : *it);
    auto up = ref.upper_bound(q);
    bad += ps.prev(q) != (up == ref.begin() ? PageSet::npos : *std::prev(up));
    bad += ps.last() != (ref.empty() ? PageSet::npos : *ref.rbegin());
    bad += ps.size() != ref.size() || ps.contains(p) != (ref.count(p) == 1);
  }
  return bad;
}

}  // namespace

void oxygen::capi_after_fork_child() {
  // The parent's global pools stay in g_pools (their blocks are the parent's; frees of them in
  // the child are ignored, allocations refused), the lock guarding their creation starts fresh.
  new (&g_mu) std::mutex();
}

// ---------------------------------------------------------------------------------------------
// Global route

// Whether a global pool exists (settings can no longer change), with `who`'s error set; g_mu held.
static bool global_pool_in_use(const char* who) {
  for (auto& a : g_pools)
    if (a.load()) {
      set_last_error(std::string(who) + ": the global pool is already in use");
      return true;
    }
  return false;
}

// Must precede the first oxygen_malloc; later calls with other settings fail with ERR_INVALID.
OXY_API int oxygen_configure(const char* backend, size_t page_size, double reserve_fraction,
                             size_t capacity, size_t low_pages, size_t high_pages,
                             uint64_t hysteresis_us, int oom_throws) {
  return guarded("oxygen_configure", [&]() -> int {
    std::lock_guard<std::mutex> g(g_mu);
    if (global_pool_in_use("oxygen_configure")) return ERR_INVALID;
    std::string kind = backend && *backend ? backend : "cuda";
    if (kind == "auto") kind = "cuda";
    if (kind != "cuda" && kind != "host") {
      set_last_error("oxygen_configure: backend must be auto, cuda or host");
      return ERR_INVALID;
    }
    if (page_size == 0 || !(reserve_fraction > 0 && reserve_fraction <= 1) ||
        hysteresis_us > UINT64_MAX / 1000) {
      set_last_error("oxygen_configure: page_size must be > 0, reserve_fraction in (0, 1] and "
                     "hysteresis_us below 2^64 ns");
      return ERR_INVALID;
    }
    g_cfg.kind = kind;
    g_cfg.ctx.page_size = page_size;
    g_cfg.ctx.reserve_fraction = reserve_fraction;
    g_cfg.ctx.capacity = capacity;
    if (low_pages) g_cfg.ctx.low_pages = low_pages;
    if (high_pages) g_cfg.ctx.high_pages = high_pages;
    if (hysteresis_us) g_cfg.alloc.hysteresis_ns = hysteresis_us * 1000;
    g_cfg.oom_throws = oom_throws != 0;
    return OK;
  });
}

// The one entry point that throws, on purpose. PyTorch's CUDAPluggableAllocator calls it from
// C++ and does not check for NULL (a null block fails later, far from the cause), so a failure is
// thrown as std::runtime_error, as PyTorch's own allocator throws on OOM; PyTorch turns it into a
// Python RuntimeError with our figures. Everything it calls runs guarded: only that one
// runtime_error, with a message, can leave it.
OXY_API void* oxygen_malloc(ssize_t size, int device, void* stream) {
  Allocator* a = nullptr;
  void* p = nullptr;
  int s = guarded("oxygen_malloc", [&]() -> int {
    Status st = OK;
    if (!(a = global_pool(device, &st))) return st;
    if (a->ctx().inherited()) return forked_handle("oxygen_malloc", "global pool");
    p = a->malloc(static_cast<std::int64_t>(size), stream, &st);
    return st;
  });
  if (p || !g_cfg.oom_throws) return p;
  if (s == ERR_OOM && a && !a->ctx().inherited()) throw std::runtime_error(oom_message(a, size));
  throw std::runtime_error("oxygen_torch: allocation of " + std::to_string(size) +
                           " bytes on device " + std::to_string(device) + " failed: " +
                           last_error());
}

OXY_API void oxygen_free(void* ptr, ssize_t size, int device, void* stream) {
  guarded("oxygen_free", [&]() -> int {
    Allocator* a = device >= 0 && device < kMaxDevices ? g_pools[device].load() : nullptr;
    if (a && a->ctx().inherited()) return OK;  // the parent's block: the parent frees it
    if (a) return a->free(ptr, static_cast<std::int64_t>(size), stream);
    if (!g_reported_no_pool)
      std::fprintf(stderr, "oxygen_torch: free of 0x%" PRIxPTR " on device %d, which has no "
                   "pool; ignored\n", reinterpret_cast<std::uintptr_t>(ptr), device);
    g_reported_no_pool = true;
    return OK;
  });
}

// The global pool of `device`, or NULL before its first allocation (for stats) and in a forked
// child for the parent's pool, which the child cannot use.
OXY_API void* oxygen_global_pool(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  Allocator* a = g_pools[device].load();
  return a && !a->ctx().inherited() ? a : nullptr;
}

// ---------------------------------------------------------------------------------------------
// VirtualPool

OXY_API int oxygen_pool_create(const char* kind, int device, size_t page_size, size_t capacity,
                               double reserve_fraction, size_t low_pages, size_t high_pages,
                               uint64_t hysteresis_us, void** out) {
  return guarded("oxygen_pool_create", [&]() -> int {
    if (!out || !kind) return invalid_handle("oxygen_pool_create", "output or backend name");
    *out = nullptr;
    if (hysteresis_us > UINT64_MAX / 1000) {
      set_last_error("oxygen_pool_create: hysteresis_us must be below 2^64 ns");
      return ERR_INVALID;
    }
    CtxOptions co;
    co.page_size = page_size;
    co.capacity = capacity;
    co.reserve_fraction = reserve_fraction;
    if (low_pages) co.low_pages = low_pages;
    if (high_pages) co.high_pages = high_pages;
    AllocOptions ao;
    if (hysteresis_us) ao.hysteresis_ns = hysteresis_us * 1000;
    Status s;
    auto ctx = DeviceCtx::create(kind, device, co, &s);
    if (!ctx) return s;
    auto a = Allocator::create(ctx, ao, &s);
    if (!a) return s;
    *out = a.release();
    return OK;
  });
}

// In a forked child the parent's pool is only forgotten: its teardown would lock the parent's
// locks and join threads the child does not have. No other call may be running on the handle:
// the caller waits for them (oxygen_torch/pool/objects.py, _Handle: close() racing a malloc on
// another thread freed the pool under it).
OXY_API int oxygen_pool_destroy(void* pool) {
  return guarded("oxygen_pool_destroy", [&]() -> int {
    auto* a = static_cast<Allocator*>(pool);
    if (a && !a->ctx().inherited()) delete a;
    return OK;
  });
}

OXY_API int oxygen_pool_malloc(void* pool, int64_t size, void* stream, void** out) {
  if (out) *out = nullptr;
  return on_pool(pool, "malloc", [&](Allocator* a) -> int {
    if (!out) return invalid_handle("malloc", "output");
    Status s;
    *out = a->malloc(size, stream, &s);
    return s;
  });
}

OXY_API int oxygen_pool_free(void* pool, void* ptr, int64_t size, void* stream) {
  return on_pool(pool, "free", [&](Allocator* a) -> int { return a->free(ptr, size, stream); });
}

OXY_API int oxygen_pool_record_stream(void* pool, void* ptr, void* stream) {
  return on_pool(pool, "record_stream",
                 [&](Allocator* a) -> int { return a->record_stream(ptr, stream); });
}

OXY_API int oxygen_pool_empty_cache(void* pool) {
  return on_pool(pool, "empty_cache", [](Allocator* a) -> int {
    a->empty_cache();
    return OK;
  });
}

OXY_API int oxygen_pool_reset_peak(void* pool) {
  return on_pool(pool, "reset_peak", [](Allocator* a) -> int {
    a->reset_peak();
    return OK;
  });
}

// Whether a growing block takes idle pages' handles (lend) before mapping new pages.
OXY_API int oxygen_pool_set_lending(void* pool, int on) {
  return on_pool(pool, "set_lending", [&](Allocator* a) -> int {
    a->set_lending(on != 0);
    return OK;
  });
}

// The global pools' lending (oxygen_pool_set_lending), before their first allocation.
OXY_API int oxygen_configure_lending(int on) {
  return guarded("oxygen_configure_lending", [&]() -> int {
    std::lock_guard<std::mutex> g(g_mu);
    if (global_pool_in_use("oxygen_configure_lending")) return ERR_INVALID;
    g_cfg.alloc.reclaim_on_grow = on != 0;
    return OK;
  });
}

// Create physical handles now until `bytes` worth are cached (the "prepared ahead" of growth).
OXY_API int oxygen_pool_prepare(void* pool, size_t bytes) {
  return on_pool(pool, "prepare", [&](Allocator* a) -> int {
    DeviceCtx& c = a->ctx();
    return c.prepare(bytes / c.page() + (bytes % c.page() != 0));  // no bytes + page - 1: wraps
  });
}

OXY_API int oxygen_pool_mem_info(void* pool, size_t* free_bytes, size_t* total_bytes) {
  return on_pool(pool, "mem_info", [&](Allocator* a) -> int {
    if (!free_bytes || !total_bytes) return invalid_handle("mem_info", "output");
    return a->ctx().backend().mem_info(free_bytes, total_bytes);
  });
}

// Backend name, or "" for an unusable handle.
OXY_API const char* oxygen_pool_backend(void* pool) {
  const char* name = "";
  on_pool(pool, "backend", [&](Allocator* a) -> int {
    name = a->ctx().kind().c_str();
    return OK;
  });
  return name;
}

// Device index, or -1 for an unusable handle.
OXY_API int oxygen_pool_device(void* pool) {
  int dev = -1;
  on_pool(pool, "device", [&](Allocator* a) -> int {
    dev = a->ctx().device();
    return OK;
  });
  return dev;
}

// Base address of the pool's range, or 0 for an unusable handle.
OXY_API uint64_t oxygen_pool_base(void* pool) {
  uint64_t base = 0;
  on_pool(pool, "base", [&](Allocator* a) -> int {
    base = a->base();
    return OK;
  });
  return base;
}

// Comma-separated names of the values oxygen_pool_stats writes, in order.
OXY_API const char* oxygen_stats_names() { return stats_names(); }

// Reads the counters (atomics: no allocation lock is taken). Returns how many were written, or
// -status.
OXY_API int oxygen_pool_stats(void* pool, uint64_t* out, int n) {
  return counted(pool, "stats", [&](Allocator* a) {
    return export_stats(&a->counters(), a->ctx(), a->va_bytes(), a->mapped_bytes(),
                        &a->range_moves(), out, n);
  });
}

// Per-page map latency histogram: bucket i counts pages mapped in < 2^i us (last: the rest).
OXY_API int oxygen_pool_latency_hist(void* pool, uint64_t* out, int n) {
  return counted(pool, "latency_histogram", [&](Allocator* a) {
    return export_hist(a->ctx(), out, n);
  });
}

// malloc + free of `size` bytes `iters` times from C (no Python in the loop); ns per pair, or -1.
OXY_API double oxygen_pool_bench(void* pool, int64_t size, int iters, void* stream) {
  double ns = -1.0;
  on_pool(pool, "bench", [&](Allocator* a) -> int {
    Status s;
    std::uint64_t t0 = now_ns();
    for (int i = 0; i < iters; ++i) {
      void* p = a->malloc(size, stream, &s);
      if (!p) return s;
      a->free(p, size, stream);
    }
    ns = static_cast<double>(now_ns() - t0) / (iters > 0 ? iters : 1);
    return OK;
  });
  return ns;
}

// ---------------------------------------------------------------------------------------------
// CUDA-graph capture announcements (Python wraps torch.cuda.CUDAGraph) and host test knobs

OXY_API uint64_t oxygen_capture_begin() {
  return guarded_value<uint64_t>("capture_begin", 0, [] { return capture::announce_begin(); });
}
OXY_API void oxygen_capture_end(uint64_t token) {
  guarded("capture_end", [&] {
    capture::announce_end(token);
    return OK;
  });
}
OXY_API void oxygen_capture_release(uint64_t token) {
  guarded("capture_release", [&] {
    capture::release(token);
    return OK;
  });
}
OXY_API int oxygen_capture_maybe_active() { return capture::maybe_active() ? 1 : 0; }
// A replay's own clock, in ns (stats.h g_virtual_now_ns); 0: back to the steady clock. For
// single-threaded replays of allocation traces (benchmarks, tests), not for running programs.
OXY_API void oxygen_set_virtual_clock(uint64_t ns) {
  g_virtual_now_ns.store(ns, std::memory_order_relaxed);
}
// Python's atexit: stop the background threads before the interpreter and the driver go away.
OXY_API void oxygen_shutdown() {
  guarded("shutdown", [] {
    DeviceCtx::stop_all_threads();
    return OK;
  });
}
// Self-test of the idle-page bitmap against std::set: random inserts and erases, then next(),
// prev() and last() from random points. Returns the number of disagreements (0 = correct), or -1.
OXY_API int oxygen_pageset_selftest(uint64_t seed, int pages, int ops) {
  if (pages <= 0 || ops < 0) return -1;
  return guarded_value("pageset_selftest", -1, [&] { return pageset_selftest(seed, pages, ops); });
}

OXY_API void oxygen_host_hold_events(int hold) { host_hold_events(hold != 0); }
OXY_API void oxygen_host_set_event_lag(std::uint64_t ns) {
  guarded("host_set_event_lag", [&] {
    host_set_event_lag(ns);
    return OK;
  });
}
OXY_API void oxygen_host_set_create_delay(std::uint64_t ns) {
  guarded("host_set_create_delay", [&] {
    host_set_create_delay(ns);
    return OK;
  });
}
OXY_API void oxygen_host_set_unmap_delay(std::uint64_t ns) {
  guarded("host_set_unmap_delay", [&] {
    host_set_unmap_delay(ns);
    return OK;
  });
}
OXY_API void oxygen_host_set_capture(void* stream, uint64_t id) {
  guarded("host_set_capture", [&] {
    host_set_capture(stream, id);
    return OK;
  });
}
