"""The pool's statistics: oxygen's own (``memory_stats``) and PyTorch's names for them, which
the global route answers in place of the pluggable allocator's missing device stats."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

from . import native as _native
from .figures import _derive
from .objects import _read, live_arenas
from .state import _route

HIST_BOUNDS_US = [float(1 << i) for i in range(15)] + [float("inf")]  # map-latency buckets


def _global_handle(device: int) -> int | None:
    try:
        return _native.lib().oxygen_global_pool(device)
    except _native.NativeLibraryError:
        return None


def raw_counters(device: int = 0) -> dict:
    """The raw counters of the global pool of ``device`` (or of a live arena's device context when
    no global pool exists), read from atomics without taking any allocation lock."""
    h = _global_handle(device)
    if h:
        return _read(functools.partial(_native.lib().oxygen_pool_stats, h))
    for arena in live_arenas(device):
        try:
            return arena._raw()
        except RuntimeError:  # closed by another thread since it was listed
            continue
    names = _native.lib().oxygen_stats_names().decode().split(",")
    return dict.fromkeys(names, 0)


def map_latency_histogram(device: int = 0) -> list[tuple[float, int]]:
    """(upper bound in microseconds, pages) per bucket of per-page map latency."""
    arr = (ctypes.c_uint64 * 16)()
    h = _global_handle(device)
    n = _native.lib().oxygen_pool_latency_hist(h, arr, 16) if h else 0
    return list(zip(HIST_BOUNDS_US, arr[:n], strict=False))


def memory_stats(device: int | None = None) -> dict:
    """Allocated / mapped / peak / fragmentation / map latency ... of the global pool.

    Without a global pool (a CPU machine, or before enable()), the physical figures are those of
    the device's KV arenas, which hand out whole KV blocks and keep no allocation counters:
    fragmentation is then None (not applicable; `oxygen_torch.kv.pool_stats()` has the blocks
    in use), not the 1.0 that "nothing allocated, pages mapped" would compute."""
    dev = 0 if device is None else int(device)
    backend = "cuda" if _global_handle(dev) else _route.backend
    if not _global_handle(dev):
        arenas = live_arenas(dev)
        backend = arenas[0].backend if arenas else backend
    d = _derive(raw_counters(dev), backend, dev)
    if not _global_handle(dev):
        d["fragmentation"] = None
    return d


def empty_cache() -> None:
    """Unmap every page with nothing live in the global pools and release cached handles."""
    lib = _native.lib()
    for dev in range(64):
        h = lib.oxygen_global_pool(dev)
        if h:
            lib.oxygen_pool_empty_cache(h)


def reset_peak_memory_stats(device: int | None = None) -> None:
    h = _global_handle(0 if device is None else int(device))
    if h:
        _native.lib().oxygen_pool_reset_peak(h)


def _torch_like_stats(device: Any = None) -> dict:
    """PyTorch's memory_stats() keys answered from the pool (reserved = mapped)."""
    dev = torch.cuda._utils._get_device_index(device, optional=True)
    s = memory_stats(dev)
    out = {
        "allocated_bytes.all.current": s["allocated_bytes"],
        "allocated_bytes.all.peak": s["peak_allocated_bytes"],
        "active_bytes.all.current": s["allocated_bytes"],
        "active_bytes.all.peak": s["peak_allocated_bytes"],
        "requested_bytes.all.current": s["requested_bytes"],
        "reserved_bytes.all.current": s["mapped_bytes"],
        "reserved_bytes.all.peak": s["peak_mapped_bytes"],
        "allocation.all.current": s["live_blocks"],
        "allocation.all.allocated": s["num_allocs"],
        "allocation.all.freed": s["num_frees"],
        "num_alloc_retries": s["reclaims"],
        "num_ooms": s["num_ooms"],
    }
    out.update({f"oxygen.{k}": v for k, v in s.items()})
    return out
