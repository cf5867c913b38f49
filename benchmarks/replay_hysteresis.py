"""How the idle-page hysteresis changes map churn, fragmentation and memory held, on the CPU.

Replays the allocation trace recorded from a real generate() on the H200
(tests/data/generate_trace.jsonl.gz: 570,442 events, 384 decode steps, 33.7 s) through a host-
backend pool, **paced at the recorded average rate** so the hysteresis sees real time between a
page going idle and its next use. An unpaced replay runs ~35x faster than the GPU did, which
makes any hysteresis look ~35x longer. On the H200 each map costs ~59 us and each unmap ~37 us
(bench_allocator.py), so maps per step translate into host time per decode step.

    python benchmarks/replay_hysteresis.py [hysteresis_ms ...]     # default: 2 20 50
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

from oxygen_torch.pool import VirtualPool

TRACE = Path(__file__).resolve().parent.parent / "tests" / "data" / "generate_trace.jsonl.gz"
GiB = 1 << 30


def load(path: Path) -> tuple[dict, list[list]]:
    with gzip.open(path, "rt") as f:
        header = json.loads(f.readline())
        return header, [json.loads(line) for line in f]


def replay(ops: list[list], pace_ns: int, hysteresis_ms: float) -> dict:
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


def main() -> int:
    header, ops = load(TRACE)
    steps = sum(new for _batch, _prompt, new in header["workload"])
    pace_ns = int(header["seconds"] * 1e9 / len(ops))
    print(f"{len(ops)} events, {steps} decode steps, paced at {pace_ns / 1e3:.1f} us an event")
    print("| hysteresis ms | maps | maps per step | unmaps | fragmentation | mapped at end GiB "
          "| mapped +100 ms GiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for h in [float(x) for x in sys.argv[1:]] or [2.0, 20.0, 50.0]:
        s = replay(ops, pace_ns, h)
        frag = 1 - s["peak_allocated_bytes"] / s["peak_mapped_bytes"]
        print(f"| {h:g} | {s['num_maps']} | {s['num_maps'] / steps:.1f} | {s['num_unmaps']} | "
              f"{frag:.2%} | {s['mapped_bytes'] / GiB:.2f} | {s['mapped_after_100ms'] / GiB:.2f} |",
              flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
