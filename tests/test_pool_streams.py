"""Stream-ordered reuse and CUDA-graph capture arenas, on the host backend: its test knobs hold
events pending (so "the free has not completed on the device yet" can be staged on a CPU) and mark
fake streams as capturing."""

import time

import pytest

from oxygen_torch.pool import VirtualPool
from oxygen_torch.pool import native as _native

MiB = 1 << 20
PAGE = 2 * MiB
S1, S2, CAP = 0x1000, 0x2000, 0x3000  # fake stream handles


@pytest.fixture
def lib():
    so = _native.lib()
    yield so
    so.oxygen_host_hold_events(0)
    so.oxygen_host_set_capture(CAP, 0)


def wait_until(cond, timeout=5.0):
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.005)
    return cond()


def overlaps(a, n, b, m):
    return a < b + m and b < a + n


def test_cross_stream_reuse_waits_for_the_event(lib):
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=1000) as p:
        a = p.malloc(4 * MiB, stream=S1)
        p.free(a, stream=S1)
        b = p.malloc(4 * MiB, stream=S2)  # S1's free may still run on the device
        assert not overlaps(a, 4 * MiB, b, 4 * MiB)
        c = p.malloc(4 * MiB, stream=S1)  # same stream: stream order protects it
        assert c == a
        p.free(c, stream=S1)
        time.sleep(0.05)
        # a's pages are idle but not unmapped: the device may still touch them
        assert p.stats()["mapped_bytes"] == 4 * PAGE
        lib.oxygen_host_hold_events(0)
        assert wait_until(lambda: p.stats()["mapped_bytes"] == 2 * PAGE)
        d = p.malloc(4 * MiB, stream=S2)  # now safe for everyone
        assert d == a


def test_pages_still_read_by_the_device_back_new_blocks_of_the_same_stream_only(lib):
    """A CPU running ahead frees pages the GPU still reads. Their handles may back a new block of
    the same stream (it runs after the readers) but not of another one, and their old addresses
    stay mapped and unusable until the device has passed the free."""
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=1000) as p:
        a = p.malloc(4 * MiB, stream=S1)
        keep = p.malloc(4 * MiB, stream=S1)  # a's free range cannot grow into a 6 MiB hole
        p.free(a, stream=S1)
        b = p.malloc(6 * MiB, stream=S2)  # another stream: fresh pages
        assert p.stats()["pages_lent"] == 0 and p.stats()["mapped_bytes"] == 7 * PAGE
        c = p.malloc(6 * MiB, stream=S1)  # same stream: a's two handles back c
        s = p.stats()
        assert s["pages_lent"] == 2 and s["mapped_bytes"] == 8 * PAGE  # not 10
        assert not overlaps(c, 6 * MiB, a, 4 * MiB)
        d = p.malloc(4 * MiB, stream=S1)  # a's addresses are out of the free ranges meanwhile
        assert not overlaps(d, 4 * MiB, a, 4 * MiB) and not overlaps(d, 4 * MiB, c, 6 * MiB)
        for x in (b, c, d, keep):
            p.free(x, stream=S1 if x != b else S2)
        lib.oxygen_host_hold_events(0)
        p.empty_cache()
        s = p.stats()
        assert s["mapped_bytes"] == 0 and s["allocated_bytes"] == 0 and s["live_handles"] == 0
        got = [p.malloc(4 * MiB, stream=S2) for _ in range(16)]  # the whole capacity
        assert any(overlaps(e, 4 * MiB, a, 4 * MiB) for e in got)  # a's range was given back


def test_growing_blocks_reuse_the_pages_their_stream_just_freed(lib):
    """DynamicCache's torch.cat: each step every layer allocates its K/V one token longer, then
    frees the old one, while the GPU still reads it. The new blocks must mostly land on pages
    their stream just freed instead of mapping new ones: that is most of generate()'s map
    traffic (tests/test_pool_trace.py bounds it on the recorded generate() trace)."""
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=512 * MiB, hysteresis_us=10_000_000) as p:
        size = 26 * MiB + 400 * 1024
        blocks = [p.malloc(size, stream=S1) for _ in range(4)]
        first = p.stats()["num_maps"]
        for _ in range(10):
            size += 32 * 1024
            for j in range(4):
                new = p.malloc(size, stream=S1)
                p.free(blocks[j], stream=S1)
                blocks[j] = new
        s = p.stats()
        # 40 grown blocks of 14 pages: 560 maps without reuse; ~105 with it
        assert s["num_maps"] - first <= 168
        assert s["mapped_bytes"] <= 5 * 14 * PAGE
        for x in blocks:
            p.free(x, stream=S1)
        lib.oxygen_host_hold_events(0)
        p.empty_cache()
        assert p.stats()["mapped_bytes"] == 0


def test_small_block_freed_on_another_stream_is_deferred(lib):
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=64 * MiB) as p:
        x = p.malloc(4096, stream=S1)
        p.free(x, stream=S2)  # used on S2 at the end: S1 must not get it before S2 passed
        y = p.malloc(4096, stream=S1)
        assert y != x
        lib.oxygen_host_hold_events(0)
        p.free(y, stream=S1)
        p.empty_cache()
        assert p.stats()["mapped_bytes"] == 0 and p.stats()["allocated_bytes"] == 0


def test_capture_arena_private_and_quarantined_until_release(lib):
    with VirtualPool(backend="host", capacity=64 * MiB) as p:
        pre = p.malloc(4 * MiB, stream=CAP)
        p.free(pre, stream=CAP)
        token = lib.oxygen_capture_begin()
        lib.oxygen_host_set_capture(CAP, 42)
        assert lib.oxygen_capture_maybe_active()
        t1 = p.malloc(3 * MiB, stream=CAP)  # a temporary inside the captured region
        s1 = p.malloc(1000, stream=CAP)
        p.free(t1, stream=CAP)
        t2 = p.malloc(3 * MiB, stream=CAP)  # the same capture may reuse it (replay order)
        assert t2 == t1
        out = p.malloc(2 * MiB, stream=CAP)  # a graph output the user keeps
        p.free(t2, stream=CAP)
        p.free(s1, stream=CAP)
        lib.oxygen_host_set_capture(CAP, 0)
        lib.oxygen_capture_end(token)
        assert p.stats()["capture_allocs"] == 4
        # after the capture, nothing of the graph's memory goes to anyone else: replays write it
        later = [p.malloc(3 * MiB, stream=CAP), p.malloc(1000, stream=CAP)]
        assert not overlaps(later[0], 3 * MiB, t1, 3 * MiB)
        assert not overlaps(later[1], 1000, s1, 1000)
        assert p.stats()["quarantined_bytes"] >= 3 * MiB
        p.free(out, stream=CAP)  # freed after the capture: quarantined too
        assert p.stats()["quarantined_bytes"] >= 5 * MiB
        lib.oxygen_capture_release(token)  # the graph is gone
        assert p.stats()["quarantined_bytes"] == 0
        for q in later:
            p.free(q, stream=CAP)
        p.empty_cache()
        s = p.stats()
        assert s["mapped_bytes"] == 0 and s["allocated_bytes"] == 0 and s["live_blocks"] == 0


def test_capture_takes_only_memory_no_stream_can_touch(lib):
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=64 * MiB) as p:
        a = p.malloc(4 * MiB, stream=S1)
        p.free(a, stream=S1)  # S1 may still be using it
        token = lib.oxygen_capture_begin()
        lib.oxygen_host_set_capture(CAP, 7)
        c = p.malloc(4 * MiB, stream=CAP)
        assert not overlaps(a, 4 * MiB, c, 4 * MiB)
        lib.oxygen_host_set_capture(CAP, 0)
        lib.oxygen_capture_end(token)
        lib.oxygen_host_hold_events(0)
        lib.oxygen_capture_release(token)
        p.free(c, stream=CAP)


def test_unannounced_capture_memory_returns_when_it_ends(lib):
    # The MemPool route: PyTorch's caching allocator owns graph lifetimes, we only see segments.
    with VirtualPool(backend="host", capacity=64 * MiB) as p:
        lib.oxygen_host_set_capture(CAP, 9)
        seg = p.malloc(4 * MiB, stream=CAP)
        lib.oxygen_host_set_capture(CAP, 0)
        p.malloc(512, stream=S1)  # any call notices the capture ended
        p.free(seg, stream=CAP)
        p.empty_cache()
        assert p.stats()["quarantined_bytes"] == 0
        assert p.malloc(4 * MiB, stream=CAP) == seg


def test_record_stream_holds_a_freed_block_until_the_recorded_stream_has_passed(lib):
    """torch's record_stream: a block used on S2 too and freed on S1 is reused by no one, S1
    included (stream order protects S1's own uses only), before S2 has passed the free."""
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=1000) as p:
        a = p.malloc(3 * MiB, stream=S1)
        plain = p.malloc(3 * MiB, stream=S1)
        p.record_stream(a, S2)
        p.record_stream(a, S2)  # twice: one entry
        p.record_stream(a, S1)  # its own stream: nothing to wait for
        p.free(plain, stream=S1)
        assert p.malloc(3 * MiB, stream=S1) == plain  # no record: S1 reuses it at once
        p.free(a, stream=S1)
        s = p.stats()
        assert s["deferred_bytes"] == 3 * MiB and s["allocated_bytes"] == 3 * MiB
        held = [p.malloc(3 * MiB, stream=S1) for _ in range(3)]
        assert all(not overlaps(h, 3 * MiB, a, 3 * MiB) for h in held)
        for h in held:
            p.free(h, stream=S1)
        lib.oxygen_host_hold_events(0)  # S2 has passed the free
        assert wait_until(lambda: p.stats()["deferred_bytes"] == 0)
        assert p.malloc(3 * MiB, stream=S1) in (a, *held)
        with pytest.raises(_native.NativeError, match="not the start of a live block"):
            p.record_stream(a + 512, S2)
        with pytest.raises(ValueError):
            p.record_stream(-1, S2)


def test_record_stream_blocks_are_freed_by_empty_cache_and_teardown(lib):
    lib.oxygen_host_hold_events(1)
    p = VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=1000)
    blocks = [p.malloc(n, stream=S1) for n in (700, 5 * MiB, 12 * MiB)]
    for b in blocks:
        p.record_stream(b, S2)
        p.free(b, stream=S1)
    assert p.stats()["deferred_bytes"] > 0
    lib.oxygen_host_hold_events(0)
    p.empty_cache()  # waits for the device: every recorded stream has passed
    s = p.stats()
    assert s["deferred_bytes"] == 0 and s["mapped_bytes"] == 0
    keep = p.malloc(1 * MiB, stream=S1)
    p.record_stream(keep, S2)
    p.free(keep, stream=S1)
    p.close()  # a deferred block at teardown: no crash, nothing left


def test_a_small_block_freed_beside_live_ones_is_taken_again_only_on_its_stream(lib):
    """The stash (csrc/allocator.h): a small block freed on its own stream beside live blocks
    of its page is what the next malloc of its size on that stream gets; another stream does not
    get it while the free has not passed on the device; nothing of it is lost after."""
    import random

    rng = random.Random()
    n = rng.randrange(512, 1 << 20, 512)
    lib.oxygen_host_hold_events(1)
    with VirtualPool(backend="host", capacity=64 * MiB, hysteresis_us=60_000_000) as p:
        keep = p.malloc(rng.randint(1, 4096), stream=S1)  # a live neighbour on the page
        a = p.malloc(n, stream=S1)
        p.free(a, stream=S1)
        b = p.malloc(n, stream=S2)  # the free has not passed: not a's bytes
        assert not overlaps(a, n, b, n)
        again = p.malloc(n, stream=S1)
        assert again == a  # its own stream takes it back at once
        p.free(again, stream=S1)
        p.free(again, stream=S1)  # a double free of a stashed block: reported, ignored
        assert p.stats()["num_bad_frees"] == 1
        c, d = p.malloc(n, stream=S1), p.malloc(n, stream=S1)
        assert c == a and not overlaps(c, n, d, n)  # one block, handed out once
        for x, s in ((c, S1), (d, S1), (b, S2), (keep, S1)):
            p.free(x, stream=s)
        lib.oxygen_host_hold_events(0)
        p.empty_cache()  # the stashed block goes back first: nothing stays mapped
        s = p.stats()
        assert s["mapped_bytes"] == 0 and s["live_blocks"] == 0, s
