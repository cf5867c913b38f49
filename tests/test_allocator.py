"""The Python side of the pool on a CPU machine: enable/disable without CUDA, memory_stats(), the
global C entry points (oxygen_malloc / oxygen_free) on the host backend, pool() as a no-op."""

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from oxygen_torch import pool as allocator
from oxygen_torch.config import PoolConfig

ROOT = Path(__file__).resolve().parents[1]
REQUIRED = [
    "allocated_bytes", "mapped_bytes", "reserved_va_bytes", "peak_allocated_bytes",
    "peak_mapped_bytes", "fragmentation", "num_maps", "num_unmaps", "num_ooms",
    "handle_cache_pages", "mean_map_latency_us", "mean_unmap_latency_us", "backend", "device",
]  # fmt: skip


def cfg(**kw):
    base = dict(page_size=2 << 20, reserve_fraction=0.9, backend="auto", cpu_tier_bytes=0,
                hot_zone_ratio=0.6, migration_threshold=0.8)  # fmt: skip
    base.update(kw)
    return types.SimpleNamespace(**base)


def run_py(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        cwd=ROOT, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_enable_on_cpu_installs_nothing_and_reports_host():
    allocator.enable_allocator(cfg())
    try:
        assert allocator.is_enabled()
        s = allocator.memory_stats()
        assert s["backend"] == "host"
        assert all(k in s for k in REQUIRED)
        with allocator.pool() as mp:
            assert mp is None
    finally:
        allocator.disable_allocator()
    assert not allocator.is_enabled()


def test_memory_stats_keys_and_histogram():
    s = allocator.memory_stats()
    assert all(k in s for k in REQUIRED), [k for k in REQUIRED if k not in s]
    frag = s["fragmentation"]  # None without a global pool: arenas keep no allocation counters
    assert frag is None if not allocator.stats._global_handle(0) else 0.0 <= frag <= 1.0
    assert isinstance(allocator.raw_counters(), dict)
    hist = allocator.map_latency_histogram()
    assert all(isinstance(b, float) and n >= 0 for b, n in hist)


def test_arena_counts_in_memory_stats():
    with allocator.Arena(8 << 20, backend="host", device=5) as ar:
        ar.map_pages(0, 2)
        s = allocator.memory_stats(5)
        assert s["backend"] == "host" and s["mapped_bytes"] >= 4 << 20
        assert s["fragmentation"] is None  # mapped pages, no allocation counters: not 1.0
        ar.unmap_pages(0, 2)


def test_the_pools_own_maps_are_told_apart_from_the_kv_arenas():
    """num_maps / num_unmaps count every range of a device context (the pool's and the KV
    arenas'); pool_maps / pool_unmaps only the pool's own: an arena's pages move the first, a
    pool's blocks both."""
    import random

    n = random.randint(2, 5)
    with allocator.Arena(16 << 20, backend="host", device=6) as ar:
        before = allocator.memory_stats(6)
        ar.map_pages(0, n)
        ar.unmap_pages(0, n)
        s = allocator.memory_stats(6)
        assert s["num_maps"] - before["num_maps"] == n
        assert s["num_unmaps"] - before["num_unmaps"] == n
        assert s["pool_maps"] == s["pool_unmaps"] == 0  # (no pool: an arena's context alone)
    with allocator.VirtualPool(backend="host", capacity=1 << 30, hysteresis_us=1) as pool:
        p = pool.malloc(n * (2 << 20))
        s = pool.stats()
        assert s["pool_maps"] == s["num_maps"] >= n and s["pool_map_ns"] > 0
        pool.free(p)
        pool.empty_cache()
        s = pool.stats()
        assert s["pool_unmaps"] == s["num_unmaps"] == s["pool_maps"]


def test_global_entry_points_on_the_host_backend():
    out = run_py(
        """
        import ctypes, json
        from oxygen_torch.pool import native as _native
        lib = _native.lib()
        # host backend, 2 MiB pages, 64 MiB capacity, NULL on OOM (PyTorch gets an exception)
        _native.check(lib.oxygen_configure(b"host", 2 << 20, 0.9, 64 << 20, 0, 0, 0, 0), "cfg")
        assert lib.oxygen_global_pool(0) is None
        ptrs = [lib.oxygen_malloc(n, 0, None) for n in (0, 0, 100, 3 << 20, 1 << 20)]
        assert None not in ptrs and len(set(ptrs)) == 5
        ctypes.memset(ptrs[3], 7, 3 << 20)
        big = lib.oxygen_malloc(100 << 20, 0, None)  # beyond capacity: NULL, counted
        for p, n in zip(ptrs, (0, 0, 100, 3 << 20, 1 << 20)):
            lib.oxygen_free(p, n, 0, None)
        lib.oxygen_free(ptrs[0], 0, 0, None)  # double free: reported, ignored
        # configuring again once the pool exists is refused
        refused = lib.oxygen_configure(b"host", 2 << 20, 0.9, 0, 0, 0, 0, 0)
        from oxygen_torch.pool import memory_stats, empty_cache
        empty_cache()
        s = memory_stats(0)
        print(json.dumps({"big": big, "refused": refused, "ooms": s["num_ooms"],
                          "bad": s["num_bad_frees"], "mapped": s["mapped_bytes"],
                          "allocs": s["num_allocs"], "backend": s["backend"]}))
        """
    )
    assert out["big"] is None and out["ooms"] == 1 and out["bad"] == 1
    assert out["refused"] != 0 and out["mapped"] == 0 and out["allocs"] == 5


def test_virtual_pool_validates_arguments():
    with pytest.raises(ValueError):
        allocator.VirtualPool(backend="tpu")
    with pytest.raises(ValueError):
        allocator.VirtualPool(backend="host", capacity=0)
    with pytest.raises(ValueError):
        allocator.VirtualPool(backend="host", reserve_fraction=1.5)
    p = allocator.VirtualPool(backend="host", capacity=16 << 20)
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.malloc(10)


def test_global_configure_passes_page_fraction_and_hysteresis(monkeypatch):
    """pool.hysteresis_ms reaches oxygen_configure in microseconds, pool.lend_idle_pages
    oxygen_configure_lending (the global route configures the C side once, before CUDA's first
    allocation; recorded here, nothing is installed)."""
    calls, lending = [], []

    class Lib:
        def oxygen_configure(self, *args):
            calls.append(args)
            return 0

        def oxygen_configure_lending(self, on):
            lending.append(on)
            return 0

    route = allocator.route
    monkeypatch.setattr(route._native, "lib", lambda: Lib())
    monkeypatch.setattr(route._route, "configured", False)
    cfg = PoolConfig(page_size=4 << 20, reserve_fraction=0.5, hysteresis_ms=37.5)
    route._configure(cfg)
    assert calls == [(b"cuda", 4 << 20, 0.5, 0, 0, 0, 37500, 1)]
    route._configure(PoolConfig())  # defaults: 2 MiB pages, 0.9, 20 ms, lending on
    assert calls[1] == (b"cuda", 2 << 20, 0.9, 0, 0, 0, 20000, 1)
    route._configure(PoolConfig(lend_idle_pages=False))
    assert lending == [1, 1, 0]
