"""Who is served first in a merged step: FCFS, or weighted fair queuing with the seed's weights.

WFQ counts service per task like a virtual-token counter (VTC): serving `n` tokens of task i
advances its counter by n / W_i, and each step serves the lowest counters first. A task that
joins (or comes back from waiting) starts at the lowest counter of the running ones, so no idle
task banks credit. The weight is the seed's

    W_i = alpha * QoS_i / Latency_i + beta * Tokens_i / CacheSize_i

with QoS in (0, 1] from the task's priority, Latency_i its recent per-token latency and
Tokens_i / CacheSize_i the tokens it holds per KV block. The two terms have different units, so
each is divided by its mean over the live tasks first: W_i is 1 for an average task.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .task import Task


@dataclass
class Account:
    """A live call's service record."""

    task: Task
    arrived: float = field(default_factory=time.monotonic)
    served: int = 0  # tokens computed for it
    vtime: float = 0.0
    latency: float | None = None  # EWMA of seconds between its served steps (per token)
    last_served: float | None = None
    tokens: int = 0  # tokens its cache holds
    blocks: int = 0  # KV blocks its cache holds
    weight: float = 1.0
    share: float = 0.0  # decayed share of recent service (weight balance)


class FCFS:
    """First come, first served: the oldest call's tokens first."""

    name = "fcfs"

    def order(self, accounts: list[Account]) -> list[Account]:
        return sorted(accounts, key=lambda a: a.arrived)

    def charge(self, account: Account, tokens: int) -> None:
        account.served += tokens

    def join(self, account: Account, live: list[Account]) -> None:
        pass


class WFQ:
    """Weighted fair queuing over virtual-token counters (see the module docstring)."""

    name = "wfq"

    def __init__(self, alpha: float = 0.7, beta: float = 0.3):
        self.alpha, self.beta = alpha, beta

    def reweigh(self, live: list[Account]) -> None:
        if not live:
            return
        lat = [a.latency for a in live if a.latency]
        mean_lat = sum(lat) / len(lat) if lat else 1.0
        qos_lat = [a.task.qos / (a.latency or mean_lat) for a in live]
        eff = [a.tokens / a.blocks if a.blocks else 1.0 for a in live]
        mq, me = sum(qos_lat) / len(live), sum(eff) / len(live)
        for a, q, e in zip(live, qos_lat, eff):
            w = self.alpha * (q / mq if mq else 1.0) + self.beta * (e / me if me else 1.0)
            a.weight = max(w, 1e-3)

    def order(self, accounts: list[Account]) -> list[Account]:
        # ties (a fresh start) go to the higher level, then the older call
        return sorted(accounts, key=lambda a: (a.vtime, -a.task.level, a.arrived))

    def charge(self, account: Account, tokens: int) -> None:
        account.served += tokens
        account.vtime += tokens / account.weight

    def join(self, account: Account, live: list[Account]) -> None:
        others = [a.vtime for a in live if a is not account]
        account.vtime = max(account.vtime, min(others)) if others else account.vtime


def make(name: str, alpha: float, beta: float):
    if name == "fcfs":
        return FCFS()
    if name == "wfq":
        return WFQ(alpha, beta)
    raise ValueError(f"scheduler.policy: {name!r} is not allowed; allowed: wfq, fcfs")


def weight_balance(live: list[Account]) -> float | None:
    """The seed's balance figure: each task's share of recent service over its share of the
    weight, averaged (1.0: service follows the weights; healthy 0.9 to 1.1)."""
    total_w = sum(a.weight for a in live)
    total_s = sum(a.share for a in live)
    if not live or total_w <= 0 or total_s <= 0:
        return None
    return sum((a.share / total_s) / (a.weight / total_w) for a in live) / len(live)
