"""The step scheduler's gather deadline on the CPU, without a model: a fake runner whose steps
sleep (the GPU's time, the interpreter lock released) and calls whose own code spins (sampling,
holding the lock), under the rule now and the rule before (gather_ms from the oldest request).

    python benchmarks/sim_gather.py                 # 6 and 16 calls, 0.5-3 ms of host work each

Prints, per case and rule, the steps, rows a step and wall seconds, and the ratio of the walls.
"""

from __future__ import annotations

import argparse
import random
import threading
import time

from oxygen_torch.config import SchedulerConfig
from oxygen_torch.engine import scheduler as sch
from oxygen_torch.engine.task import Task


class Steps:
    """A runner for the step scheduler alone: every request is one token of one row, a step
    sleeps `step_s` plus `row_s` a row; `log` holds each step's call keys, sorted."""

    def __init__(self, step_s: float, row_s: float = 0.0):
        self.step_s, self.row_s, self.log = step_s, row_s, []

    def plan(self, req, budget):
        return sch.Chunk(req, 1, 1, 0, None)

    def run(self, chunks):
        time.sleep(self.step_s + self.row_s * len(chunks))
        self.log.append(sorted(ch.request.call.key for ch in chunks))
        for ch in chunks:
            ch.request.result, ch.request.done = None, True
        return True

    def free_blocks(self):
        return 1 << 20

    def total_blocks(self):
        return 1 << 20

    def preempt(self, call):
        return 0

    def fetch(self, call):
        return False, False


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(calls: int, host_s: float, step_s: float, tokens: int, step_mates: bool) -> tuple:
    sch.GATHER_STEP_MATES = step_mates
    rng = random.Random(0)
    runner = Steps(step_s, row_s=0.0004)
    sched = sch.StepScheduler(SchedulerConfig(gather_ms=5.0), runner)
    live = [sched.enter(Task(), key=i) for i in range(calls)]
    spans = [[host_s * rng.uniform(0.5, 1.5) for _ in range(tokens)] for _ in live]

    def loop(call, span):
        for s in span:
            sched.submit(call, None)
            _spin(s)
        sched.leave(call)

    threads = [threading.Thread(target=loop, args=a) for a in zip(live, spans)]
    start = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    rows = [len(step) for step in runner.log]
    return len(rows), sum(rows) / len(rows), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=25.0)
    ap.add_argument("--tokens", type=int, default=100)
    args = ap.parse_args()
    print("| calls | host ms a call | rule | steps | rows a step | wall s | now / before |")
    print("|---|---|---|---|---|---|---|")
    for calls, host_ms in ((6, 0.5), (6, 1.5), (6, 3.0), (16, 1.0), (16, 3.0)):
        walls = {}
        for rule in (False, True):
            steps, rows, wall = run(calls, host_ms / 1e3, args.step_ms / 1e3, args.tokens, rule)
            walls[rule] = wall
            name = "now" if rule else "before"
            ratio = f"{walls[False] / wall:.2f}x" if rule else ""
            print(f"| {calls} | {host_ms} | {name} | {steps} | {rows:.2f} | {wall:.2f} | {ratio} |")
    sch.GATHER_STEP_MATES = True


if __name__ == "__main__":
    main()
