"""kv.map_ahead_bytes: a KV storage's thread maps the pages its block allocator needs next and
unmaps the pages left empty, off the allocating thread (kv/storage.py _Ahead). Every page with a
live block stays mapped in every region whatever the interleaving, a page is never mapped or
unmapped twice, retired pages wait for their kernels (events), and the memory goes back once
allocations stop. Every wait here is bounded."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from oxygen_torch.kv import storage as storage_mod
from oxygen_torch.kv.block_manager import BlockManager
from oxygen_torch.kv.storage import GUARD_BLOCK, KVStorage

KiB = 1 << 10
PAGE = 16 * KiB  # 2 blocks of 8 KiB a page (16 tokens x 2 heads x 64 x fp32)


class Backing:
    """Host memory with page-state checks from any thread (errors recorded, not raised in the
    map-ahead thread, which would only log them); `cap`: most pages mapped at once."""

    name = "checked"

    def __init__(self, pages_per_region: int, regions: int, cap: int | None = None):
        self.page_size = PAGE
        self.capacity = pages_per_region * regions * PAGE
        self.flat = torch.zeros(self.capacity, dtype=torch.uint8)
        self.mapped: set[int] = set()
        self.errors: list[str] = []
        self.cap = cap
        self.calls = {"map": 0, "unmap": 0}
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def tensor(self):
        return self.flat

    def map_pages(self, first, count):
        new = set(range(first, first + count))
        with self._lock:
            self.threads.add(threading.current_thread().name)
            if new & self.mapped:
                self.errors.append(f"pages {sorted(new & self.mapped)} mapped twice")
            if self.cap is not None and len(self.mapped) + count > self.cap:
                raise torch.OutOfMemoryError("no memory for the page")
            self.mapped |= new
            self.calls["map"] += 1
        time.sleep(random.uniform(0, 2e-4))  # (the driver's time: other threads run)

    def unmap_pages(self, first, count):
        gone = set(range(first, first + count))
        with self._lock:
            if not gone <= self.mapped:
                self.errors.append(f"pages {sorted(gone - self.mapped)} unmapped, not mapped")
            self.mapped -= gone
            self.calls["unmap"] += 1

    def is_mapped(self, page):
        return page in self.mapped

    def close(self):
        pass


def _storage(pages: int = 12, layers: int = 2, cap: int | None = None):
    backing = Backing(pages, 2 * layers, cap)
    st = KVStorage(backing, layers, 2, 64, torch.float32, 16)
    assert st.region_pages == pages and st.num_blocks == 2 * pages
    mgr = BlockManager(st.num_blocks, first_id=GUARD_BLOCK + 1, on_alloc=st.on_alloc,
                       on_free=st.on_free)  # fmt: skip
    return st, backing, mgr


def _wait(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def _regions_mapped(st, backing, page) -> bool:
    return all(backing.is_mapped(r * st.region_pages + page) for r in st._all.regions)


def _check_live_pages_mapped(st, backing):
    with st.lock:
        for p, n in enumerate(st._all.live):
            if n:
                assert _regions_mapped(st, backing, p), f"page {p} holds {n} live blocks, unmapped"


def _assert_back_to_the_guard(st, backing, within: float) -> None:
    """Every page but the guard block's goes back (allocations stopped), no page state error."""
    guard = {r * st.region_pages for r in st._all.regions}
    assert _wait(lambda: backing.mapped == guard, within), sorted(backing.mapped)
    assert not backing.errors, backing.errors


def test_the_thread_maps_the_next_pages_and_an_allocation_on_them_maps_nothing():
    st, backing, mgr = _storage()
    st.map_ahead(2 * 4 * PAGE)  # two region pages (4 regions)
    try:
        with st.lock:
            a = mgr.allocate(3)  # blocks 1-3: pages 0 and 1
        assert _wait(lambda: _regions_mapped(st, backing, 2) and _regions_mapped(st, backing, 3))
        calls = []
        real = storage_mod._Regions._map
        storage_mod._Regions._map = lambda self, s, pages, retried=False: (
            calls.append(pages), real(self, s, pages, retried))[1]  # fmt: skip
        try:
            with st.lock:
                b = mgr.allocate(4)  # blocks 4-7: pages 2 and 3, mapped ahead
        finally:
            storage_mod._Regions._map = real
        assert calls == [], calls
        assert "oxygen-kv-ahead" in backing.threads
        _check_live_pages_mapped(st, backing)
        with st.lock:
            mgr.decref(a + b)
        # allocations stopped (AHEAD_KEEP_S after the last one, then a sweep: well within
        # half a second)
        _assert_back_to_the_guard(st, backing, 0.5)
    finally:
        st.close_ahead()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_allocations_from_threads_keep_every_live_page_mapped(seed):
    """Four threads allocate and free random runs of blocks while the thread maps ahead and
    unmaps: after every operation each live block's pages are mapped in every region, no page
    is mapped or unmapped twice, a block's contents survive, and once the threads stop the
    mapped pages are the live ones (and the guard's)."""
    seed = seed * 1000 + int(torch.randint(0, 1000, (1,)))
    st, backing, mgr = _storage(pages=24)
    st.map_ahead(3 * 4 * PAGE)
    k0 = st.k[0]
    stamp = {}
    failures = []

    def worker(i):
        rng = random.Random(seed + i)
        held = []
        try:
            for _ in range(150):
                if held and (rng.random() < 0.45 or len(held) > 6):
                    blocks = held.pop(rng.randrange(len(held)))
                    with st.lock:
                        for b in blocks:  # contents written at allocation are still there
                            if float(k0[b, 0, 0, 0]) != stamp[b]:
                                failures.append(f"block {b} lost its contents")
                        mgr.decref(blocks)
                else:
                    with st.lock:
                        try:
                            blocks = mgr.allocate(rng.randint(1, 5))
                        except Exception:  # noqa: BLE001 - the pool is full: free first
                            continue
                        for b in blocks:
                            stamp[b] = float(rng.randint(1, 1000))
                            k0[b, 0, 0, 0] = stamp[b]
                    held.append(blocks)
                _check_live_pages_mapped(st, backing)
                if rng.random() < 0.1:
                    time.sleep(0.001)
            with st.lock:
                for blocks in held:
                    mgr.decref(blocks)
        except Exception as exc:  # noqa: BLE001 - reported below
            failures.append(repr(exc))

    try:
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(60)
            assert not t.is_alive()
        assert not failures, failures[:5]
        assert not backing.errors, backing.errors[:5]
        _assert_back_to_the_guard(st, backing, 2.0)
        assert st._ahead.maps > 0
    finally:
        st.close_ahead()


def test_a_retired_page_waits_for_its_kernels_before_the_thread_unmaps_it():
    class Event:
        done = False

        def query(self):
            return self.done

    st, backing, mgr = _storage()
    st.map_ahead(4 * PAGE)  # one region page
    try:
        with st.lock:
            mgr.allocate(9)  # blocks 1-9: pages 0-4
        ev = Event()
        with st.lock:  # (the thread cannot look before the event is in place)
            mgr.decref([8, 9])  # page 4 empties
            assert st._retired and 4 in st._retired[-1][2]
            st._retired[-1] = (ev, *st._retired[-1][1:])
        time.sleep(storage_mod.AHEAD_KEEP_S + 0.1)  # allocations stopped: nothing kept ahead
        assert _regions_mapped(st, backing, 4)  # its kernels may still run
        ev.done = True
        assert _wait(lambda: not any(
            backing.is_mapped(r * st.region_pages + 4) for r in range(4)), 2.0)  # fmt: skip
        _check_live_pages_mapped(st, backing)
        assert not backing.errors, backing.errors
    finally:
        st.close_ahead()


def test_out_of_memory_with_pages_mapped_ahead_raises_and_recovers():
    """Memory runs out while pages are mapped ahead: the allocation that needs more pages than
    fit gives them back, tries once more and raises OutOfMemoryError (no hang); the storage
    stays consistent and an allocation that fits then succeeds."""
    st, backing, mgr = _storage(pages=12, cap=4 * 5)  # 5 pages a region at most
    st.map_ahead(3 * 4 * PAGE)
    try:
        with st.lock:
            a = mgr.allocate(5)  # pages 0-2
        assert _wait(lambda: st._ahead.maps >= 2)
        with pytest.raises(torch.OutOfMemoryError):
            with st.lock:
                mgr.allocate(8)  # pages 3-6: one more than fits
        _check_live_pages_mapped(st, backing)
        with st.lock:
            b = mgr.allocate(4)  # pages 3-4: fit
        _check_live_pages_mapped(st, backing)
        with st.lock:
            mgr.decref(a + b)
        _assert_back_to_the_guard(st, backing, 2.0)
    finally:
        st.close_ahead()


def test_map_ahead_off_and_closed_leaves_no_thread():
    st, backing, mgr = _storage()
    st.map_ahead(4 * PAGE)
    thread = st._ahead.thread
    st.map_ahead(0)
    thread.join(5)
    assert st._ahead is None and not thread.is_alive()
    with st.lock:
        blocks = mgr.allocate(3)
    _check_live_pages_mapped(st, backing)
    with st.lock:
        mgr.decref(blocks)
    assert backing.mapped == {r * st.region_pages for r in range(4)}  # at once, this thread
    st.map_ahead(4 * PAGE)
    thread = st._ahead.thread
    st.close_ahead()
    thread.join(5)
    assert not thread.is_alive()


def test_the_config_field_names_its_range():
    from oxygen_torch.config.fields import KVConfig

    assert KVConfig().map_ahead_bytes == 256 << 20
    with pytest.raises(ValueError, match="kv.map_ahead_bytes"):
        KVConfig(map_ahead_bytes=-1)
