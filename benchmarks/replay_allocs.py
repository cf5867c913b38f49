"""Replay a recorded allocation trace on the host backend: what the pool's placement and
hysteresis make of a real workload, on a CPU.

A trace comes from `bench_multitask.py --at-once ... --torch-allocator --record-allocs` on the
H200 (PyTorch's memory history of the model's build, the warm-up and the timed run, as
`["a" | "f", size, id, stream, ns]` lines after a JSON header) or is the committed
tests/data/generate_trace.jsonl.gz (no times: paced evenly at its recorded average rate, its
header's seconds over its events). Each event is replayed at its recorded time on the pool's own
clock (`oxygen_set_virtual_clock`: hysteresis and the pool's other time-based rules read the
trace's time, so a replay makes the same decisions, and gives the same figures, on every machine
and run, loaded or not); `--wall-clock` paces it on the real clock instead (busy-waiting; the
figures then move with the machine's load). `--speed` scales the clock. A host pool whose page
size and hysteresis are the pool's defaults unless given. "Mapped after 100 ms": on the replay's
clock, 100 ms after the last event, one 512-byte malloc and free let the pool sweep (as its
background thread would).

Prints, for the whole trace and for its timed run: allocations, pages mapped and unmapped, the
peak mapped and allocated bytes (fragmentation), and which allocation sizes caused the maps
(by power-of-two class): where the H200's map time goes.

    python benchmarks/replay_allocs.py allocs_one_call_k256_s0.jsonl.gz
    python benchmarks/replay_allocs.py TRACE --hysteresis-ms 20 200
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from collections import Counter
from pathlib import Path

from host_random import pool_clock  # (this folder)

MiB = 1 << 20
GiB = 1 << 30


def load(path: Path) -> tuple[dict, list[list]]:
    with gzip.open(path, "rt") as f:
        head = json.loads(f.readline())
        return head, [json.loads(line) for line in f]


def _cls(size: int) -> str:
    b = max(size, 1).bit_length() - 1
    return f"{(1 << b) / MiB:g} MiB" if b >= 20 else f"{(1 << b) >> 10} KiB"


def replay(ops: list[list], hysteresis_ms: float, speed: float, timed_from: int | None,
           even_ns: int = 2000, lend: bool = True, wall: bool = False) -> dict:  # fmt: skip
    with pool_clock(not wall) as clock:
        return _replay(ops, hysteresis_ms, speed, timed_from, even_ns, lend, clock)


def _replay(ops, hysteresis_ms, speed, timed_from, even_ns, lend, clock) -> dict:
    from oxygen_torch.pool import VirtualPool

    cause: Counter = Counter()
    out = {}
    with VirtualPool(backend="host", capacity=128 * GiB,
                     hysteresis_us=max(1, round(hysteresis_ms * 1000)),
                     lend_idle=lend) as pool:  # fmt: skip
        ptrs: dict[int, int] = {}
        t0 = time.perf_counter_ns()
        first = ops[0][4] if ops and len(ops[0]) > 4 else 0
        mark, at = None, 0
        for n, op in enumerate(ops):
            kind, size, i, stream = op[:4]
            at = round((op[4] - first) / speed) if len(op) > 4 else n * even_ns
            if clock is not None:
                clock(at)
            else:
                while time.perf_counter_ns() < t0 + at:  # busy-wait: sleep() is far too coarse
                    pass
            if n == timed_from:
                mark = pool.stats()
                pool.reset_peak()
            if kind == "a":
                before = pool._raw()["num_maps"]
                ptrs[i] = pool.malloc(size, stream)
                maps = pool._raw()["num_maps"] - before
                if maps and (timed_from is None or n >= timed_from):
                    cause[_cls(size)] += maps
            elif i in ptrs:
                pool.free(ptrs.pop(i), size, stream)
        end = pool.stats()
        if clock is not None:
            clock(at + 100_000_000)
            pool.free(pool.malloc(512))
        else:
            time.sleep(0.1)
        after = pool.stats()
    base = mark or {k: 0 for k in end}
    for k in ("num_allocs", "num_maps", "num_unmaps"):
        out[k] = end[k] - base.get(k, 0)
    out["peak_mapped_GiB"] = round(end["peak_mapped_bytes"] / GiB, 3)
    out["peak_allocated_GiB"] = round(end["peak_allocated_bytes"] / GiB, 3)
    out["fragmentation"] = round(end["fragmentation"], 4)
    out["mapped_after_100ms_GiB"] = round(after["mapped_bytes"] / GiB, 3)
    out["maps_by_size"] = dict(cause.most_common(12))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--hysteresis-ms", type=float, nargs="*", default=[20.0])
    ap.add_argument("--speed", type=float, default=1.0, help="replay clock / recorded clock")
    ap.add_argument("--whole", action="store_true", help="figures of the whole trace, not the "
                    "timed run's")  # fmt: skip
    ap.add_argument("--no-lend", action="store_true", help="pool.lend_idle_pages false")
    ap.add_argument("--wall-clock", action="store_true",
                    help="pace the replay on the real clock, not the pool's own (figures then "
                         "depend on the machine's load)")  # fmt: skip
    args = ap.parse_args()
    head, ops = load(args.trace)
    timed = None if args.whole else head.get("timed_from")
    print(json.dumps({k: v for k, v in head.items() if k != "workload"}))
    for h in args.hysteresis_ms:
        even = round(1e9 * head["seconds"] / head["events"]) if "seconds" in head else 2000
        r = replay(ops, h, args.speed, timed, even_ns=even, lend=not args.no_lend,
                   wall=args.wall_clock)  # fmt: skip
        how = dict(hysteresis_ms=h, lend=not args.no_lend)
        how["clock"] = "wall" if args.wall_clock else "trace"
        print(json.dumps(dict(**how, **r)), flush=True)


if __name__ == "__main__":
    main()
