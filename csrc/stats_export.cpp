// See stats_export.h.
#include "stats_export.h"

#include <vector>

namespace oxygen {

std::atomic<std::uint64_t> g_virtual_now_ns{0};

const char* stats_names() {
  return "allocated_bytes,peak_allocated_bytes,requested_bytes,live_blocks,num_allocs,num_frees,"
         "num_ooms,num_bad_frees,num_bad_sizes,num_size_mismatch,last_bad_pointer,capture_allocs,"
         "quarantined_bytes,idle_pages,slab_cached_pages,events_recorded,reclaims,"
         "mapped_bytes,peak_mapped_bytes,reserved_va_bytes,handle_cache_pages,handles_created,"
         "handles_released,handles_created_inline,num_maps,num_unmaps,map_ns,unmap_ns,"
         "live_handles,max_pages,page_size,pool_va_bytes,live_ranges,pages_lent,small_pages,"
         "pool_mapped_bytes,deferred_bytes,pool_maps,pool_unmaps,pool_map_ns,pool_unmap_ns,"
         "sweeps_yielded";
}

int export_stats(const AllocCounters* a, DeviceCtx& ctx, std::size_t pool_va_bytes,
                 std::size_t pool_mapped_bytes, const PageRange::Moves* moves,
                 std::uint64_t* out, int n) {
  PageRange::Moves none;
  const PageRange::Moves& m = moves ? *moves : none;
  AllocCounters zero;
  const AllocCounters& s = a ? *a : zero;
  PhysCounters& p = ctx.stats();
  const std::vector<std::uint64_t> v = {
      get(s.allocated_bytes), get(s.peak_allocated_bytes), get(s.requested_bytes),
      get(s.live_blocks), get(s.num_allocs), get(s.num_frees), get(s.num_ooms),
      get(s.num_bad_frees), get(s.num_bad_sizes), get(s.num_size_mismatch),
      get(s.last_bad_pointer), get(s.capture_allocs), get(s.quarantined_bytes),
      get(s.idle_pages), get(s.slab_cached_pages), get(s.events_recorded), get(s.reclaims),
      get(p.mapped_bytes), get(p.peak_mapped_bytes), get(p.reserved_va_bytes),
      get(p.handle_cache_pages), get(p.handles_created), get(p.handles_released),
      get(p.handles_created_inline), get(p.num_maps), get(p.num_unmaps), get(p.map_ns),
      get(p.unmap_ns), ctx.owned_pages(), ctx.max_pages(), ctx.page(), pool_va_bytes,
      get(p.live_ranges), get(s.pages_lent), get(s.small_pages), pool_mapped_bytes,
      get(s.deferred_bytes), get(m.maps), get(m.unmaps), get(m.map_ns), get(m.unmap_ns),
      get(s.sweeps_yielded)};
  int k = 0;
  for (; k < n && k < static_cast<int>(v.size()); ++k) out[k] = v[k];
  return k;
}

int export_hist(DeviceCtx& ctx, std::uint64_t* out, int n) {
  int k = 0;
  for (; k < n && k < kLatencyBuckets; ++k) out[k] = get(ctx.stats().map_hist[k]);
  return k;
}

}  // namespace oxygen
