// C ABI of the pool: PyTorch's CUDAPluggableAllocator entry points (oxygen_malloc / oxygen_free,
// one lazily created pool per device, configured by oxygen_configure first) and the functions
// oxygen_torch/allocator.py calls through ctypes (VirtualPool, stats, captures, test knobs).
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <sys/types.h>

#include "allocator.h"
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
                fb / 1048576.0, tb / 1048576.0, last_error().c_str());
  return buf;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Global route

// Must precede the first oxygen_malloc; later calls with other settings fail with ERR_INVALID.
OXY_API int oxygen_configure(const char* backend, size_t page_size, double reserve_fraction,
                             size_t capacity, size_t low_pages, size_t high_pages,
                             uint64_t hysteresis_us, int oom_throws) {
  std::lock_guard<std::mutex> g(g_mu);
  for (auto& a : g_pools)
    if (a.load()) {
      set_last_error("oxygen_configure: the global pool is already in use");
      return ERR_INVALID;
    }
  std::string kind = backend && *backend ? backend : "cuda";
  if (kind == "auto") kind = "cuda";
  if (kind != "cuda" && kind != "host") {
    set_last_error("oxygen_configure: backend must be auto, cuda or host");
    return ERR_INVALID;
  }
  if (page_size == 0 || reserve_fraction <= 0 || reserve_fraction > 1) {
    set_last_error("oxygen_configure: page_size must be > 0 and reserve_fraction in (0, 1]");
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
}

// PyTorch's CUDAPluggableAllocator does not check for NULL, so on OOM this throws (like PyTorch's
// own allocator does); PyTorch turns it into a Python RuntimeError with our figures.
OXY_API void* oxygen_malloc(ssize_t size, int device, void* stream) {
  Status s = OK;
  Allocator* a = global_pool(device, &s);
  void* p = a ? a->malloc(static_cast<std::int64_t>(size), stream, &s) : nullptr;
  if (p || !g_cfg.oom_throws) return p;
  if (!a) throw std::runtime_error("oxygen_torch: could not create the pool for device " +
                                   std::to_string(device) + ": " + last_error());
  throw std::runtime_error(oom_message(a, size));
}

OXY_API void oxygen_free(void* ptr, ssize_t size, int device, void* stream) {
  Allocator* a = device >= 0 && device < kMaxDevices ? g_pools[device].load() : nullptr;
  if (a) {
    a->free(ptr, static_cast<std::int64_t>(size), stream);
    return;
  }
  if (!g_reported_no_pool)
    std::fprintf(stderr, "oxygen_torch: free of 0x%" PRIxPTR " on device %d, which has no pool; "
                 "ignored\n", reinterpret_cast<std::uintptr_t>(ptr), device);
  g_reported_no_pool = true;
}

// The global pool of `device`, or NULL before its first allocation (for stats).
OXY_API void* oxygen_global_pool(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return g_pools[device].load();
}

// ---------------------------------------------------------------------------------------------
// VirtualPool

OXY_API int oxygen_pool_create(const char* kind, int device, size_t page_size, size_t capacity,
                               double reserve_fraction, size_t low_pages, size_t high_pages,
                               uint64_t hysteresis_us, void** out) {
  *out = nullptr;
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
}

OXY_API void oxygen_pool_destroy(void* pool) { delete static_cast<Allocator*>(pool); }

OXY_API int oxygen_pool_malloc(void* pool, int64_t size, void* stream, void** out) {
  Status s;
  *out = static_cast<Allocator*>(pool)->malloc(size, stream, &s);
  return s;
}

OXY_API int oxygen_pool_free(void* pool, void* ptr, int64_t size, void* stream) {
  return static_cast<Allocator*>(pool)->free(ptr, size, stream);
}

OXY_API void oxygen_pool_empty_cache(void* pool) { static_cast<Allocator*>(pool)->empty_cache(); }
OXY_API void oxygen_pool_reset_peak(void* pool) { static_cast<Allocator*>(pool)->reset_peak(); }

// Create physical handles now until `bytes` worth are cached (the "prepared ahead" of growth).
OXY_API int oxygen_pool_prepare(void* pool, size_t bytes) {
  DeviceCtx& c = static_cast<Allocator*>(pool)->ctx();
  return c.prepare((bytes + c.page() - 1) / c.page());
}

OXY_API int oxygen_pool_mem_info(void* pool, size_t* free_bytes, size_t* total_bytes) {
  return static_cast<Allocator*>(pool)->ctx().backend().mem_info(free_bytes, total_bytes);
}

OXY_API const char* oxygen_pool_backend(void* pool) {
  return static_cast<Allocator*>(pool)->ctx().kind().c_str();
}

OXY_API int oxygen_pool_device(void* pool) { return static_cast<Allocator*>(pool)->ctx().device(); }

OXY_API uint64_t oxygen_pool_base(void* pool) { return static_cast<Allocator*>(pool)->base(); }

// Comma-separated names of the values oxygen_pool_stats writes, in order.
OXY_API const char* oxygen_stats_names() { return stats_names(); }

// Reads the counters (atomics: no allocation lock is taken). Returns how many were written.
OXY_API int oxygen_pool_stats(void* pool, uint64_t* out, int n) {
  auto* a = static_cast<Allocator*>(pool);
  return export_stats(&a->counters(), a->ctx(), a->va_bytes(), out, n);
}

// Per-page map latency histogram: bucket i counts pages mapped in < 2^i us (last: the rest).
OXY_API int oxygen_pool_latency_hist(void* pool, uint64_t* out, int n) {
  return export_hist(static_cast<Allocator*>(pool)->ctx(), out, n);
}

// malloc + free of `size` bytes `iters` times from C (no Python in the loop); ns per pair.
OXY_API double oxygen_pool_bench(void* pool, int64_t size, int iters, void* stream) {
  auto* a = static_cast<Allocator*>(pool);
  Status s;
  std::uint64_t t0 = now_ns();
  for (int i = 0; i < iters; ++i) {
    void* p = a->malloc(size, stream, &s);
    if (!p) return -1.0;
    a->free(p, size, stream);
  }
  return static_cast<double>(now_ns() - t0) / (iters > 0 ? iters : 1);
}

// ---------------------------------------------------------------------------------------------
// CUDA-graph capture announcements (Python wraps torch.cuda.CUDAGraph) and host test knobs

OXY_API uint64_t oxygen_capture_begin() { return capture::announce_begin(); }
OXY_API void oxygen_capture_end(uint64_t token) { capture::announce_end(token); }
OXY_API void oxygen_capture_release(uint64_t token) { capture::release(token); }
OXY_API int oxygen_capture_maybe_active() { return capture::maybe_active() ? 1 : 0; }
// Python's atexit: stop the background threads before the interpreter and the driver go away.
OXY_API void oxygen_shutdown() { DeviceCtx::stop_all_threads(); }
// Self-test of the idle-page bitmap against std::set: random inserts and erases, then next(),
// prev() and last() from random points. Returns the number of disagreements (0 = correct).
OXY_API int oxygen_pageset_selftest(uint64_t seed, int pages, int ops) {
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

OXY_API void oxygen_host_hold_events(int hold) { host_hold_events(hold != 0); }
OXY_API void oxygen_host_set_event_lag(std::uint64_t ns) { host_set_event_lag(ns); }
OXY_API void oxygen_host_set_capture(void* stream, uint64_t id) { host_set_capture(stream, id); }
