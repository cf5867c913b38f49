"""The native pool on the host backend (memfd pages in a PROT_NONE reservation): life cycle, size
classes, reuse, unmapping, stream order, capture arenas, errors. Runs on any Linux CPU."""

import ctypes
import random
import time

import pytest
import torch

from oxygen_torch.pool import Arena, VirtualPool
from oxygen_torch.pool import native as _native

MiB = 1 << 20
PAGE = 2 * MiB


def class_sizes():
    """The 40 slab classes of csrc/slab.cpp: 512 B steps to 4 KiB, then 4 per power of two."""
    out = [512 * (i + 1) for i in range(8)]
    for k in range(12, 20):
        out += [(1 << k) + i * (1 << k) // 4 for i in range(1, 5)]
    return out


def round512(n):
    return max(512, (n + 511) // 512 * 512)


def fill(ptr, n, seed):
    """Write a pattern that depends on the block (first, middle and last bytes) and read it back."""
    for off in {0, n // 2, max(n - 1, 0)}:
        ctypes.c_uint8.from_address(ptr + off).value = (seed * 31 + off) & 0xFF


def check(ptr, n, seed):
    for off in {0, n // 2, max(n - 1, 0)}:
        assert ctypes.c_uint8.from_address(ptr + off).value == (seed * 31 + off) & 0xFF


@pytest.fixture
def pool():
    p = VirtualPool(backend="host", capacity=256 * MiB, hysteresis_us=1000)
    yield p
    p.close()


def test_life_cycle_reserve_map_unmap(pool):
    s = pool.stats()
    assert s["backend"] == "host" and s["mapped_bytes"] == 0
    assert s["reserved_va_bytes"] == 2 * pool.capacity  # VA = 2 x capacity
    ptr = pool.malloc(5 * MiB)
    assert pool.base <= ptr < pool.base + 2 * pool.capacity
    ctypes.memset(ptr, 0xAB, 5 * MiB)
    s = pool.stats()
    assert s["mapped_bytes"] == 3 * PAGE  # 5 MiB at a page boundary touches 3 pages
    assert s["allocated_bytes"] == 5 * MiB and s["live_blocks"] == 1
    assert pool.free(ptr, 5 * MiB)
    pool.empty_cache()
    s = pool.stats()
    assert s["mapped_bytes"] == 0 and s["allocated_bytes"] == 0
    assert s["num_maps"] == s["num_unmaps"] == 3
    assert s["handle_cache_pages"] == 0 and s["live_handles"] == 0


@pytest.mark.parametrize("size", class_sizes())
def test_every_size_class(pool, size):
    ptrs = [pool.malloc(size) for _ in range(5)]
    assert len(set(ptrs)) == 5
    for i, p in enumerate(ptrs):
        assert p % 512 == 0
        fill(p, size, i)
    for i, p in enumerate(ptrs):
        check(p, size, i)
    # slab pages of this class only: ceil(5 / slots per page) pages
    assert pool.stats()["mapped_bytes"] == -(-5 // (PAGE // size)) * PAGE
    assert pool.stats()["allocated_bytes"] == 5 * size
    for p in ptrs:
        assert pool.free(p, size)


def test_small_blocks_of_any_size_share_a_page_at_512_byte_granularity(pool):
    # no size classes outside a capture: 4097 B takes 4608, the next block follows it
    p = pool.malloc(4097)
    q = pool.malloc(5120)
    r = pool.malloc(700_000)
    assert q - p == round512(4097) and r - q == 5120
    s = pool.stats()
    assert s["allocated_bytes"] == round512(4097) + 5120 + round512(700_000)
    assert s["mapped_bytes"] == PAGE and s["small_pages"] == 1


def test_slot_and_page_reuse_after_free(pool):
    p = pool.malloc(1000)
    pool.free(p)
    assert pool.malloc(1000) == p  # same stream: reusable at once
    big = pool.malloc(7 * MiB)
    maps = pool.stats()["num_maps"]
    pool.free(big)
    assert pool.malloc(7 * MiB) == big
    assert pool.stats()["num_maps"] == maps  # idle pages were still mapped: no new map


def test_idle_pages_unmapped_after_hysteresis(pool):
    ptr = pool.malloc(9 * MiB)
    assert pool.stats()["mapped_bytes"] >= 5 * PAGE
    pool.free(ptr)
    deadline = time.time() + 5
    while pool.stats()["mapped_bytes"] and time.time() < deadline:
        time.sleep(0.01)  # the background sweep unmaps pages idle for > 1 ms
    assert pool.stats()["mapped_bytes"] == 0


def test_mapped_bytes_track_live_blocks(pool):
    a = pool.malloc(4 * MiB)
    b = pool.malloc(8 * MiB)
    c = pool.malloc(4 * MiB)
    assert (a, b, c) == (a, a + 4 * MiB, a + 12 * MiB)
    pool.free(b)
    pool.empty_cache()
    # a: pages 0-1, c: pages 6-7; b's four pages are unmapped although a and c stay live
    assert pool.stats()["mapped_bytes"] == 4 * PAGE
    fill(a, 4 * MiB, 1)
    fill(c, 4 * MiB, 2)
    check(a, 4 * MiB, 1)
    check(c, 4 * MiB, 2)


def test_boundary_pages_shared_not_rounded(pool):
    # 3 MiB blocks at 512 B granularity pack: 4 of them touch 6 pages, not 8
    ptrs = [pool.malloc(3 * MiB) for _ in range(4)]
    assert ptrs[1] - ptrs[0] == 3 * MiB
    assert pool.stats()["mapped_bytes"] == 6 * PAGE


def test_size_zero_gives_unique_pointers(pool):
    ptrs = [pool.malloc(0) for _ in range(100)]
    assert len(set(ptrs)) == 100 and 0 not in ptrs
    for p in ptrs:
        assert pool.free(p, 0)


def test_bad_inputs_are_reported_counted_and_ignored(pool, capfd):
    p = pool.malloc(4096)
    assert pool.free(p)
    assert not pool.free(p)  # double free
    assert not pool.free(0xDEAD000)  # unknown pointer
    assert not pool.free(pool.base + 12345)
    err = capfd.readouterr().err
    assert err.count("unknown pointer or double free") == 1  # reported once
    with pytest.raises(ValueError, match="malloc size = -5 is out of range"):
        pool.malloc(-5)  # refused before ctypes (issue 15): never reaches the pool's counters
    with pytest.raises(_native.NativeError) as e:
        pool.malloc(1 << 60)  # a valid int64, larger than the pool's range: refused natively
    assert e.value.status == _native.ERR_INVALID
    s = pool.stats()
    assert s["num_bad_frees"] == 3 and s["num_bad_sizes"] == 1
    assert s["allocated_bytes"] == 0 and s["live_blocks"] == 0
    q = pool.malloc(4096)  # still works
    assert q == p


def test_free_with_wrong_size_uses_block_size(pool):
    p = pool.malloc(3 * MiB)
    assert pool.free(p, 5)
    assert pool.stats()["num_size_mismatch"] == 1 and pool.stats()["allocated_bytes"] == 0


def test_oom_raises_with_figures_and_recovers():
    with VirtualPool(backend="host", capacity=8 * MiB) as p:
        a = p.malloc(6 * MiB)
        with pytest.raises(torch.OutOfMemoryError) as e:
            p.malloc(6 * MiB)
        msg = str(e.value)
        assert "requested 6.00 MiB" in msg and "live 6.00 MiB" in msg and "mapped 6.00" in msg
        assert "reserved VA" in msg and "device free" in msg
        assert p.stats()["num_ooms"] == 1
        p.free(a)
        p.free(p.malloc(6 * MiB))


def test_growth_reuses_idle_pages_before_oom():
    with VirtualPool(backend="host", capacity=10 * MiB, hysteresis_us=10_000_000) as p:
        a = p.malloc(4 * MiB)
        b = p.malloc(4 * MiB)
        p.free(a)  # a's 2 pages stay mapped (long hysteresis)
        c = p.malloc(6 * MiB)  # 3 pages next to b's 2: fits 5 pages only with a's handles
        assert c == b + 4 * MiB
        s = p.stats()
        assert s["pages_lent"] == 2 and s["mapped_bytes"] == 10 * MiB and s["num_ooms"] == 0
        fill = bytes(random.Random(3).randbytes(6 * MiB))
        ctypes.memmove(c, fill, len(fill))  # every page of c, lent ones included, holds data
        ctypes.memmove(b, b"\x5a" * (4 * MiB), 4 * MiB)
        assert ctypes.string_at(c, len(fill)) == fill
        p.free(b)
        p.free(c)
        p.empty_cache()  # a's old addresses retire (unmapped) without freeing c's handles twice
        s = p.stats()
        assert s["mapped_bytes"] == 0 and s["live_handles"] == 0 and s["allocated_bytes"] == 0


def test_arena_map_unmap_touch():
    with Arena(16 * MiB, backend="host") as ar:
        assert ar.capacity == 16 * MiB and ar.page_size == PAGE and ar.num_pages == 8
        assert ar.mapped_pages() == 0 and not ar.is_mapped(3)
        ar.map_pages(3, 2)
        assert ar.is_mapped(3) and ar.is_mapped(4) and not ar.is_mapped(5)
        t = ar.as_tensor(torch.float32)
        lo = 3 * PAGE // 4
        t[lo : lo + 1000] = torch.arange(1000, dtype=torch.float32)
        assert torch.equal(t[lo : lo + 1000], torch.arange(1000, dtype=torch.float32))
        assert ar.stats()["mapped_bytes"] >= 2 * PAGE
        with pytest.raises(_native.NativeError):
            ar.map_pages(4, 1)  # already mapped
        ar.unmap_pages(3, 2)
        assert ar.mapped_pages() == 0
        with pytest.raises(_native.NativeError):
            ar.unmap_pages(3, 1)
        # Mapped again, the page works. Its bytes are those of whichever cached handle it got
        # (zeros only if that one was never written, as on the GPU): reading them as zeros
        # failed whenever the shared context's handle cache was one short of full at the unmap.
        ar.map_pages(3, 1)
        t[lo : lo + 1000] = 2.0
        assert float(t[lo : lo + 1000].sum()) == 2000.0


def test_c_loop_and_prepare(pool):
    assert pool.bench(4096, 1000) > 0
    assert pool.bench(8 * MiB, 100) > 0
    pool.prepare(16 * MiB)
    assert pool.stats()["handle_cache_pages"] >= 8
    hist = pool.latency_histogram()
    assert len(hist) == 16 and sum(hist) == pool.stats()["num_maps"]


@pytest.mark.parametrize("pages", [1, 63, 64, 65, 4095, 4096, 4097, 200_000])
def test_idle_page_bitmap_agrees_with_a_set(pages):
    """The allocator's two-level bitmap of idle pages (csrc/page_set.h) against std::set:
    random inserts and erases, then next / prev / last from random points, word and summary
    boundaries included (sizes around 64 and 4096)."""
    for seed in (1, 2, 3):
        assert _native.lib().oxygen_pageset_selftest(seed, pages, 20_000) == 0


@pytest.mark.parametrize("lend", [True, False])
def test_lend_idle_false_maps_new_pages_and_leaves_idle_ones_where_they_are(lend):
    """pool.lend_idle_pages: a block that cannot sit on idle pages takes their physical pages
    (lends: mapped bytes stay what live blocks touch) or, with lending off, maps new ones while
    the idle pages wait out their hysteresis at their own address. Content is kept either way."""
    page = 2 << 20
    rnd = random.Random(7)
    with VirtualPool(backend="host", capacity=1 << 30, hysteresis_us=60_000_000,
                     lend_idle=lend) as pool:  # fmt: skip
        a = pool.malloc(rnd.randint(3, 5) * page)
        b = pool.malloc(page)  # a live neighbour: a's pages stay a hole of their own
        ctypes.memset(b, 0x5A, page)
        pool.free(a)
        idle = pool.stats()["idle_pages"]
        assert idle >= 3
        c = pool.malloc(rnd.randint(8, 12) * page)  # larger than a's hole: new pages needed
        s = pool.stats()
        if lend:
            assert s["pages_lent"] >= 3 and s["idle_pages"] < idle
        else:
            assert s["pages_lent"] == 0 and s["idle_pages"] == idle
        assert ctypes.string_at(b, page) == b"\x5a" * page
        pool.free(b)
        pool.free(c)
    with pytest.raises(TypeError, match="lend_idle"):
        VirtualPool(backend="host", capacity=1 << 30, lend_idle="no")


def test_a_block_below_the_live_high_water_maps_new_pages_and_leaves_idle_ones_for_later():
    """Lending moves a page (a map at the new address, an unmap at the old one later). Below the
    peak of live bytes a new page costs the same one map, and the idle pages stay where the
    next blocks sit on them with none: only pages past that peak are lent. The peak is the
    pool's own: reset_peak() (before a benchmark's timed run) does not lower it."""
    page = 2 << 20
    with VirtualPool(backend="host", capacity=1 << 30, hysteresis_us=40_000) as pool:
        big = pool.malloc(24 * page)  # the live high-water: 24 pages
        pool.free(big)
        time.sleep(0.3)
        pool.free(pool.malloc(512))  # a sweep: big's pages have waited out their hysteresis
        assert pool.stats()["idle_pages"] <= 1
        pool.reset_peak()  # (torch's reset_peak_memory_stats): the high-water stays
        assert pool.stats()["peak_allocated_bytes"] < 24 * page
        a, s1 = pool.malloc(3 * page), pool.malloc(page)
        b, s2 = pool.malloc(3 * page), pool.malloc(page)
        pool.free(a)
        pool.free(b)
        idle = pool.stats()["idle_pages"]
        assert idle >= 6
        c = pool.malloc(5 * page)  # fits neither 3-page hole; mapped + 5 stays below 24 pages
        s = pool.stats()
        assert s["pages_lent"] == 0 and s["idle_pages"] == idle
        d = pool.malloc(30 * page)  # past the high-water: idle pages are lent
        assert pool.stats()["pages_lent"] > 0
        for p in (s1, s2, c, d):
            pool.free(p)


def test_idle_pages_within_the_recent_live_peak_stay_while_allocations_come_and_go_after():
    """A periodic workload (a step's activations, layer after layer) frees and takes the same
    bytes again and again: while allocations keep coming, idle pages within the live bytes'
    recent peak stay mapped past their hysteresis (the next blocks sit on them, no map); once
    allocations stop, every idle page goes after its hysteresis (memory back)."""
    page = 2 << 20
    with VirtualPool(backend="host", capacity=1 << 30, hysteresis_us=60_000) as pool:
        n = random.randint(6, 12)
        pool.free(pool.malloc(n * page))  # the peak: n pages, now idle
        assert pool.stats()["idle_pages"] >= n
        maps = pool.stats()["num_maps"]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 0.5:  # allocations keep coming, well past 60 ms
            pool.free(pool.malloc(random.randint(1, 4096)))
            time.sleep(0.002)
        s = pool.stats()
        assert s["idle_pages"] >= n - 1, s["idle_pages"]
        again = pool.malloc(n * page)  # sits on them: nothing mapped anew
        assert pool.stats()["num_maps"] - maps <= 1
        pool.free(again)
        time.sleep(0.8)  # no allocation now: the background sweep unmaps them
        s = pool.stats()
        assert s["idle_pages"] <= 1 and s["pool_mapped_bytes"] <= 2 * page


def test_a_periodic_sweep_yields_its_unmaps_to_waiting_mallocs_and_memory_still_comes_back():
    """The background sweep unmaps idle pages holding the lock malloc and free wait on (on a GPU
    20-50 us a page, up to 128 a sweep): past a floor of 8 it stops for a waiting thread and
    goes on 5 ms later. Three threads churn small blocks while a large block's pages, idle and
    past the live bytes' recent peak (two 1 s epochs on), are unmapped: the sweeps yield
    (counted) and every idle page still goes; the live blocks keep their bytes. A host unmap
    takes microseconds, so it is slowed to a GPU's here: a sweep's first 8 unmaps hold the lock
    1.6 ms, long enough for a churning thread to wait on it on a loaded 2-core machine (without
    the knob CI once saw no sweep with a waiter in three rounds)."""
    import threading

    from oxygen_torch.pool import native as _native

    lib = _native.lib()
    lib.oxygen_host_set_unmap_delay(200_000)
    try:
        # (20 ms, the default: a malloc sweeps itself only when the last sweep is 4 x that old, so
        # the background thread's sweeps are the ones that unmap)
        with VirtualPool(backend="host", capacity=1 << 30, hysteresis_us=20_000) as pool:
            live = [(pool.malloc(n), n) for n in random.sample(range(512, 3 * MiB), 6)]
            for i, (p, n) in enumerate(live):
                fill(p, n, i)
            stop, errors = threading.Event(), []

            def churn(seed):
                rng = random.Random(seed)
                sizes = [rng.randint(512, 64 << 10) for _ in range(64)]
                try:
                    while not stop.is_set():
                        for n in sizes:  # (mostly in malloc and free: waiting there is the point)
                            pool.free(pool.malloc(n))
                        p = pool.malloc(sizes[0])
                        fill(p, sizes[0], seed)
                        check(p, sizes[0], seed)
                        pool.free(p)
                except Exception as e:  # (reported below: a thread's assert would be lost)
                    errors.append(e)

            threads = [threading.Thread(target=churn, args=(s,)) for s in (101, 202, 303)]
            for t in threads:
                t.start()
            try:
                for _ in range(3):  # (a round without a waiter at the right moment: again)
                    pool.free(pool.malloc(192 * PAGE))  # 192 idle pages, the live peak for now
                    deadline = time.monotonic() + 20
                    while pool.stats()["idle_pages"] > 2 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert pool.stats()["idle_pages"] <= 2, pool.stats()["idle_pages"]
                    if pool.stats()["sweeps_yielded"]:
                        break
            finally:
                stop.set()
                for t in threads:
                    t.join()
            assert not errors, errors
            assert pool.stats()["sweeps_yielded"] > 0
            for i, (p, n) in enumerate(live):
                check(p, n, i)
    finally:
        lib.oxygen_host_set_unmap_delay(0)
