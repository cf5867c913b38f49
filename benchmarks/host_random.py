"""The allocator benchmark's CPU side, on the host backend (bench_allocator.py --host), shared with
the pool tests (tests/test_pool_workloads.py, tests/test_pool_threads.py):

- `stamp` / `verify`: every block stamped with a pattern of its own (whole block when small; when
  large its ends and one byte per 64 KiB of address: touching every 4 KiB of a fresh host page
  costs a page fault), checked before its free;
- `replay`: an alloc/free trace (workloads.trace, or the recorded one) on a host pool, content
  checked;
- `run`: random malloc/free from several threads, sizes log-uniform in [lo, hi] (512 B - 45 MiB:
  the issue-18 case, 11.4 % fragmentation then), each thread freeing a random live block with
  probability 1/2 or when it holds `live` blocks; the host goal: 8 threads x 200,000 operations,
  no corruption, mapped bytes back to 0, fragmentation <= 5 %;
- `paced_replay`: the trace recorded from a real generate() on the H200
  (tests/data/generate_trace.jsonl.gz) paced at its recorded average rate, so the idle-page
  hysteresis sees real time between a page going idle and its next use (an unpaced replay runs
  ~35x faster than the GPU did, which makes any hysteresis look ~35x longer).

Fragmentation is the pool's own figure: 1 - peak allocated / peak mapped (memory_stats()).
"""

from __future__ import annotations

import ctypes
import gzip
import json
import math
import random
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

MiB = 1 << 20
GiB = 1 << 30
TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "generate_trace.jsonl.gz"


SAMPLE = 64 << 10  # large blocks: one byte per 64 KiB of address (one page fault, not 16)


def _view(ptr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr))


def _pattern(ptr: int, n: int, tag: int) -> tuple[slice | np.ndarray, np.ndarray]:
    """Which bytes of an n-byte block at ptr carry the pattern, and their values (from the tag).
    Small blocks (<= 8 KiB): every byte. Larger: the first and last bytes and every byte at an
    address that is a multiple of SAMPLE -- absolute addresses, so two blocks that overlap by
    SAMPLE or more stamp a common byte and the earlier one fails its check."""
    if n <= 8192:
        return slice(0, n), np.full(n, tag & 0xFF, dtype=np.uint8)
    first = -ptr % SAMPLE
    idx = np.unique(np.concatenate(([0, n - 1], np.arange(first, n, SAMPLE))))
    return idx, ((tag + idx) & 0xFF).astype(np.uint8)


def stamp(ptr: int, n: int, tag: int) -> None:
    """Write the block's pattern (vectorised: a 45 MiB block is ~720 bytes written in C)."""
    if n:
        where, values = _pattern(ptr, n, tag)
        _view(ptr, n)[where] = values


def verify(ptr: int, n: int, tag: int) -> bool:
    if not n:
        return True
    where, values = _pattern(ptr, n, tag)
    return bool(np.array_equal(_view(ptr, n)[where], values))


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def worker(pool, seed: int, ops: int, live_max: int, lo: int, hi: int, errors: list) -> None:
    rng = random.Random(seed)
    live: list[tuple[int, int, int]] = []
    try:
        for i in range(ops):
            if live and (rng.random() < 0.5 or len(live) >= live_max):
                ptr, n, tag = live.pop(rng.randrange(len(live)))
                if not verify(ptr, n, tag):
                    errors.append(f"seed {seed}: block {ptr:#x} ({n} B) was overwritten")
                pool.free(ptr, n)
            else:
                n = log_uniform(rng, lo, hi)
                ptr = pool.malloc(n)
                tag = seed * 1_000_003 + i
                stamp(ptr, n, tag)
                live.append((ptr, n, tag))
        for ptr, n, tag in live:
            if not verify(ptr, n, tag):
                errors.append(f"seed {seed}: block {ptr:#x} ({n} B) was overwritten")
            pool.free(ptr, n)
    except Exception as exc:  # surfaced by run()
        errors.append(f"seed {seed}: {exc!r}")


def random_trace(seed: int, threads: int = 4, ops: int = 3000, live_max: int = 40,
                 lo: int = 512, hi: int = 45 * MiB) -> list[list]:  # fmt: skip
    """The operations `threads` workers of `run` would make (each its own seeded stream of
    random malloc/free, sizes log-uniform in [lo, hi], at most live_max blocks live), taken in a
    seeded order: one deterministic trace for `replay` (["a" | "f", size, id, stream 0]), the
    same on every machine and run, so that pool changes of a point or two can be judged."""
    order = random.Random(seed)
    rngs = [random.Random(seed * 1000 + k) for k in range(threads)]
    live: list[list[tuple[int, int]]] = [[] for _ in range(threads)]
    left = [ops] * threads
    trace, next_id = [], 0
    while any(left):
        k = order.choice([i for i in range(threads) if left[i]])
        rng, mine = rngs[k], live[k]
        left[k] -= 1
        if mine and (rng.random() < 0.5 or len(mine) >= live_max):
            i, n = mine.pop(rng.randrange(len(mine)))
            trace.append(["f", n, i, 0])
        else:
            n = log_uniform(rng, lo, hi)
            mine.append((next_id, n))
            trace.append(["a", n, next_id, 0])
            next_id += 1
    for mine in live:
        trace += [["f", n, i, 0] for i, n in mine]
    return trace


CLOCK_START = 1 << 40  # where a replay's clock starts (any value: the pools read differences)


@contextmanager
def pool_clock(on: bool = True):
    """While inside, the pools read a replay's clock (oxygen_set_virtual_clock): yields
    set(ns), which moves it to ns after the start (None when not `on`: the steady clock).
    Back to the steady clock on the way out."""
    if not on:
        yield None
        return
    from oxygen_torch.pool import native

    clock = native.lib().oxygen_set_virtual_clock
    clock(CLOCK_START)
    try:
        yield lambda ns: clock(CLOCK_START + ns)
    finally:
        clock(0)


def replay(ops: list[list], capacity: int, hysteresis_us: int = 0, op_ns: int = 0) -> dict:
    """Replay an alloc/free trace (workloads.trace, or the recorded one) on a host pool, every
    block stamped at its malloc and checked at its free. The pool's figures at the end, with
    `overwritten` (blocks whose content changed) and the mapped bytes after empty_cache().
    hysteresis_us 0: the pool's default (idle pages age by wall time, so the figures depend on
    how fast the replay runs); 1: idle pages go at the next operation, whatever the speed.
    op_ns > 0: the pool's clock is the replay's, op_ns a operation (oxygen_set_virtual_clock):
    the same decisions, so the same figures, on every run."""
    from oxygen_torch.pool import VirtualPool

    with pool_clock(op_ns > 0) as clock, VirtualPool(
        backend="host", capacity=capacity, hysteresis_us=hysteresis_us
    ) as pool:  # fmt: skip
        return _replay(pool, ops, clock, op_ns)


def _replay(pool, ops: list[list], clock, op_ns: int) -> dict:
    bad = 0
    ptrs: dict[int, int] = {}
    for n, (op, size, i, stream) in enumerate(ops, 1):
        if clock is not None:
            clock(n * op_ns)
        if op == "a":
            ptrs[i] = p = pool.malloc(size, stream)
            stamp(p, size, i)
        elif i in ptrs:
            p = ptrs.pop(i)
            bad += not verify(p, size, i)
            pool.free(p, size, stream)
    s = pool.stats()
    for p in ptrs.values():
        pool.free(p)
    pool.empty_cache()
    s["overwritten"] = bad
    s["mapped_after_empty_cache"] = pool.stats()["mapped_bytes"]
    return s


def run(threads: int = 8, ops: int = 200_000, seed: int = 0, live: int = 40, lo: int = 512,
        hi: int = 45 * MiB, capacity: int = 16 << 30, hysteresis_us: int = 0) -> dict:  # fmt: skip
    """One run; the pool's figures at the end, errors (corruption, exceptions) and the mapped
    bytes after empty_cache(). hysteresis_us 0: the pool's default."""
    from oxygen_torch.pool import VirtualPool

    if threads < 1 or ops < 0 or live < 1 or not 0 < lo <= hi:
        raise ValueError(f"need threads >= 1, ops >= 0, live >= 1, 0 < lo <= hi; got "
                         f"{threads}, {ops}, {live}, {lo}, {hi}")  # fmt: skip
    errors: list[str] = []
    with VirtualPool(backend="host", capacity=capacity, hysteresis_us=hysteresis_us) as pool:
        ts = [
            threading.Thread(target=worker, args=(pool, seed * 1000 + k, ops, live, lo, hi, errors))
            for k in range(threads)
        ]
        t0 = time.perf_counter()
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        s = pool.stats()
        pool.empty_cache()
        after = pool.stats()
    return {
        "threads": threads,
        "ops": ops,
        "seed": seed,
        "fragmentation": s["fragmentation"],
        "peak_allocated_MiB": round(s["peak_allocated_bytes"] / MiB, 1),
        "peak_mapped_MiB": round(s["peak_mapped_bytes"] / MiB, 1),
        "allocated_after": after["allocated_bytes"],
        "mapped_after_empty_cache": after["mapped_bytes"],
        "num_bad_frees": s["num_bad_frees"],
        "errors": errors,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def load_trace(path: Path = TRACE) -> tuple[dict, list[list]]:
    """The recorded trace: its JSON header (workload, seconds) and its events."""
    with gzip.open(path, "rt") as f:
        header = json.loads(f.readline())
        return header, [json.loads(line) for line in f]


def paced_replay(ops: list[list], pace_ns: int, hysteresis_ms: float) -> dict:
    """Replay `ops` on a host pool, one event every `pace_ns`: the pool's figures at the end and
    the bytes still mapped 100 ms later."""
    from oxygen_torch.pool import VirtualPool

    with VirtualPool(
        backend="host", capacity=64 * GiB, hysteresis_us=round(hysteresis_ms * 1000)
    ) as pool:
        ptrs: dict[int, int] = {}
        t0 = time.perf_counter_ns()
        for n, (op, size, i, stream) in enumerate(ops):
            due = t0 + n * pace_ns
            while time.perf_counter_ns() < due:  # busy-wait: sleep() is far too coarse
                pass
            if op == "a":
                ptrs[i] = pool.malloc(size, stream)
            elif i in ptrs:
                pool.free(ptrs.pop(i), size, stream)
        s = pool.stats()
        time.sleep(0.1)
        s["mapped_after_100ms"] = pool.stats()["mapped_bytes"]
    return s
