// KV arenas: a reserved virtual range whose pages the KV cache maps and unmaps explicitly. The
// physical handles come from the device context shared with the global pool (same refill thread,
// same handle cache, counted in the same mapped bytes).
//
// The caller must unmap a page only when no kernel can still read it: an access to an unmapped
// page is an illegal address that poisons the CUDA context (DESIGN.md, "The KV cache").
#include <memory>
#include <mutex>
#include <string>

#include "capi_guard.h"
#include "page_pool.h"
#include "stats_export.h"

#define OXY_API extern "C" __attribute__((visibility("default")))

using namespace oxygen;

namespace {

struct Arena {
  std::mutex mu;
  std::unique_ptr<PageRange> range;
};

template <typename F>
int on_arena(void* arena, const char* where, F&& body) noexcept {
  return on_handle<Arena>(
      arena, where, "arena", [](Arena& a) { return a.range->ctx().inherited(); }, body);
}

// For the accessors that answer a value: `fallback` for an unusable handle.
template <typename T, typename F>
T arena_value(void* arena, const char* where, T fallback, F&& body) noexcept {
  T out = fallback;
  on_arena(arena, where, [&](Arena* a) -> int {
    out = body(a);
    return OK;
  });
  return out;
}

}  // namespace

OXY_API int oxygen_arena_create(const char* kind, int device, size_t page_size, size_t nbytes,
                                double reserve_fraction, void** out) {
  return guarded("oxygen_arena_create", [&]() -> int {
    if (!out) return invalid_handle("oxygen_arena_create", "output");
    *out = nullptr;
    std::string k = kind && *kind ? kind : "cuda";
    if (k == "auto") k = "cuda";
    if (page_size == 0 || nbytes == 0) {
      set_last_error("arena: page size and size must be > 0");
      return ERR_INVALID;
    }
    CtxOptions co;
    co.page_size = page_size;
    if (reserve_fraction > 0 && reserve_fraction <= 1) co.reserve_fraction = reserve_fraction;
    Status s;
    auto ctx = DeviceCtx::shared(k, device, co, &s);
    if (!ctx) return s;
    auto a = std::make_unique<Arena>();
    // no nbytes + page_size - 1: it wraps for sizes near 2^64
    a->range = std::make_unique<PageRange>(ctx, nbytes / page_size + (nbytes % page_size != 0), &s);
    if (s != OK) return s;
    *out = a.release();
    return OK;
  });
}

// In a forked child the parent's arena is only forgotten; no other call may be running on the
// handle (see oxygen_pool_destroy).
OXY_API int oxygen_arena_destroy(void* arena) {
  return guarded("oxygen_arena_destroy", [&]() -> int {
    auto* a = static_cast<Arena*>(arena);
    if (a && !a->range->ctx().inherited()) delete a;
    return OK;
  });
}

OXY_API uint64_t oxygen_arena_base(void* arena) {
  return arena_value<uint64_t>(arena, "arena base", 0, [](Arena* a) { return a->range->base(); });
}

OXY_API size_t oxygen_arena_pages(void* arena) {
  return arena_value<size_t>(arena, "arena pages", 0, [](Arena* a) { return a->range->pages(); });
}

OXY_API size_t oxygen_arena_page_size(void* arena) {
  return arena_value<size_t>(arena, "arena page size", 0,
                             [](Arena* a) { return a->range->page(); });
}

OXY_API int oxygen_arena_map(void* arena, size_t first, size_t count) {
  return on_arena(arena, "arena map", [&](Arena* a) -> int {
    std::lock_guard<std::mutex> g(a->mu);
    return a->range->map(first, count);
  });
}

OXY_API int oxygen_arena_unmap(void* arena, size_t first, size_t count) {
  return on_arena(arena, "arena unmap", [&](Arena* a) -> int {
    std::lock_guard<std::mutex> g(a->mu);
    return a->range->unmap(first, count);
  });
}

// 1 mapped, 0 not mapped (or past the end), -status for an unusable handle.
OXY_API int oxygen_arena_is_mapped(void* arena, size_t page) {
  int mapped = 0;
  int s = on_arena(arena, "arena is_mapped", [&](Arena* a) -> int {
    mapped = a->range->is_mapped(page) ? 1 : 0;
    return OK;
  });
  return s == OK ? mapped : -s;
}

OXY_API size_t oxygen_arena_mapped_pages(void* arena) {
  return arena_value<size_t>(arena, "arena mapped_pages", 0,
                             [](Arena* a) { return a->range->mapped_pages(); });
}

// The device context's counters (mapped bytes include the global pool's pages when shared).
// Returns how many were written, or -status.
OXY_API int oxygen_arena_stats(void* arena, uint64_t* out, int n) {
  int k = 0;
  int s = on_arena(arena, "arena stats", [&](Arena* a) -> int {
    k = export_stats(nullptr, a->range->ctx(), 0, 0, nullptr, out, n);
    return OK;
  });
  return s == OK ? k : -s;
}

OXY_API int oxygen_arena_latency_hist(void* arena, uint64_t* out, int n) {
  int k = 0;
  int s = on_arena(arena, "arena latency_histogram", [&](Arena* a) -> int {
    k = export_hist(a->range->ctx(), out, n);
    return OK;
  });
  return s == OK ? k : -s;
}
