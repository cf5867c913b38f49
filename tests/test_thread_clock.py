"""engine/thread_clock.py: a launch's wall split into the thread's CPU, its OS run-queue wait
and its blocks, read on the thread itself."""

import sys
import threading
import time

import pytest

from oxygen_torch.engine.thread_clock import ThreadClock, spent


def _on_a_thread(fn):
    out = {}

    def run():
        clock = ThreadClock()
        try:
            out["r"] = fn(clock)
        finally:
            clock.close()

    t = threading.Thread(target=run)
    t.start()
    t.join(30)
    assert not t.is_alive()
    return out["r"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread rusage: Linux")
def test_a_blocked_thread_counts_its_blocks_and_little_cpu():
    waits = [threading.Event() for _ in range(5)]

    def setter():
        for e in waits:
            time.sleep(0.02)
            e.set()

    def blocked(clock):
        threading.Thread(target=setter, daemon=True).start()
        a, t = clock.read(), time.perf_counter()
        for e in waits:
            assert e.wait(10)
        return spent(a, clock.read()), time.perf_counter() - t

    (cpu, runq, blocks, preempted), wall = _on_a_thread(blocked)
    assert wall >= 0.09 and cpu < 0.5 * wall
    assert blocks >= len(waits) - 1  # (an event already set when waited for does not block)
    assert preempted >= 0 and (runq is None or 0 <= runq <= wall)


def test_a_busy_thread_is_cpu_and_reads_its_own_clock():
    def busy(clock):
        a, t = clock.read(), time.perf_counter()
        x = 0
        while time.perf_counter() - t < 0.15:
            x += 1
        return spent(a, clock.read()), time.perf_counter() - t

    (cpu, runq, blocks, _), wall = _on_a_thread(busy)
    # on a loaded machine the OS may hold it back: CPU plus run-queue wait make up the wall
    # (run-queue wait unknown where the kernel keeps no schedstats)
    assert cpu + (runq or 0.0) >= 0.5 * wall and cpu <= wall + 0.01
    # the main thread's CPU is not the busy thread's: a clock made here reads this thread
    mine = ThreadClock()
    try:
        before = mine.read()[0]
        time.sleep(0.05)
        assert mine.read()[0] - before < 0.03
    finally:
        mine.close()


def test_a_closed_clock_still_reads_cpu_and_counts():
    clock = ThreadClock()
    clock.close()
    clock.close()  # (twice: nothing)
    cpu, runq, blocks, preempted = clock.read()
    assert cpu >= 0 and runq is None and blocks >= 0 and preempted >= 0
    assert spent((1.0, None, 2, 3), (1.5, 0.2, 5, 3)) == (0.5, None, 3, 0)
    assert spent((1.0, 0.1, 0, 0), (1.5, 0.25, 1, 2))[1] == pytest.approx(0.15)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/thread-self: Linux")
def test_a_reading_keeps_the_interpreter_lock_and_reads_what_os_pread_reads():
    import os

    from oxygen_torch.engine import thread_clock

    assert thread_clock._PREAD is not None  # (glibc has pread: the lock-holding read is used)

    def both(clock):
        if clock._fd is None:
            pytest.skip("no schedstat on this kernel")
        ours = clock._schedstat().split()
        theirs = os.pread(clock._fd, 128, 0).split()
        return ours, theirs

    ours, theirs = _on_a_thread(both)
    assert len(ours) == len(theirs) == 3
    # run-queue wait (ns) and timeslices only grow, and little between two reads
    assert 0 <= int(theirs[1]) - int(ours[1]) < 10**9
    assert 0 <= int(theirs[2]) - int(ours[2]) < 1000
