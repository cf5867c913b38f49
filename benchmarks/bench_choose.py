"""The engine's choosing of a step's rows (schedule.choose) on a loaded engine, host only.

A stand-in engine (tests/test_schedule_choose.py's: no model, no KV) with 256 running rows and
hundreds waiting, two cases:

- `places`: the step's places all taken (scheduler.max_step_seqs) by decoding rows, most rows
  waiting below them, a tenth above (each takes a lower row's place);
- `kv`: places for all, KV short: most waiting rows have no one to preempt, a tenth do.

Ours: choose as the engine runs it (a waiting row skips the look for a row below it, or for
one it may preempt for KV, once a row it does not outrank found none). Anchor, same run: the
same choose with every waiting row looking at every running row. Median of `--reps` fresh
states a case (CPU; the figures are the host's Python, the same on a GPU machine's host).

    python benchmarks/bench_choose.py [--waiting 300] [--reps 9]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_schedule_choose import loaded  # noqa: E402  (the stand-in engine)

from oxygen_torch.engine import schedule  # noqa: E402


def state(case: str, seed: int, waiting: int):
    rng = random.Random(seed)
    engine = loaded(rng, waiting)
    if case == "places":
        return engine, schedule.Budget(1 << 20, 256, 1 << 20)
    return engine, schedule.Budget(1 << 20, 1 << 20, rng.randint(0, 8))


def timed(case: str, waiting: int, reps: int, every_row_looks: bool) -> tuple[float, int]:
    real_victims, real_room = schedule._victims, schedule._make_room
    patches = []
    if every_row_looks:
        patches = [
            mock.patch.object(schedule, "_victims", lambda e, r, b=None: real_victims(e, r)),
            mock.patch.object(schedule, "_make_room", lambda *a: real_room(*a) or False),
        ]
    for p in patches:
        p.start()
    try:
        ms, preempted = [], 0
        for seed in range(reps):
            engine, budget = state(case, seed, waiting)
            t = time.perf_counter()
            schedule.choose(engine, budget)
            ms.append(1e3 * (time.perf_counter() - t))
            preempted += len(engine.preempted)
        return statistics.median(ms), preempted
    finally:
        for p in patches:
            p.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--waiting", type=int, default=300, help="rows waiting (default 300)")
    ap.add_argument("--reps", type=int, default=9, help="fresh states a case (default 9)")
    args = ap.parse_args()
    print("| case | ours ms | every row looks ms | ratio | rows preempted (ours / anchor) |")
    print("|---|---|---|---|---|")
    for case in ("places", "kv"):
        ours, got = timed(case, args.waiting, args.reps, False)
        anchor, want = timed(case, args.waiting, args.reps, True)
        print(f"| {case} (256 running, {args.waiting} waiting) | {ours:.2f} | {anchor:.2f} | "
              f"{ours / anchor:.2f}x | {got} / {want} |")  # fmt: skip


if __name__ == "__main__":
    main()
