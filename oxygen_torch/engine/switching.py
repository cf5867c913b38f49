"""The interpreter's switch interval while engine threads run.

Every torch op called from Python gives the interpreter lock up and takes it back. While another
thread runs Python that does not give it up (a loop of its own, a JSON parse, the user's
post-processing), taking it back waits for that thread's switch interval: 5 ms by default, an
op. An engine step's launch calls 10-20 such ops, so one busy Python thread beside the engine
stretched a decode launch of 0.21 ms to 60-65 ms on the CPU machine (the host path, graph
replays stubbed, 32 rows); with an interval of 1 / 0.5 / 0.2 / 0.1 ms it took 8.6 / 4.0 / 3.0
/ 0.9 ms (benchmarks/history.md, forty-first session).

So while an engine thread runs, the interval is lowered to `scheduler.switch_interval_ms` (when
it is longer), and put back when the last engine thread ends (an idle engine's thread ends after
STOP_AFTER_IDLE_S; disable() ends them all), unless someone set another interval meanwhile. 0
leaves the interval alone. A forked child (no engine thread runs there) gets the interval from
before back.

The cost, and why the default is 2 ms, not 0.1: the threads waiting for the lock take it from
the engine every interval too. A hundred callers woken each step for their streamers are that
many waiters: at 0.1 ms the engine's own Python is cut every 0.1 ms for theirs, and the loaded
arrival trace (600 streaming calls at 100 a second, the CPU machine's model of a GPU host:
`bench_multitask.py --sleep-model 2,0.005 --no-forward`) made 0.55-0.7x the tok/s of the
interpreter's 5 ms; at 2 ms the same as 5 ms (1 ms: ~0.8x). Beside one busy thread, 32 calls at
once made 670 / 373 / 256 / 48 tok/s at 0.1 / 1 / 2 / 5 ms (benchmarks/history.md,
forty-second session): 2 ms keeps most of that gain, not all.
"""

from __future__ import annotations

import os
import sys
import threading

_lock = threading.Lock()
_holders = 0  # engine threads running
_ours: float | None = None  # the interval set here (seconds), while it is in force
_before: float | None = None  # the interval it replaced


def _same(a: float, b: float) -> bool:
    return abs(a - b) < 1e-7  # (the interpreter keeps whole microseconds)


def hold(ms: float) -> None:
    """An engine thread starts: the interval becomes `ms` milliseconds if it is longer."""
    global _holders, _ours, _before
    with _lock:
        _holders += 1
        if ms <= 0:
            return
        want, now = ms / 1000, sys.getswitchinterval()
        if now > want and not _same(now, want):
            if _ours is None or not _same(now, _ours):
                _before = now  # (an interval someone set while ours was in force replaces it)
            _ours = want
            sys.setswitchinterval(want)


def release() -> None:
    """An engine thread ends: the last one puts the interval from before back, unless it was
    changed since it was set here."""
    global _holders, _ours, _before
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders or _ours is None:
            return
        if _same(sys.getswitchinterval(), _ours):
            sys.setswitchinterval(_before)
        _ours = _before = None


def lowered() -> float | None:
    """The interval (seconds) in force from here, or None."""
    return _ours


def _after_fork_in_child() -> None:
    global _lock, _holders, _ours, _before
    _lock = threading.Lock()
    if _ours is not None and _same(sys.getswitchinterval(), _ours):
        sys.setswitchinterval(_before)
    _holders, _ours, _before = 0, None, None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
