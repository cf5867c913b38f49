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


@dataclass
class Histogram:
    bounds: list[float]
    counts: list[int] = field(default_factory=list)  # per bucket, then +Inf (not cumulative)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

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
            }


METRICS = EngineMetrics()
