// Flattens the counters of a pool (or of an arena's device context) into an array of uint64 for
// the C ABI, with a names list so Python builds its dict without hard-coding the order.
#pragma once

#include <cstddef>
#include <cstdint>

#include "page_pool.h"
#include "stats.h"

namespace oxygen {

const char* stats_names();
// alloc may be null (an arena's context alone): its values are written as 0.
// pool_mapped_bytes: the allocator's own share of the context's mapped bytes (0 for an arena);
// moves: its range's own maps and unmaps (null: 0).
int export_stats(const AllocCounters* alloc, DeviceCtx& ctx, std::size_t pool_va_bytes,
                 std::size_t pool_mapped_bytes, const PageRange::Moves* moves,
                 std::uint64_t* out, int n);
int export_hist(DeviceCtx& ctx, std::uint64_t* out, int n);

}  // namespace oxygen
