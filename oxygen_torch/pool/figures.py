"""The documented statistics of a pool or arena, derived from the native counters (csrc/stats.h,
read as a dict by objects._read)."""

from __future__ import annotations


def _derive(raw: dict, backend: str, device: int) -> dict:
    """The documented statistics (names like PyTorch's where it has one) from the raw counters."""
    d = dict(raw)
    peak_mapped = raw.get("peak_mapped_bytes", 0)
    d["fragmentation"] = (
        1.0 - raw.get("peak_allocated_bytes", 0) / peak_mapped if peak_mapped else 0.0
    )
    maps, unmaps = raw.get("num_maps", 0), raw.get("num_unmaps", 0)
    d["mean_map_latency_us"] = raw.get("map_ns", 0) / maps / 1e3 if maps else 0.0
    d["mean_unmap_latency_us"] = raw.get("unmap_ns", 0) / unmaps / 1e3 if unmaps else 0.0
    d["physical_bytes"] = raw.get("mapped_bytes", 0) + raw.get("handle_cache_pages", 0) * raw.get(
        "page_size", 0
    )
    d.update(_held_split(raw))
    d["backend"] = backend
    d["device"] = device
    return d


def _held_split(raw: dict) -> dict:
    """Where the physical memory held goes; the five parts add up to physical_bytes (read from
    atomics without a lock, so while other threads allocate they may disagree by a page or two).

    held_general_bytes: pages the pool's live blocks touch; held_kv_arena_bytes: pages the KV
    arenas map (the rest of the device context's mapped bytes); held_hysteresis_bytes: pool pages
    with nothing live, waiting out pool.hysteresis_ms (or for the device to pass their free);
    held_cached_small_bytes: the empty small-block page kept for reuse; held_handle_cache_bytes:
    physical pages created ahead (refill) or given back, mapped nowhere."""
    page = raw.get("page_size", 0)
    mapped, pool = raw.get("mapped_bytes", 0), raw.get("pool_mapped_bytes", 0)
    idle, cached = raw.get("idle_pages", 0) * page, raw.get("slab_cached_pages", 0) * page
    return {
        "held_general_bytes": max(0, pool - idle - cached),
        "held_kv_arena_bytes": max(0, mapped - pool),
        "held_hysteresis_bytes": idle,
        "held_cached_small_bytes": cached,
        "held_handle_cache_bytes": raw.get("handle_cache_pages", 0) * page,
    }
