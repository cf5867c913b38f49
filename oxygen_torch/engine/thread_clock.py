"""Where an engine thread's launch time goes when it is not on a CPU.

A launch on the H200's loaded trace took 41 ms of wall for 3.4 ms of the engine thread's CPU
(benchmarks/history.md, forty-fourth session): the rest it waited, and CPU time alone cannot
say for what. Two more readings tell the waits apart (~2.5 µs a reading with the CPU clock's,
two a step):

- the OS run queue: time the thread was runnable but another thread had its core
  (`/proc/thread-self/schedstat`'s second field, Linux with schedstats; None elsewhere);
- the times it blocked (voluntary context switches: a wait for the interpreter lock, a lock,
  a condition, a blocking device sync) and was preempted (involuntary ones), from
  `getrusage(RUSAGE_THREAD)`.

Its wall less its CPU and its run-queue wait is time blocked; that time over its blocks is the
mean block: ~the interpreter's switch interval a block for the lock taken back after torch ops
while other threads run Python, one long block for a sync or a lock held elsewhere.

A `ThreadClock` reads the thread that made it (the schedstat file is that thread's own).
"""

from __future__ import annotations

import ctypes
import os
import time

try:
    import resource

    _RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)
except ImportError:  # (not on Windows)
    resource, _RUSAGE_THREAD = None, None


def _pread_holding_the_lock():
    """libc's pread called with the interpreter lock held (PyDLL), or None. os.pread gives the
    lock up for the read, and a thread that gives it up on a loaded host waits to take it back
    (0.33 ms a block on the H100's loaded trace, 2026-12-07): a reading must not add waits to
    the launch it measures. A read of a /proc file does not block."""
    try:
        fn = ctypes.PyDLL(None).pread
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
    return fn


_PREAD = _pread_holding_the_lock()


class ThreadClock:
    """Readings of the calling thread: (CPU s, run-queue wait s or None, blocks, preemptions)
    (the counts 0 where the platform has no per-thread rusage)."""

    def __init__(self):
        self._fd: int | None = None
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            return
        try:
            _cpu, _wait, *_ = map(int, os.pread(fd, 128, 0).split())
        except (OSError, ValueError):
            os.close(fd)
            return
        self._fd = fd
        self._buf = ctypes.create_string_buffer(128)

    def _schedstat(self) -> bytes:
        if _PREAD is None:
            return os.pread(self._fd, 128, 0)
        n = _PREAD(self._fd, self._buf, 128, 0)
        if n <= 0:
            raise OSError("schedstat read failed")
        return self._buf.raw[:n]

    def read(self) -> tuple[float, float | None, int, int]:
        blocks = preempted = 0
        if _RUSAGE_THREAD is not None:
            r = resource.getrusage(_RUSAGE_THREAD)
            blocks, preempted = r.ru_nvcsw, r.ru_nivcsw
        wait = None
        if self._fd is not None:
            try:
                wait = int(self._schedstat().split()[1]) / 1e9
            except (OSError, ValueError, IndexError):
                self.close()
        # (CPU from the thread's clock, not schedstat's first field: for the running thread
        # itself that lags by the slice in progress, up to a scheduler tick)
        return time.thread_time(), wait, blocks, preempted

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self):
        self.close()


def spent(a: tuple, b: tuple) -> tuple[float, float | None, int, int]:
    """From reading `a` to reading `b`: CPU s, run-queue wait s (None if unknown), blocks,
    preemptions."""
    wait = None if a[1] is None or b[1] is None else b[1] - a[1]
    return b[0] - a[0], wait, b[2] - a[2], b[3] - a[3]
