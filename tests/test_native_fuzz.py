"""Property test of the pool and arena API under hostile arguments: random sequences of calls with
arbitrary integers (negative, zero, huge, past the end) and values that are not integers at all,
through the Python wrappers and straight into the C ABI. Checked: nothing crashes the process
(the calls run in a child process, so a segfault or an abort fails the test instead of ending
the run), every bad call is a clear Python exception (or, from C, an error status with a text)
and leaves no trace, and afterwards the pool's counters agree with a model of the live blocks
and every live block and mapped arena page still holds what was written to it."""

import ctypes
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oxygen_torch.pool import Arena, VirtualPool
from oxygen_torch.pool import native as _native

MiB = 1 << 20
PAGE = 2 * MiB
CAPACITY = 64 * MiB
ARENA_PAGES = 8
CHILD = "OXYGEN_FUZZ_CHILD"

EDGES = [-(1 << 63), -(1 << 64), -1, 0, 1, 511, 512, PAGE - 1, PAGE, ARENA_PAGES - 1, ARENA_PAGES]
EDGES += [(1 << 31) - 1, 1 << 32, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, 1 << 64, 10**30]
anyint = st.one_of(st.integers(), st.sampled_from(EDGES), st.integers(-2, 3 * ARENA_PAGES))
junk = st.sampled_from([None, True, False, 1.5, float("nan"), "12", b"\x00", [1], object()])
arg = st.one_of(anyint, anyint, anyint, junk)
small_size = st.one_of(st.integers(0, 4096), st.integers(4097, 3 * MiB))

page = st.integers(0, ARENA_PAGES - 1)
calls = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), small_size),  # valid calls too: something to corrupt
        st.tuples(st.just("map"), page, st.integers(1, 3)),
        st.tuples(st.just("malloc"), st.one_of(small_size, arg)),
        st.tuples(st.just("free_live"), st.integers(0, 1000), st.one_of(st.none(), arg)),
        st.tuples(st.just("free"), arg, st.one_of(st.none(), arg)),
        st.tuples(st.just("map"), arg, st.one_of(st.just(1), arg)),
        st.tuples(st.just("unmap"), arg, st.one_of(st.just(1), arg)),
        st.tuples(st.just("is_mapped"), arg),
        st.tuples(st.just("prepare"), arg),
        st.tuples(st.just("c_map"), anyint, anyint),
        st.tuples(st.just("c_unmap"), anyint, anyint),
        st.tuples(st.just("c_malloc"), anyint),
        st.tuples(st.just("c_free"), anyint, anyint),
        st.tuples(st.just("c_is_mapped"), anyint),
        st.tuples(st.just("empty_cache")),
    ),
    min_size=5,
    max_size=60,
)


def round512(n):
    return max(512, (n + 511) // 512 * 512)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def clear(exc: BaseException) -> bool:
    """A clear Python exception: one of the documented kinds, with a message that says something."""
    kinds = (TypeError, ValueError, RuntimeError, torch.OutOfMemoryError)
    return isinstance(exc, kinds) and len(str(exc)) > 15


def c_u64(v):
    """How ctypes would hand an arbitrary int to a size_t / uint64 parameter (wrapped)."""
    return v % (1 << 64)


def c_i64(v):
    v %= 1 << 64
    return v - (1 << 64) if v >= 1 << 63 else v


class Model:
    """What the pool and the arena must hold: live blocks and mapped pages, each with a tag."""

    def __init__(self, pool, arena):
        self.pool, self.arena = pool, arena
        self.live: dict[int, tuple[int, int]] = {}  # ptr -> (size, tag)
        self.mapped: dict[int, int] = {}  # page -> tag
        self.bad_frees = 0
        self.tag = 0

    def next_tag(self):
        self.tag = self.tag % 250 + 1
        return self.tag

    def stamp_block(self, ptr, n):
        tag = self.next_tag()
        if n:
            ctypes.memset(ptr, tag, min(n, 256))
            ctypes.memset(ptr + n - min(n, 256), tag, min(n, 256))
        self.live[ptr] = (n, tag)

    def stamp_page(self, page):
        tag = self.next_tag()
        ctypes.memset(self.arena.base + page * PAGE, tag, 4096)
        self.mapped[page] = tag

    def check(self):
        s = self.pool.stats()
        assert s["allocated_bytes"] == sum(round512(n) for n, _ in self.live.values())
        assert s["requested_bytes"] == sum(n for n, _ in self.live.values())
        assert s["live_blocks"] == len(self.live)
        assert s["num_bad_frees"] == self.bad_frees
        assert self.arena.mapped_pages() == len(self.mapped)
        assert all(self.arena.is_mapped(p) == (p in self.mapped) for p in range(ARENA_PAGES))

    def check_contents(self):
        for ptr, (n, tag) in self.live.items():
            k = min(n, 256)
            assert ctypes.string_at(ptr, k) == bytes([tag]) * k, f"block {ptr:#x} overwritten"
            assert ctypes.string_at(ptr + n - k, k) == bytes([tag]) * k
        for page, tag in self.mapped.items():
            got = ctypes.string_at(self.arena.base + page * PAGE, 4096)
            assert got == bytes([tag]) * 4096, f"arena page {page} overwritten"


def expect_refused(fn, *args):
    """The call must raise a clear exception (the model stays as it was)."""
    try:
        fn(*args)
    except Exception as exc:
        assert clear(exc), f"unclear exception {exc!r} from {fn.__name__}{args!r:.200}"
        return exc
    raise AssertionError(f"{fn.__name__}{args!r:.200} was accepted")


def valid_range(first, count):
    return (
        is_int(first)
        and is_int(count)
        and 0 <= first < ARENA_PAGES
        and 1 <= count <= (ARENA_PAGES - first)
    )


def do_malloc(m, size):
    if not is_int(size) or not 0 <= size < 1 << 63:
        return expect_refused(m.pool.malloc, size)
    try:
        ptr = m.pool.malloc(size)
    except (torch.OutOfMemoryError, _native.NativeError) as exc:
        # fits easily: must succeed; otherwise a refusal must name the request
        total = sum(round512(n) for n, _ in m.live.values())
        assert size > 8 * MiB or total + size > CAPACITY // 2, exc
        assert clear(exc)
        return
    assert ptr not in m.live
    m.stamp_block(ptr, size)


def do_free(m, ptr, size):
    ok_size = size is None or (is_int(size) and 0 <= size < 1 << 63)
    if not (is_int(ptr) and 0 <= ptr < 1 << 64) or not ok_size:
        return expect_refused(m.pool.free, ptr, size)
    freed = m.pool.free(ptr, size)
    assert freed == (ptr in m.live)
    if freed:
        m.live.pop(ptr)
    else:
        m.bad_frees += 1


def do_map(m, first, count, unmap):
    fn = m.arena.unmap_pages if unmap else m.arena.map_pages
    pages = range(first, first + count) if valid_range(first, count) else None
    if pages is None or any((p in m.mapped) != unmap for p in pages):
        return expect_refused(fn, first, count)  # out of range, or already (un)mapped
    fn(first, count)
    for p in pages:
        if unmap:
            del m.mapped[p]
        else:
            m.stamp_page(p)


def do_c_call(m, op, a, b=0):
    """Straight into the C ABI with the argument wrapped as ctypes would wrap it."""
    lib = _native.lib()
    if op in ("c_map", "c_unmap"):
        first, count = c_u64(a), c_u64(b)
        ok = count and first < ARENA_PAGES and count <= ARENA_PAGES - first
        fn = lib.oxygen_arena_map if op == "c_map" else lib.oxygen_arena_unmap
        pages = range(first, first + count) if ok else range(0)
        if not ok or any((p in m.mapped) == (op == "c_map") for p in pages):
            assert fn(m.arena._h, first, count) == _native.ERR_INVALID
            assert "map" in _native.last_error()
            return
        assert fn(m.arena._h, first, count) == _native.OK
        for p in pages:
            m.mapped.pop(p) if op == "c_unmap" else m.stamp_page(p)
    elif op == "c_is_mapped":
        assert lib.oxygen_arena_is_mapped(m.arena._h, c_u64(a)) == (c_u64(a) in m.mapped)
    elif op == "c_malloc":
        size, out = c_i64(a), ctypes.c_void_p()
        st = lib.oxygen_pool_malloc(m.pool._h, size, 0, ctypes.byref(out))
        if size < 0 or size > 8 * MiB:  # absurd, or more than the test lets live
            if st == _native.OK:
                lib.oxygen_pool_free(m.pool._h, out.value, size, 0)
            else:
                assert st in (_native.ERR_INVALID, _native.ERR_OOM) and _native.last_error()
            return
        if st == _native.OK:
            m.stamp_block(out.value, size)
    elif op == "c_free":
        ptr, size = c_u64(a), c_i64(b)
        st = lib.oxygen_pool_free(m.pool._h, ptr, size, 0)
        assert (st == _native.OK) == (ptr in m.live)
        if ptr in m.live:
            m.live.pop(ptr)
        else:
            m.bad_frees += 1


def run(m, op, args):
    if op == "malloc":
        do_malloc(m, *args)
    elif op == "free_live":
        if m.live:
            ptr = sorted(m.live)[args[0] % len(m.live)]
            size = args[1]
            if size is not None and (not is_int(size) or not 0 <= size < 1 << 63):
                expect_refused(m.pool.free, ptr, size)
            else:
                assert m.pool.free(ptr, size)
                m.live.pop(ptr)
    elif op == "free":
        do_free(m, *args)
    elif op in ("map", "unmap"):
        do_map(m, *args, unmap=op == "unmap")
    elif op == "is_mapped":
        page = args[0]
        if is_int(page) and 0 <= page < ARENA_PAGES:
            assert m.arena.is_mapped(page) == (page in m.mapped)
        else:
            expect_refused(m.arena.is_mapped, page)
    elif op == "prepare":
        n = args[0]
        if is_int(n) and 0 <= n <= CAPACITY:
            m.pool.prepare(n)
        else:  # not a size, or more handles than the capacity allows
            expect_refused(m.pool.prepare, n)
    elif op == "empty_cache":
        m.pool.empty_cache()
    else:
        do_c_call(m, op, *args)


def closed_objects_refuse():
    pool, arena = VirtualPool(backend="host", capacity=8 * MiB), Arena(4 * MiB, backend="host")
    pool.close()
    arena.close()
    for fn, args in [
        (pool.malloc, (16,)),
        (pool.free, (pool.base,)),
        (pool.stats, ()),
        (pool.empty_cache, ()),
        (arena.map_pages, (0,)),
        (arena.is_mapped, (0,)),
        (arena.as_tensor, ()),
        (arena.stats, ()),
    ]:
        exc = expect_refused(fn, *args)
        assert isinstance(exc, RuntimeError) and "closed" in str(exc)


@pytest.mark.skipif(not os.environ.get(CHILD), reason="runs in the child process of the test below")
@settings(
    max_examples=int(os.environ.get("OXYGEN_FUZZ_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
@given(calls)
def test_random_pool_and_arena_calls(trace):
    closed_objects_refuse()
    with (
        VirtualPool(backend="host", capacity=CAPACITY, hysteresis_us=1000) as pool,
        Arena(ARENA_PAGES * PAGE, backend="host") as arena,
    ):
        m = Model(pool, arena)
        for op, *args in trace:
            run(m, op, args)
            m.check()
        m.check_contents()
        for ptr, (n, _) in list(m.live.items()):
            assert pool.free(ptr, n)
        pool.empty_cache()
        assert pool.stats()["mapped_bytes"] == 0 and pool.stats()["allocated_bytes"] == 0


def test_random_calls_never_crash_the_process():
    """The property test above, in a child: a crash there is a failure here, with its output."""
    env = dict(os.environ, **{CHILD: "1"})
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            f"{__file__}::test_random_pool_and_arena_calls",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode >= 0, f"the child died of signal {-r.returncode}:\n{tail}"
    assert r.returncode == 0, tail
    assert "1 passed" in r.stdout, tail
