"""Our compiles and the engines' forwards, kept apart.

While torch.compile traces a model, torch.fx replaces ``torch.nn.Module.__call__`` for the
whole process (its patcher), so a forward that another thread runs meanwhile is traced into the
compile and fails ("Detected that you are using FX to symbolically trace a dynamo-optimized
function"): on the H200 an engine's step failed, and took its calls with it, while a per-call
``generate()`` (a cache passed in) compiled its decode graph on another thread. So the compiles
oxygen starts itself (a decode graph's fusion, integrations/hf/graphs.py) hold this guard
alone, and every engine step (its eager forward, or its graph's capture or replay) holds it
shared with the other engines' steps. A compile that waits holds new steps back (it waits for
the steps in flight only: a launch of a few milliseconds), and the steps wait for the compile
(seconds, once a shape).

A user's own ``torch.compile`` in another thread is outside this guard: torch does not support
tracing beside other threads' forwards.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager


class TraceGuard:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._steps = 0  # steps in flight (shared holders)
        self._owner: int | None = None  # the thread that compiles
        self._depth = 0  # its nesting
        self._waiting = 0  # compiles waiting for the steps in flight
        self._mine = threading.local()  # .steps: steps this thread holds

    @contextmanager
    def step(self):
        """An engine's step (shared with other steps; not beside a compile). Within a compile
        of this very thread it passes (the compile's own warm-up runs steps)."""
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                own = True
            else:
                own = False
                while self._owner is not None or self._waiting:
                    self._cond.wait()
                self._steps += 1
        self._mine.steps = getattr(self._mine, "steps", 0) + 1
        try:
            yield
        finally:
            self._mine.steps -= 1
            if not own:
                with self._cond:
                    self._steps -= 1
                    if not self._steps:
                        self._cond.notify_all()

    @contextmanager
    def compile(self):
        """A compile (alone: no step and no other compile runs); re-entrant on its thread."""
        me = threading.get_ident()
        if getattr(self._mine, "steps", 0) and self._owner != me:
            # it would wait for its own step: a deadlock, not a wait
            raise RuntimeError("oxygen_torch: a compile inside an engine step (trace_guard.py)")
        with self._cond:
            if self._owner == me:
                self._depth += 1
            else:
                self._waiting += 1
                try:
                    while self._owner is not None or self._steps:
                        self._cond.wait()
                finally:
                    self._waiting -= 1
                self._owner, self._depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._cond.notify_all()

    def _reset(self) -> None:
        """After fork: the child's one thread holds nothing."""
        self.__init__()


GUARD = TraceGuard()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=GUARD._reset)
