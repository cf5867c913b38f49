"""The engine's figures for the metrics exporter (tools/metrics.py reads `snapshot()`).

Per priority class: time to first token and time per output token histograms. Per step: the
sequences served. Counters: steps, tokens, preemptions. Gauges, read at scrape time from the live
schedulers: queued requests, running / waiting / preempted calls, and the seed's weight-balance
figure (each call's share of recent service over its share of the weight; healthy 0.9-1.1).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from dataclasses import dataclass, field

# seconds: first tokens take a prefill (tens of ms to seconds), later ones a step (ms)
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BUCKETS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0]
BATCH_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
BALANCE_BUCKETS = [0.5, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.5, 2.0]
# seconds: an engine step's wall period, its host work, its GPU work
STEP_BUCKETS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0]


@dataclass
class Histogram:
    bounds: list[float]
    counts: list[int] = field(default_factory=list)  # per bucket, then +Inf (not cumulative)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float, n: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.total += value * n

    def frozen(self) -> tuple[list[float], list[int], float]:
        """(bounds, counts per bucket then +Inf, sum): a copy for a scrape."""
        return list(self.bounds), list(self.counts), self.total


class EngineMetrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.ttft: dict[str, Histogram] = {}
        self.tpot: dict[str, Histogram] = {}
        self.batch = Histogram(BATCH_BUCKETS)
        self.balance = Histogram(BALANCE_BUCKETS)
        self.counters = {"steps": 0, "tokens": 0, "preemptions": 0}
        self._schedulers: weakref.WeakSet = weakref.WeakSet()
        # the engine loop's steps (engine/loop.py): period, host and GPU time, rows and tokens
        self.step_time = {k: Histogram(STEP_BUCKETS) for k in ("period", "host", "gpu")}
        self.step_rows = Histogram(BATCH_BUCKETS)
        self.step_tokens = Histogram([1, 16, 64, 256, 1024, 4096, 8192, 16384])
        self.gpu = {"busy_seconds": 0.0, "idle_seconds": 0.0}  # between back-to-back steps
        self._engines: weakref.WeakSet = weakref.WeakSet()

    def attach_engine(self, engine) -> None:
        """Reports `engine`'s gauges while it lives (its steps report themselves)."""
        with self._lock:
            self._engines.add(engine)

    def engine_step(self, rows: int, tokens: int, period: float | None, host: float,
                    gpu: float | None, idle: float | None) -> None:  # fmt: skip
        """One engine step: its rows and tokens, the time since the step before (None: the
        first after a pause), its host time, and from the GPU's events its time there and the
        GPU's idle time since the step before (None: not measured, e.g. on CPU)."""
        with self._lock:
            self.counters["steps"] += 1
            self.counters["tokens"] += tokens
            self.batch.observe(rows)
            self.step_rows.observe(rows)
            self.step_tokens.observe(tokens)
            self.step_time["host"].observe(host)
            if period is not None:
                self.step_time["period"].observe(period)
            if gpu is not None:
                self.step_time["gpu"].observe(gpu)
                self.gpu["busy_seconds"] += gpu
            if idle is not None:
                self.gpu["idle_seconds"] += idle

    def engine_tokens(self, first: list[tuple[str, float]], gaps: dict[str, int],
                      period: float | None) -> None:  # fmt: skip
        """A step's deliveries: each first token's (class, seconds since its call), and per
        class the rows that got a later token, each `period` after their previous one."""
        with self._lock:
            for label, seconds in first:
                self.ttft.setdefault(label, Histogram(TTFT_BUCKETS)).observe(seconds)
            if period is not None:
                for label, n in gaps.items():
                    self.tpot.setdefault(label, Histogram(TPOT_BUCKETS)).observe(period, n)

    def preempted(self) -> None:
        with self._lock:
            self.counters["preemptions"] += 1

    def attach(self, scheduler) -> None:
        """Counts `scheduler`'s events and reports its gauges while it lives."""
        with self._lock:
            self._schedulers.add(scheduler)
        scheduler.observers.append(self.observe)

    def observe(self, event: str, call=None, **figures) -> None:
        with self._lock:
            if event == "step":
                self.counters["steps"] += 1
                self.counters["tokens"] += figures.get("tokens", 0)
                self.batch.observe(figures.get("rows", 0))
                if figures.get("balance") is not None:
                    self.balance.observe(figures["balance"])
                return
            if event == "preempted":
                self.counters["preemptions"] += 1
                return
            label = call.account.task.priority_class
            into = self.ttft if event == "first_token" else self.tpot
            bounds = TTFT_BUCKETS if event == "first_token" else TPOT_BUCKETS
            # next_token: the time since the call's previous step, which gave each of its rows
            # one token: the time per output token of that call
            into.setdefault(label, Histogram(bounds)).observe(figures["seconds"])

    def snapshot(self) -> dict:
        gauges = {"queued": 0, "running": 0, "waiting": 0, "preempted": 0, "live": 0}
        for sched in list(self._schedulers):
            s = sched.snapshot()
            gauges["live"] += s["live"]
            gauges["queued"] += s["queued"]
            gauges["preempted"] += s["preempted"]
            gauges["running"] += s["live"] - s["queued"]
            gauges["waiting"] += s["queued"]
        for eng in list(self._engines):
            running, waiting = len(eng.running), len(eng.waiting)
            gauges["live"] += running + waiting
            gauges["queued"] += waiting
            gauges["running"] += running
            gauges["waiting"] += waiting
        with self._lock:
            return {
                "ttft": {
                    k: (list(h.bounds), list(h.counts), h.total) for k, h in self.ttft.items()
                },
                "tpot": {
                    k: (list(h.bounds), list(h.counts), h.total) for k, h in self.tpot.items()
                },
                "batch": (list(self.batch.bounds), list(self.batch.counts), self.batch.total),
                "balance": (
                    list(self.balance.bounds),
                    list(self.balance.counts),
                    self.balance.total,
                ),  # fmt: skip
                "counters": dict(self.counters),
                "gauges": gauges,
                "step_time": {k: h.frozen() for k, h in self.step_time.items()},
                "step_rows": self.step_rows.frozen(),
                "step_tokens": self.step_tokens.frozen(),
                "gpu": dict(self.gpu),
            }


METRICS = EngineMetrics()
