"""The door between callers' Python and the engine threads' launches.

Every op an engine thread launches gives the interpreter lock up and takes it back; while other
threads run Python, taking it back waits up to the interpreter's switch interval an op (5 ms
then; engine/switching.py has lowered it to scheduler.switch_interval_ms since, while engines
run). On the H200, 255 threads resolving their generate() calls stretched the launch of the
engine's first step (a one-row prefill of a few hundred ops) to 1.1-1.7 s. So the Python of the
callers' front door (resolving a call's settings, building its requests) runs through this
door: one caller at a time, and not while an engine launches a step (for up to LAUNCH_WAIT_S of
it, counted from the launch's start). An engine about to launch shuts the door and waits for
the one caller inside (a fraction of a millisecond); callers queue on a condition meanwhile
(asleep: not competing for the lock; woken one at a time, a higher priority level's first: a
high-priority call does not wait behind a burst of low ones). What blocks (a device read of
the call's inputs, the wait for its tokens) stays outside the door, and so does what costs
little (submitting a resolved call's rows, building its output from its tokens: three ops): a
caller that queued again behind hundreds of others for that would hold its rows back from the
engine's next steps, or its output at the end (a thread wake a caller, one after the other).

The wait is counted from the launch's start, not from a caller's arrival: callers that queued
longer than LAUNCH_WAIT_S behind other callers would otherwise pass a launching engine one after
another, and the engine waited at the door until the whole queue had gone through (256 calls at
once on the H200: the first step began 0.3 s into the run).

Callers' other Python (the user's own code around generate()) is not held back: the door only
keeps oxygen's own per-call work out of the engine's launches.

The door also counts the engine calls on their way in (`coming`: from generate()'s start to the
submission of their rows), so that an idle engine can wait for a burst's callers before its
first step (loop.py, `scheduler.burst_gather_ms`): callers still reading their inputs to the host
or checking them are not at the door yet, and counting only those at it let the engine start a
burst with a step of 6 rows while 250 callers were in their first Python (H200, 256 calls).

Only for engines and calls on a GPU: on a CPU a step's ops compute with the interpreter lock
released, callers' Python runs beside them on other cores, and a door would admit one caller a
step (`applies`).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager, nullcontext

import torch

EVERY_DEVICE = False  # tests: the door on CPU engines and calls too
# a caller waits this long at most for an engine's launch to end: a decode launch takes 1-3 ms
# of the host's time, but a launch that blocks on the device must not hold callers back
LAUNCH_WAIT_S = 0.005


class Door:
    def __init__(self, launch_wait_s: float = LAUNCH_WAIT_S):
        lock = self._lock = threading.Lock()
        self._callers = threading.Condition(lock)  # (the lock: arrivals' counts)
        self._engines = threading.Condition(lock)  # engines wait here for the caller inside
        # callers wait by priority level, one condition a level (one woken at a time, the
        # highest level's first): a high-priority call's front door waits for no lower one
        self._levels: dict[int, threading.Condition] = {}
        self._waiting: dict[int, int] = {}  # level -> callers waiting
        self._launching = 0  # engine threads launching a step, or waiting to
        self._inside = False  # a caller's front-door Python runs
        self.queued = 0  # callers at the door: waiting, or inside (read without the lock)
        # engine calls on their way in: from generate()'s start to their rows' submission (the
        # device read of their inputs and the checks before the door included)
        self.coming = 0
        # while engines launch: when callers may come in again (launch_wait_s after the first
        # of them got in; None while they still wait for the caller inside)
        self._open_at: float | None = None
        self.launch_wait_s = launch_wait_s

    def _shut(self) -> bool:
        """(under the lock) Whether a caller must wait."""
        if self._inside:
            return True
        return bool(self._launching) and (self._open_at is None or time.monotonic() < self._open_at)

    def _next(self) -> None:
        """(under the lock) Wakes one waiting caller of the highest level waiting."""
        if self._waiting:
            self._levels[max(self._waiting)].notify()

    @contextmanager
    def caller(self, level: int = 1):
        """A caller's front-door Python: alone, and not during an engine's launch unless that
        launch outlasts `launch_wait_s` (one that waits for the device, say: callers are not
        held for it); callers of a higher priority `level` waiting go first."""
        with self._callers:
            cond = self._levels.get(level)
            if cond is None:
                cond = self._levels[level] = threading.Condition(self._lock)
            self.queued += 1
            self._waiting[level] = self._waiting.get(level, 0) + 1
            try:
                while self._shut() or max(self._waiting) > level:
                    left = None
                    if self._launching and not self._inside and self._open_at is not None:
                        left = self._open_at - time.monotonic()
                    elif not self._shut():
                        self._next()  # (a higher caller waits: it goes first)
                    cond.wait(left)
            except BaseException:  # (interrupted while it waited)
                self.queued -= 1
                self._leave_queue(level)
                self._next()
                raise
            self._leave_queue(level)
            self._inside = True
        try:
            yield
        finally:
            with self._callers:
                self._inside = False
                self.queued -= 1
                self._engines.notify_all()  # (engines waiting to launch: few)
                self._next()  # the next caller (one: hundreds may wait)

    def _leave_queue(self, level: int) -> None:
        n = self._waiting[level] - 1
        if n:
            self._waiting[level] = n
        else:
            del self._waiting[level]

    @contextmanager
    def launch(self):
        """An engine thread's launch of a step: it waits for the caller inside, then callers
        wait until it ends or has run `launch_wait_s` (engines do not wait for each other)."""
        with self._engines:
            self._launching += 1
            while self._inside:
                self._engines.wait()
            if self._open_at is None:
                self._open_at = time.monotonic() + self.launch_wait_s
                self._next()  # one caller times the wait (then wakes the next)
        try:
            yield
        finally:
            with self._engines:
                self._launching -= 1
                if not self._launching:
                    self._open_at = None
                    self._next()

    def arrive(self) -> Arrival:
        """A call on its way to an engine: counted in `coming` until its Arrival leaves."""
        with self._callers:
            self.coming += 1
        return Arrival(self)

    def _reset(self) -> None:
        """After fork: the child's only thread holds nothing (a parent's thread may have held
        the lock at the fork)."""
        self.__init__(self.launch_wait_s)


class Arrival:
    """One call counted in Door.coming; leave() (idempotent) when its rows are submitted or it
    takes another path."""

    __slots__ = ("_door",)

    def __init__(self, door: Door | None):
        self._door = door

    def leave(self) -> None:
        d, self._door = self._door, None
        if d is not None:
            with d._callers:
                d.coming = max(0, d.coming - 1)  # (max: a count reset by a fork)


DOOR = Door()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DOOR._reset)


def applies(device: torch.device) -> bool:
    return device.type == "cuda" or EVERY_DEVICE


def coming(device: torch.device) -> int:
    """Engine calls on their way in (0 where the door does not apply)."""
    return DOOR.coming if applies(device) else 0


def arrive(device: torch.device) -> Arrival:
    """DOOR.arrive() for a call on `device` (counts nothing where the door does not apply)."""
    return DOOR.arrive() if applies(device) else Arrival(None)


def caller(device: torch.device, level: int = 1):
    """DOOR.caller(level) for a call on `device` (a no-op where the door does not apply)."""
    return DOOR.caller(level) if applies(device) else nullcontext()


def launch(device: torch.device):
    """DOOR.launch() for an engine on `device` (a no-op where the door does not apply)."""
    return DOOR.launch() if applies(device) else nullcontext()
