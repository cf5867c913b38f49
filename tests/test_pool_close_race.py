"""close() while other threads use the object (issue 31): a VirtualPool closed while threads
malloc and free, an Arena closed while threads map and unmap. Before the fix the native object
was freed under the calls in flight: a segfault, or glibc's "double free or corruption". Now a
call in flight finishes on the live object, the release follows it, and every call that starts
after close() raises RuntimeError.

The trials run in a child interpreter, so that a crash fails the test instead of killing pytest.
"""

import subprocess
import sys
import time

import pytest

TRIALS = 100
THREADS = 3
BOUND_S = 120.0  # ~5 s for 100 trials on a loaded 2-core machine; this only catches a hang

TRIAL_SCRIPT = r"""
import random, sys, threading
from oxygen_torch.pool import Arena, VirtualPool

MiB = 1 << 20
kind, backend, trials, nthreads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def make():
    if kind == "pool":
        return VirtualPool(backend=backend, capacity=64 * MiB, hysteresis_us=50)
    return Arena(8 * nthreads * 2 * MiB, backend=backend)


def churn(obj, me, started, ended):
    # Each thread keeps to its own blocks (pool) or pages (arena), so that every error it can
    # meet is one of close(): at most 4 live blocks of <= 3 MiB a thread, never out of memory.
    rng = random.Random(me)
    live, calls = [], 0
    try:
        while True:
            if kind == "pool":
                if len(live) > 3 or (live and rng.random() < 0.5):
                    ptr = live.pop(rng.randrange(len(live)))
                    if not obj.free(ptr):
                        ended[me] = "free of a live block refused"
                        return
                else:
                    live.append(obj.malloc(rng.choice([512, 70_000, 3 * MiB])))
            else:
                page = me + nthreads * rng.randrange(8)
                if obj.is_mapped(page):
                    obj.unmap_pages(page)
                else:
                    obj.map_pages(page)
                    obj.mapped_pages()
            calls += 1
            if calls == 8:
                started.release()
    except RuntimeError as exc:
        ended[me] = "closed" if "is closed" in str(exc) else repr(exc)
        if calls < 8:
            started.release()
    except BaseException as exc:
        ended[me] = repr(exc)
        started.release()


for trial in range(trials):
    obj = make()
    started, ended = threading.Semaphore(0), {}
    threads = [
        threading.Thread(target=churn, args=(obj, me, started, ended)) for me in range(nthreads)
    ]
    for t in threads:
        t.start()
    for _ in threads:  # every thread is calling when close() comes
        started.acquire()
    obj.close()
    for t in threads:
        t.join()
    wrong = {me: how for me, how in ended.items() if how != "closed"}
    if len(ended) != nthreads or wrong:
        print(f"trial {trial}: threads ended {ended}")
        sys.exit(1)
    late = [("malloc", 0), ("free", 4096)] if kind == "pool" else [("map_pages", 0)]
    for name, *args in late + [("stats",)]:
        try:
            getattr(obj, name)(*args)
            print(f"trial {trial}: {name} after close() did not raise")
            sys.exit(1)
        except RuntimeError as exc:
            if "is closed" not in str(exc):
                print(f"trial {trial}: {name} after close(): {exc!r}")
                sys.exit(1)
print(f"ok {trials}")
"""


@pytest.mark.parametrize("backend", ["host", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["pool", "arena"])
def test_close_while_other_threads_call_never_crashes(kind, backend):
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", TRIAL_SCRIPT, kind, backend, str(TRIALS), str(THREADS)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    out = r.stdout + r.stderr[-3000:]
    assert r.returncode == 0, f"exit {r.returncode} (-11: segfault, -6: abort): {out}"
    assert f"ok {TRIALS}" in r.stdout, out
    print(f"{kind} ({backend}): {TRIALS} trials in {time.monotonic() - t0:.1f} s")
