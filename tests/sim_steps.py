"""A stand-in runner for the step scheduler alone (engine/scheduler.py), no model: every request
is one token of one row, and a step sleeps (the GPU's time, the interpreter lock released).
Shared by tests/test_kv_tier.py and tests/test_engine.py."""

from __future__ import annotations

import time

from oxygen_torch.engine import scheduler as sch


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
