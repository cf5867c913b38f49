"""The door between callers' Python and the engine threads' launches.

Every op an engine thread launches gives the interpreter lock up and takes it back; while other
threads run Python, taking it back waits up to the interpreter's switch interval (5 ms) an op.
On the H200, 255 threads resolving their generate() calls stretched the launch of the engine's
first step (a one-row prefill of a few hundred ops) to 1.1-1.7 s. So the Python of the callers'
front door (resolving a call's settings, building its requests, submitting them; building the
output) runs through this door: one caller at a time, and only while no engine launches a
step. An engine about to launch shuts the door and waits for the one caller inside (a
fraction of a millisecond); callers queue on a condition meanwhile (asleep: not competing for
the lock). What blocks (a device read of the call's inputs, the wait for its tokens) stays
outside the door.

Callers' other Python (the user's own code around generate()) is not held back: the door only
keeps oxygen's own per-call work out of the engine's launches.

Only for engines and calls on a GPU: on a CPU a step's ops compute with the interpreter lock
released, callers' Python runs beside them on other cores, and a door would admit one caller a
step (`applies`).
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager, nullcontext

import torch

EVERY_DEVICE = False  # tests: the door on CPU engines and calls too


class Door:
    def __init__(self):
        self._cond = threading.Condition()
        self._launching = 0  # engine threads launching a step, or waiting to
        self._inside = False  # a caller's front-door Python runs

    @contextmanager
    def caller(self):
        """A caller's front-door Python: alone, and never during an engine's launch."""
        with self._cond:
            while self._launching or self._inside:
                self._cond.wait()
            self._inside = True
        try:
            yield
        finally:
            with self._cond:
                self._inside = False
                self._cond.notify_all()

    @contextmanager
    def launch(self):
        """An engine thread's launch of a step: callers wait until it ends (engines do not
        wait for each other)."""
        with self._cond:
            self._launching += 1
            while self._inside:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._launching -= 1
                if not self._launching:
                    self._cond.notify_all()

    def _reset(self) -> None:
        """After fork: the child's only thread holds nothing (a parent's thread may have held
        the condition's lock at the fork)."""
        self.__init__()


DOOR = Door()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DOOR._reset)


def applies(device: torch.device) -> bool:
    return device.type == "cuda" or EVERY_DEVICE


def caller(device: torch.device):
    """DOOR.caller() for a call on `device` (a no-op where the door does not apply)."""
    return DOOR.caller() if applies(device) else nullcontext()


def launch(device: torch.device):
    """DOOR.launch() for an engine on `device` (a no-op where the door does not apply)."""
    return DOOR.launch() if applies(device) else nullcontext()
