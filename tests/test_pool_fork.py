"""fork() while other threads use the pool (PyTorch's DataLoader forks its workers): every child
finishes within a bound, the parent's pool refuses in the child with an error that says why, a
pool made in the child works, and the parent's pool is intact afterwards."""

import ctypes
import os
import random
import signal
import threading
import time

import pytest
import torch

from oxygen_torch.pool import Arena, VirtualPool
from oxygen_torch.pool import native as _native

MiB = 1 << 20
FORKS = 80
CHILD_BOUND_S = 20.0  # a child does a few ms of work: this bound only catches a hang

# Child exit codes: which step went wrong
OK, INHERITED_POOL_USABLE, INHERITED_ARENA_USABLE, NEW_POOL_WRONG, CRASHED = 0, 3, 4, 5, 6


def churn(pool, arena, seed, stop, errors):
    """malloc/free of random sizes with a pattern checked before each free, and arena pages
    mapped and unmapped: the locks a fork may catch held."""
    rng = random.Random(seed)
    live = []
    try:
        while not stop.is_set():
            if live and (rng.random() < 0.5 or len(live) > 16):
                ptr, n, tag = live.pop(rng.randrange(len(live)))
                if ctypes.string_at(ptr, min(n, 64)) != bytes([tag]) * min(n, 64):
                    errors.append(f"block {ptr:#x} was overwritten")
                pool.free(ptr, n)
            else:
                n = rng.choice([1, 700, 4096, 300_000, 3 * MiB + 5])
                tag = rng.randrange(1, 256)
                ptr = pool.malloc(n)
                ctypes.memset(ptr, tag, min(n, 64))
                live.append((ptr, n, tag))
            page = rng.randrange(arena.num_pages)
            if seed % 2 and not arena.is_mapped(page):
                arena.map_pages(page)
                arena.unmap_pages(page)
        for ptr, n, _ in live:
            pool.free(ptr, n)
    except Exception as exc:  # surfaced in the main thread
        errors.append(repr(exc))


def child(pool, arena) -> int:
    """Runs in the forked child; returns its exit code."""
    try:
        pool.malloc(4096)
        return INHERITED_POOL_USABLE
    except _native.NativeError as exc:
        if exc.status != _native.ERR_FORKED or "before fork()" not in str(exc):
            return INHERITED_POOL_USABLE
    try:
        arena.map_pages(0)
        return INHERITED_ARENA_USABLE
    except _native.NativeError as exc:
        if exc.status != _native.ERR_FORKED:
            return INHERITED_ARENA_USABLE
    with VirtualPool(backend="host", capacity=32 * MiB) as mine:
        blocks = [(mine.malloc(n), n) for n in (1, 5000, 3 * MiB)]
        for i, (ptr, n) in enumerate(blocks):
            ctypes.memset(ptr, 0x41 + i, n)
        for i, (ptr, n) in enumerate(blocks):
            if ctypes.string_at(ptr, n) != bytes([0x41 + i]) * n or not mine.free(ptr, n):
                return NEW_POOL_WRONG
        if mine.stats()["allocated_bytes"] != 0:
            return NEW_POOL_WRONG
    from oxygen_torch import pool as oxygen_pool

    if arena in oxygen_pool.live_arenas() or oxygen_pool.memory_stats()["mapped_bytes"]:
        return NEW_POOL_WRONG  # the parent's arena is not this process's
    pool.close()  # forgets the parent's pool: must neither block nor touch the parent's pages
    arena.close()
    _native.lib().oxygen_shutdown()  # what atexit runs: stops only the child's threads
    return OK


def wait_bounded(pid: int, bound_s: float) -> int | None:
    """The child's exit code, or None when it did not exit within ``bound_s`` (then killed)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def test_forks_during_churn_never_hang():
    pool = VirtualPool(backend="host", capacity=256 * MiB, hysteresis_us=200)
    arena = Arena(16 * MiB, backend="host")
    stop, errors = threading.Event(), []
    threads = [
        threading.Thread(target=churn, args=(pool, arena, s, stop, errors)) for s in range(3)
    ]
    for t in threads:
        t.start()
    codes = []
    try:
        for _ in range(FORKS):
            pid = os.fork()
            if pid == 0:
                code = CRASHED
                try:
                    code = child(pool, arena)
                finally:
                    os._exit(code)
            codes.append(wait_bounded(pid, CHILD_BOUND_S))
            if codes[-1] is None:
                break  # one hang is enough to fail; do not spend the bound 200 times
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert None not in codes, f"a child hung (fork {codes.index(None) + 1} of {FORKS})"
    assert codes == [OK] * FORKS, f"child exit codes: {sorted(set(codes))}"
    assert not errors, errors[:5]
    s = pool.stats()  # the parent's pool is intact after every fork
    assert s["allocated_bytes"] == 0 and s["live_blocks"] == 0
    assert s["num_allocs"] == s["num_frees"] > 0 and s["num_bad_frees"] == 0
    pool.empty_cache()
    assert pool.stats()["mapped_bytes"] == 0
    arena.map_pages(1, 2)  # and so is the arena
    assert arena.mapped_pages() == 2
    arena.close()
    pool.close()


def test_fork_while_a_scrape_holds_the_metrics_lock():
    """The exporter's lock, held by a scraping thread at the fork, would stay held in the child."""
    from oxygen_torch.tools import metrics

    held, release = threading.Event(), threading.Event()

    def scrape_in_progress():
        with metrics._lock:
            held.set()
            release.wait()

    t = threading.Thread(target=scrape_in_progress)
    t.start()
    held.wait()
    try:
        pid = os.fork()
        if pid == 0:
            code = CRASHED
            try:
                with VirtualPool(backend="host", capacity=16 * MiB) as mine:
                    metrics.register_pool(mine, name="child")
                    names = [name for name, _ in metrics.pool_snapshots()]
                    code = OK if "child" in names else NEW_POOL_WRONG
            finally:
                os._exit(code)
        assert wait_bounded(pid, CHILD_BOUND_S) == OK
    finally:
        release.set()
        t.join()


GLOBAL_ROUTE_FORK = """
import gc, os, sys, time
import torch
import oxygen_torch
from oxygen_torch.pool import VirtualPool, native

oxygen_torch.enable()
kept = torch.randn(1 << 20, device="cuda")  # a block of the global pool, inherited by the child
pid = os.fork()
if pid == 0:
    code = 9
    try:
        del kept
        gc.collect()  # frees the parent's block in the child: ignored, never blocks
        with VirtualPool(backend="host", capacity=32 << 20) as mine:
            mine.free(mine.malloc(4096))
        try:
            VirtualPool(backend="cuda", capacity=64 << 20)
            code = 2  # CUDA does not survive fork: this must be refused
        except Exception as exc:
            code = 0 if str(exc) else 3
    finally:
        os._exit(code)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", os.waitstatus_to_exitcode(status))
        break
    time.sleep(0.01)
else:
    os.kill(pid, 9)
    print("child hung")
again = torch.randn(1 << 20, device="cuda")  # the parent's pool still allocates after the fork
print("parent", bool(torch.isfinite(kept).all()) and float((again - again).abs().sum()) == 0.0)
"""


@pytest.mark.cuda
def test_fork_after_the_global_route_allocated():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", GLOBAL_ROUTE_FORK], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "child 0" in r.stdout and "parent True" in r.stdout, r.stdout + r.stderr[-3000:]


def host_mappings() -> int:
    """Host page mappings a fork would make private in the child (csrc/host_maps.h)."""
    fn = _native.lib().oxygen_host_mappings
    fn.restype = ctypes.c_size_t
    return fn()


def test_a_childs_writes_to_inherited_pages_stay_in_the_child():
    """Host pages are MAP_SHARED memfd mappings: before issue 31's fix a child writing a block or
    an arena view it inherited wrote the parent's memory (the KV cache's silent corruption). The
    child now reads what the parent had written and writes pages of its own."""
    n = 3 * MiB + 5  # a block over whole pages and a partial one
    with VirtualPool(backend="host", capacity=64 * MiB) as pool, Arena(8 * MiB) as arena:
        arena.map_pages(1, 2)
        view = arena.as_tensor()[arena.page_size : 3 * arena.page_size]
        ptr = pool.malloc(n)
        ctypes.memset(ptr, 0x5A, n)
        view.fill_(7)
        pid = os.fork()
        if pid == 0:
            code = CRASHED
            try:
                torch.set_num_threads(1)  # as DataLoader's workers: OpenMP does not survive fork
                seen = ctypes.string_at(ptr, n) == b"\x5a" * n and bool((view == 7).all())
                ctypes.memset(ptr, 0xC3, n)
                view.fill_(9)
                mine = ctypes.string_at(ptr, n) == b"\xc3" * n and bool((view == 9).all())
                code = OK if seen and mine else NEW_POOL_WRONG
            finally:
                os._exit(code)
        assert wait_bounded(pid, CHILD_BOUND_S) == OK
        assert ctypes.string_at(ptr, n) == b"\x5a" * n, "the child's writes reached the parent"
        assert bool((view == 7).all()), "the child's writes reached the parent's arena"
        pool.free(ptr)
        del view


def test_the_record_of_host_mappings_follows_map_and_unmap():
    before = host_mappings()
    with Arena(16 * MiB, backend="host") as arena:
        arena.map_pages(0, 3)
        arena.map_pages(5)
        assert host_mappings() == before + 4
        arena.unmap_pages(1)
        assert host_mappings() == before + 3
    assert host_mappings() == before
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=0) as pool:
        ptr = pool.malloc(5 * MiB)
        assert host_mappings() == before + pool.stats()["mapped_bytes"] // pool.page_size
        pool.free(ptr)
        pool.empty_cache()
        assert host_mappings() == before
