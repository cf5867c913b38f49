"""Random malloc/free from several threads on one host-backend pool, every block's content checked
before its free: the issue-18 host goal (8 threads x 200,000 operations, no corruption, mapped
bytes back to 0, fragmentation <= 5 %).

Each thread draws sizes log-uniform in [--min, --max] (512 B - 45 MiB: the issue's figure of
11.4 %, reproduced as 13-14 % before small blocks shared pages), frees a random live block with
probability 1/2 or when it holds --live blocks, and stamps every block with a pattern of its own
(whole block when small; when large its ends and one byte per 64 KiB of address: touching
every 4 KiB of a fresh host page costs a page fault) that is verified before the free.
Fragmentation is the pool's own figure: 1 - peak allocated / peak mapped (memory_stats()).

    python benchmarks/host_random.py [--threads 8] [--ops 200000] [--seed 0]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import random
import sys
import threading
import time

import numpy as np

MiB = 1 << 20


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


def replay(ops: list[list], capacity: int, hysteresis_us: int = 0) -> dict:
    """Replay an alloc/free trace (benchmarks/workloads.py, record_trace.py) on a host pool, every
    block stamped at its malloc and checked at its free. The pool's figures at the end, with
    `overwritten` (blocks whose content changed) and the mapped bytes after empty_cache().
    hysteresis_us 0: the pool's default (idle pages age by wall time, so the figures depend on
    how fast the replay runs); 1: idle pages go at the next operation, whatever the speed."""
    from oxygen_torch.pool import VirtualPool

    bad = 0
    with VirtualPool(backend="host", capacity=capacity, hysteresis_us=hysteresis_us) as pool:
        ptrs: dict[int, int] = {}
        for op, size, i, stream in ops:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--ops", type=int, default=200_000, help="operations per thread")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--live", type=int, default=40, help="most live blocks per thread")
    ap.add_argument("--min", type=int, default=512, dest="lo")
    ap.add_argument("--max", type=int, default=45 * MiB, dest="hi")
    args = ap.parse_args()
    worst = 0.0
    for seed in args.seeds:
        r = run(args.threads, args.ops, seed, args.live, args.lo, args.hi)
        worst = max(worst, r["fragmentation"])
        r["errors"] = r["errors"][:5]
        print(json.dumps(r), flush=True)
    print(f"worst fragmentation over {len(args.seeds)} seed(s): {worst:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
