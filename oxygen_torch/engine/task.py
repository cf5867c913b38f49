"""What a generate() call is, for the scheduler: its task tags, set by the caller's context.

    with oxygen_torch.task(priority="high", qos=1.0, name="chat", slo_ms=50):
        out = model.generate(ids, max_new_tokens=256)

The tags live in a ``contextvars.ContextVar``: each thread has its own, and asyncio code that runs
generate() in an executor through ``contextvars.copy_context().run`` (``loop.run_in_executor``
does not copy it; ``asyncio.to_thread`` does) carries the tags of the coroutine that asked.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Any

PRIORITIES = {"high": 2, "normal": 1, "low": 0}  # priority name -> level
QOS_OF_LEVEL = {2: 1.0, 1: 0.5, 0: 0.1}  # the seed's QoS in [0, 1] for each named level


class Cancelled(RuntimeError):
    """A generate() call ended because its task's cancel event was set."""


@dataclass(frozen=True)
class Task:
    """A call's tags: `level` orders preemption (lower goes first), `qos` in [0, 1] enters the
    weight, `slo_ms` is the per-token latency the caller wants (None: none given), `seed` the
    seed of its sampled tokens (None: drawn from torch's global RNG when the call starts),
    `cancel` an event that ends the calls when set (the engine's next step)."""

    name: str = "default"
    level: int = 1
    qos: float = 0.5
    slo_ms: float | None = None
    seed: int | None = None
    cancel: Any = field(default=None, compare=False)

    @property
    def priority_class(self) -> str:
        """The metrics label: 'high' (level 2 and above), 'normal' (1) or 'low' (0 and below):
        a bounded label set, whatever integer levels callers use."""
        return "high" if self.level >= 2 else "normal" if self.level == 1 else "low"


_current: contextvars.ContextVar[Task] = contextvars.ContextVar(
    "oxygen_task",
    default=Task(),  # noqa: B039 - a frozen dataclass
)
_ids = itertools.count(1)


def parse(priority: str | int = "normal", qos: float | None = None, name: str | None = None,
          slo_ms: float | None = None, seed: int | None = None, cancel=None) -> Task:  # fmt: skip
    if isinstance(priority, bool) or not isinstance(priority, (str, int)):
        raise ValueError(
            f"task priority: {priority!r} is not allowed; allowed: high, normal, low, or an "
            "integer level (higher is served first)"
        )
    if isinstance(priority, str):
        if priority not in PRIORITIES:
            raise ValueError(
                f"task priority: {priority!r} is not allowed; allowed: "
                f"{', '.join(PRIORITIES)}, or an integer level"
            )
        level = PRIORITIES[priority]
    else:
        level = priority
    if qos is None:
        qos = QOS_OF_LEVEL.get(level, min(1.0, max(0.05, 0.5 + 0.25 * (level - 1))))
    if isinstance(qos, bool) or not isinstance(qos, (int, float)) or not 0 < qos <= 1:
        raise ValueError(f"task qos: {qos!r} is out of range; allowed: (0, 1]")
    if slo_ms is not None and (
        isinstance(slo_ms, bool) or not isinstance(slo_ms, (int, float)) or not slo_ms > 0
    ):
        raise ValueError(f"task slo_ms: {slo_ms!r} is not allowed; allowed: a number > 0")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 63
    ):
        raise ValueError(f"task seed: {seed!r} is not allowed; allowed: an integer in [0, 2**63)")
    if cancel is not None and not callable(getattr(cancel, "is_set", None)):
        raise ValueError(
            f"task cancel: {cancel!r} is not allowed; allowed: an event (threading.Event)"
        )
    label = name if name is not None else f"task-{next(_ids)}"
    if not isinstance(label, str) or not label:
        raise ValueError(f"task name: {name!r} is not allowed; allowed: a non-empty string")
    slo = None if slo_ms is None else float(slo_ms)
    return Task(label, int(level), float(qos), slo, seed, cancel)


@contextlib.contextmanager
def task(priority: str | int = "normal", qos: float | None = None, name: str | None = None,
         slo_ms: float | None = None, seed: int | None = None, cancel=None):  # fmt: skip
    """Tags the generate() calls made inside: priority "high" / "normal" / "low" or an integer
    level (higher first), qos in (0, 1] (default from the priority), a name (metrics label),
    slo_ms the per-token latency wanted, seed the seed of the calls' sampled tokens (each call
    draws the same tokens for the same seed, whatever else runs beside it), cancel an event
    (threading.Event) that, once set, ends the calls at the engine's next step (they raise
    oxygen_torch.Cancelled; their KV blocks come back). Yields the Task."""
    t = parse(priority, qos, name, slo_ms, seed, cancel)
    token = _current.set(t)
    try:
        yield t
    finally:
        _current.reset(token)


def current() -> Task:
    """The tags of the code running now (Task() when none were set)."""
    return _current.get()
