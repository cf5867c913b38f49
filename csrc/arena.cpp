// KV arenas: a reserved virtual range whose pages the KV cache maps and unmaps explicitly. The
// physical handles come from the device context shared with the global pool (same refill thread,
// same handle cache, counted in the same mapped bytes).
//
// The caller must unmap a page only when no kernel can still read it: an access to an unmapped
// page is an illegal address that poisons the CUDA context (DESIGN.md, "The KV cache").
#include <memory>
#include <mutex>
#include <string>

#include "page_pool.h"
#include "stats_export.h"

#define OXY_API extern "C" __attribute__((visibility("default")))

using namespace oxygen;

namespace {

struct Arena {
  std::mutex mu;
  std::unique_ptr<PageRange> range;
};

}  // namespace

OXY_API int oxygen_arena_create(const char* kind, int device, size_t page_size, size_t nbytes,
                                double reserve_fraction, void** out) {
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
  a->range = std::make_unique<PageRange>(ctx, (nbytes + page_size - 1) / page_size, &s);
  if (s != OK) return s;
  *out = a.release();
  return OK;
}

OXY_API void oxygen_arena_destroy(void* arena) { delete static_cast<Arena*>(arena); }

OXY_API uint64_t oxygen_arena_base(void* arena) { return static_cast<Arena*>(arena)->range->base(); }

OXY_API size_t oxygen_arena_pages(void* arena) { return static_cast<Arena*>(arena)->range->pages(); }

OXY_API size_t oxygen_arena_page_size(void* arena) {
  return static_cast<Arena*>(arena)->range->page();
}

OXY_API int oxygen_arena_map(void* arena, size_t first, size_t count) {
  auto* a = static_cast<Arena*>(arena);
  std::lock_guard<std::mutex> g(a->mu);
  return a->range->map(first, count);
}

OXY_API int oxygen_arena_unmap(void* arena, size_t first, size_t count) {
  auto* a = static_cast<Arena*>(arena);
  std::lock_guard<std::mutex> g(a->mu);
  return a->range->unmap(first, count);
}

OXY_API int oxygen_arena_is_mapped(void* arena, size_t page) {
  return static_cast<Arena*>(arena)->range->is_mapped(page) ? 1 : 0;
}

OXY_API size_t oxygen_arena_mapped_pages(void* arena) {
  return static_cast<Arena*>(arena)->range->mapped_pages();
}

// The device context's counters (mapped bytes include the global pool's pages when shared).
OXY_API int oxygen_arena_stats(void* arena, uint64_t* out, int n) {
  return export_stats(nullptr, static_cast<Arena*>(arena)->range->ctx(), 0, out, n);
}

OXY_API int oxygen_arena_latency_hist(void* arena, uint64_t* out, int n) {
  return export_hist(static_cast<Arena*>(arena)->range->ctx(), out, n);
}
