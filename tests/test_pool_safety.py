"""Regression tests of issue 15's memory-safety findings, one each: bad arguments are refused
before they reach ctypes (which wraps them silently), page ranges are checked without overflow,
a C++ exception never crosses the C ABI, objects refuse use after close(), an arena view outlives
close() safely, and a host pool refuses the page sizes PoolConfig refuses. Calls that aborted or
segfaulted the interpreter run in a child process."""

import ctypes
import gc
import subprocess
import sys
import textwrap

import pytest

from oxygen_torch import pool as oxygen_pool
from oxygen_torch.pool import Arena, VirtualPool
from oxygen_torch.pool import native as _native
from oxygen_torch.tools import leakcheck

MiB = 1 << 20
PAGE = 2 * MiB


def in_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def arena():
    a = Arena(4 * PAGE, backend="host")
    yield a
    a.close()


@pytest.mark.parametrize("first, count", [(-1, 1), (0, -1), (4, 1), (3, 2), (1 << 64, 1), (0, 0)])
@pytest.mark.parametrize("op", ["map_pages", "unmap_pages"])
def test_arena_page_ranges_are_checked(arena, op, first, count):
    arena.map_pages(2)
    with pytest.raises(ValueError, match=f"arena {op} (first page|count) = .* out of range"):
        getattr(arena, op)(first, count)
    assert arena.mapped_pages() == 1 and [arena.is_mapped(p) for p in range(4)] == [0, 0, 1, 0]


def test_native_range_check_does_not_wrap(arena):
    """-1 as size_t is 2^64 - 1: `first + count > pages` wrapped to 0 and passed, then wrote
    handles_[SIZE_MAX] (map) or reported success doing nothing (unmap)."""
    lib = _native.lib()
    for fn in (lib.oxygen_arena_map, lib.oxygen_arena_unmap):
        for first, count in [((1 << 64) - 1, 1), (1, (1 << 64) - 1), (2, (1 << 64) - 2)]:
            assert fn(arena._h, first, count) == _native.ERR_INVALID
            assert "out of range; the range has 4 pages" in _native.last_error()
    assert arena.mapped_pages() == 0


@pytest.mark.parametrize("capacity", [1 << 62, 1 << 56])
def test_absurd_capacity_is_a_clean_error(capacity):
    r = in_child(
        f"""
        import ctypes
        from oxygen_torch.pool import VirtualPool, native
        try:
            VirtualPool(backend="host", capacity={capacity})
        except ValueError as exc:
            print("python:", exc)
        h = ctypes.c_void_p()  # and the C ABI itself, past the Python check
        st = native.lib().oxygen_pool_create(
            b"host", 0, 2 << 20, {capacity}, 0.9, 0, 0, 0, ctypes.byref(h)
        )
        print("native:", st, native.last_error())
        """
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "python: VirtualPool capacity (bytes) = " in r.stdout and "out of range" in r.stdout
    assert f"native: {_native.ERR_INVALID} capacity {capacity} bytes is larger" in r.stdout


def test_bad_alloc_never_crosses_the_c_abi():
    """Creating a pool under an address-space limit that leaves room for its reservation but not
    for all of its bookkeeping: std::bad_alloc then came out of the C ABI and aborted Python."""
    r = in_child(
        """
        import resource
        from oxygen_torch.pool import VirtualPool

        def vmsize():
            return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status")
                        if l.startswith("VmSize:"))

        VirtualPool(backend="host", capacity=64 << 20).close()
        cap = 1 << 40  # 2 TiB reserved, ~25 MiB of per-page bookkeeping
        for extra_mib in (0, 4, 8, 12, 16, 64):
            limit = vmsize() + 2 * cap + ((2 + extra_mib) << 20)
            resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
            try:
                VirtualPool(backend="host", capacity=cap).close()
                outcome = "created"
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,) * 2)
            print(extra_mib, outcome)
        """
    )
    assert r.returncode == 0, r.stderr[-3000:]
    outcomes = r.stdout.splitlines()
    assert len(outcomes) == 6, r.stdout + r.stderr[-3000:]
    assert all(o.split(" ", 1)[1] == "created" or "NativeError" in o for o in outcomes), outcomes
    assert any("std::bad_alloc" in o or "bookkeeping" in o for o in outcomes), outcomes


BAD_CALLS = {
    "malloc-2**64": (lambda p: p.malloc(1 << 64), "malloc size = 18446744073709551616 is out of"),
    "malloc-negative": (lambda p: p.malloc(-1), "malloc size = -1 is out of range"),
    "malloc-float": (lambda p: p.malloc(2.5), "malloc size must be an integer"),
    "malloc-bool": (lambda p: p.malloc(True), "malloc size must be an integer"),
    "malloc-5000-digits": (lambda p: p.malloc(10**5000), "malloc size = an integer of 16610 bits"),
    "free-size-negative": (lambda p: p.free(p.base, -5), "free size = -5 is out of range"),
    "free-pointer-negative": (lambda p: p.free(-1), "free pointer = -1 is out of range"),
    "free-pointer-none": (lambda p: p.free(None), "free pointer must be an integer"),
    "stream-2**64": (lambda p: p.malloc(16, stream=1 << 64), "stream = .* is out of range"),
    "prepare-negative": (lambda p: p.prepare(-1), "prepare nbytes = -1 is out of range"),
    "bench-iters": (lambda p: p.bench(16, 1 << 40), "bench iters = .* is out of range"),
}


@pytest.mark.parametrize("call, match", list(BAD_CALLS.values()), ids=list(BAD_CALLS))
def test_pool_arguments_are_checked_before_ctypes(call, match):
    """ctypes wrapped 2**64 to 0 (malloc returned a 512-byte block) and took a size of -5."""
    with VirtualPool(backend="host", capacity=16 * MiB) as pool:
        ptr = pool.malloc(100)
        before = pool.stats()
        with pytest.raises((TypeError, ValueError), match=match):
            call(pool)
        after = pool.stats()
        for key in ("allocated_bytes", "live_blocks", "num_allocs", "num_frees", "num_bad_frees"):
            assert after[key] == before[key], key
        assert pool.free(ptr, 100)


@pytest.mark.parametrize("page_size", [3 * MiB, 4096, 1 << 31, 0])
def test_host_pool_refuses_what_pool_config_refuses(page_size):
    with pytest.raises(ValueError, match="VirtualPool page_size: .*(multiple|out of range)"):
        VirtualPool(backend="host", capacity=64 * MiB, page_size=page_size)
    with pytest.raises(ValueError, match="Arena page_size"):
        Arena(64 * MiB, backend="host", page_size=page_size)
    h = ctypes.c_void_p()  # the native pool applies the same rule
    st = _native.lib().oxygen_pool_create(
        b"host", 0, page_size, 64 * MiB, 0.9, 0, 0, 0, ctypes.byref(h)
    )
    assert st == _native.ERR_INVALID and "multiple of 2 MiB up to 1 GiB" in _native.last_error()


def test_every_method_of_a_closed_object_raises():
    pool, arena = VirtualPool(backend="host", capacity=8 * MiB), Arena(PAGE, backend="host")
    pool.close()
    arena.close()
    pool.close()  # closing twice is fine
    calls = [
        lambda: pool.malloc(1),
        lambda: pool.free(1),
        lambda: pool.stats(),
        lambda: pool.empty_cache(),
        lambda: pool.reset_peak(),
        lambda: pool.prepare(1),
        lambda: pool.latency_histogram(),
        lambda: arena.map_pages(0),
        lambda: arena.unmap_pages(0),
        lambda: arena.is_mapped(0),
        lambda: arena.mapped_pages(),
        lambda: arena.stats(),
        lambda: arena.as_tensor(),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"this (VirtualPool|Arena) is closed"):
            call()


def test_arena_view_outlives_close_without_faulting():
    """A tensor from as_tensor() read after close() read a released range: a segfault. Now the
    view keeps the range mapped, and the memory goes when the last view does."""
    gc.collect()  # arenas earlier tests closed with views still to be collected
    held = len(oxygen_pool.held_arenas())
    before = leakcheck.host_view()
    arena = Arena(4 * PAGE, backend="host")
    arena.map_pages(1, 2)
    flat = arena.as_tensor()
    view = flat[PAGE : 3 * PAGE].view(-1, 4096)  # a view of the view: it holds the arena too
    view[:, 7] = 0x5A
    del flat
    arena.close()
    assert len(oxygen_pool.held_arenas()) == held + 1
    assert int(view[:, 7].sum()) == 0x5A * view.shape[0]  # readable: no fault, contents kept
    assert leakcheck.host_view().mapped_bytes - before.mapped_bytes == 2 * PAGE
    del view
    gc.collect()
    assert len(oxygen_pool.held_arenas()) == held
    assert leakcheck.host_view().mapped_bytes == before.mapped_bytes


def test_integer_like_arguments_are_accepted():
    """Block ids and sizes often come from numpy or torch: anything with __index__ is an int."""
    import numpy as np
    import torch

    with VirtualPool(backend="host", capacity=16 * MiB) as pool:
        n = int(np.random.default_rng().integers(1, 1 << 20))
        ptr = pool.malloc(np.int64(n))
        assert pool.stats()["requested_bytes"] == n
        assert pool.free(torch.tensor(ptr, dtype=torch.int64), torch.tensor(n))
    with Arena(4 * PAGE, backend="host") as arena:
        arena.map_pages(np.int32(1), torch.tensor(2))
        assert arena.is_mapped(np.uint8(2)) and arena.mapped_pages() == 2


@pytest.mark.cuda
def test_cuda_arena_view_outlives_close_and_cuda_pool_checks_arguments():
    import torch

    gc.collect()  # arenas earlier tests closed with views still to be collected
    held = len(oxygen_pool.held_arenas())  # (a KV pool an earlier test left holds its arena)
    arena = Arena(4 * PAGE, backend="cuda")
    arena.map_pages(0, 2)
    flat = arena.as_tensor(torch.float32)[: PAGE // 4]
    value = float(torch.rand(()))
    flat.fill_(value)
    arena.close()  # the view keeps the range mapped: reading it must not poison the context
    torch.cuda.synchronize()
    assert float(flat[:1000].sum()) == pytest.approx(1000 * value, rel=1e-5)
    assert len(oxygen_pool.held_arenas()) == held + 1
    del flat
    gc.collect()
    assert len(oxygen_pool.held_arenas()) == held
    with VirtualPool(backend="cuda", capacity=64 * MiB) as pool:
        with pytest.raises(ValueError, match="malloc size = 18446744073709551616"):
            pool.malloc(1 << 64)
        assert pool.free(pool.malloc(3 * MiB)) and pool.stats()["allocated_bytes"] == 0
