"""Request traces for the multi-request benchmarks (bench_multitask.py, bench_serve.py).

Arrivals are gamma-distributed (coefficient of variation `cv`: 1 is Poisson, 4 is bursty), a
share `high` of the requests is high priority (the rest low), prompt and output lengths are
log-normal like chat traffic (means about 160 and 340 tokens, capped by `max_prompt` /
`max_new`). The same seed gives the same trace.
"""

from __future__ import annotations

import math
import random
import time


def trace(seed: int, n: int, rate: float, cv: float, high: float, vocab: int,
          max_prompt: int, max_new: int) -> list[dict]:  # fmt: skip
    """n requests: arrival time (s), priority, prompt ids, max_tokens; the same for a seed."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)  # gamma: mean 1/rate, coefficient of variation cv
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
        p = min(max_prompt, max(1, int(rng.lognormvariate(math.log(160) - 0.5, 1.0))))
        new = min(max_new, max(1, int(rng.lognormvariate(math.log(340) - 0.5, 1.0))))
        prio = "high" if rng.random() < high else "low"
        ids = [rng.randrange(1, vocab) for _ in range(p)]
        out.append(dict(at=t, priority=prio, prompt_ids=ids, max_tokens=new))
    return out


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of the values that are not None; nan when there are none."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(q * (len(values) - 1) + 0.5))]


class Clock:
    """A streamer that records when each new token of one request arrives."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt = True

    def put(self, value) -> None:
        if self.prompt:
            self.prompt = False
        else:
            self.times.append(time.monotonic())

    def end(self) -> None:
        pass


class EngineClock(Clock):
    """A Clock run on oxygen's engine thread as each step's tokens are read (the hook `serve`'s
    streams use: `oxygen_engine_thread`, `oxygen_put_ids`): the times a token reached the host,
    with no wake of the calling thread a step (stock transformers calls put() itself)."""

    oxygen_engine_thread = True

    def oxygen_put_ids(self, cols) -> None:
        t = time.monotonic()
        self.times.extend([t] * len(cols))
