"""Concurrency: 8 threads of random malloc/free on one pool, every block filled with its own
pattern and checked before it is freed, stats read concurrently, and mapped bytes back to zero."""

import random
import sys
import threading
from pathlib import Path

from oxygen_torch.pool import VirtualPool

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from host_random import stamp, verify  # noqa: E402

MiB = 1 << 20
SIZES = [0, 1, 512, 700, 4096, 5000, 65536, 300_000, 1 << 20, (1 << 20) + 1, 3 * MiB + 17, 9 * MiB]


def worker(pool, seed, ops, errors):
    rng = random.Random(seed)
    live = []
    stream = rng.choice([0, 0x10 * (seed + 1)])  # some threads on their own stream
    try:
        for i in range(ops):
            if live and (rng.random() < 0.45 or len(live) > 40):
                ptr, n, tag = live.pop(rng.randrange(len(live)))
                if not verify(ptr, n, tag):
                    errors.append(f"thread {seed}: block {ptr:#x} ({n} B) was overwritten")
                pool.free(ptr, n, stream)
            else:
                n = rng.choice(SIZES)
                ptr = pool.malloc(n, stream)
                tag = seed * 1_000_003 + i
                stamp(ptr, n, tag)
                live.append((ptr, n, tag))
        for ptr, n, tag in live:
            if not verify(ptr, n, tag):
                errors.append(f"thread {seed}: block {ptr:#x} ({n} B) was overwritten")
            pool.free(ptr, n, stream)
    except Exception as exc:  # surfaced in the main thread
        errors.append(f"thread {seed}: {exc!r}")


def test_eight_threads_random_malloc_free_with_content_checks():
    with VirtualPool(backend="host", capacity=1024 * MiB, hysteresis_us=500) as pool:
        errors: list[str] = []
        threads = [threading.Thread(target=worker, args=(pool, s, 1000, errors)) for s in range(8)]
        stop = threading.Event()
        seen = []

        def reader():  # stats readers never block writers (atomics)
            while not stop.is_set():
                s = pool.stats()
                seen.append((s["allocated_bytes"], s["mapped_bytes"]))

        r = threading.Thread(target=reader)
        r.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        r.join()
        assert not errors, errors[:5]
        assert len(seen) > 10
        s = pool.stats()
        assert s["allocated_bytes"] == 0 and s["live_blocks"] == 0
        assert s["num_allocs"] == s["num_frees"] and s["num_bad_frees"] == 0
        assert s["peak_mapped_bytes"] <= pool.capacity
        pool.empty_cache()
        s = pool.stats()
        assert s["mapped_bytes"] == 0 and s["idle_pages"] == 0 and s["slab_cached_pages"] == 0


def test_the_whole_capacity_is_usable_while_the_refill_thread_creates_pages():
    """The refill thread counts a page as owned while it creates it. An allocation that needs the
    last pages of the capacity at that moment waits for them: it is not out of memory (a spurious
    OOM a loaded CI machine once hit; page creation is slowed here so that it always overlaps)."""
    from oxygen_torch.pool import native as _native

    lib = _native.lib()
    page = 2 * MiB
    lib.oxygen_host_set_create_delay(3_000_000)  # up to ~3 ms a page
    try:
        with VirtualPool(backend="host", capacity=12 * page, hysteresis_us=1000) as p:
            for _ in range(12):
                p.empty_cache()
                blocks = [p.malloc(2 * page) for _ in range(6)]  # the whole capacity
                assert p.stats()["mapped_bytes"] == 12 * page
                for b in blocks:
                    p.free(b)
    finally:
        lib.oxygen_host_set_create_delay(0)
