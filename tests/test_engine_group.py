"""The caller's side of a call's delivery (engine.request.Group): the engine rings, the caller
waits; no ring is lost whatever the interleaving, and a wait with nothing new times out."""

from __future__ import annotations

import random
import threading
import time
from types import SimpleNamespace

import pytest

from oxygen_torch.engine.request import Group


def group(rows: int = 2) -> Group:
    return Group([SimpleNamespace(finished=None) for _ in range(rows)])


def test_a_wait_with_nothing_new_times_out_and_one_after_a_ring_returns_at_once():
    g = group()
    began = time.monotonic()
    assert g.wait(0, 0.05) == 0
    assert time.monotonic() - began >= 0.04
    g.notify()
    began = time.monotonic()
    assert g.wait(0, 5.0) == 1
    assert g.wait(1, 0.0) == 1  # (the ring was taken: nothing new)
    assert time.monotonic() - began < 1.0


def _storm(seed: int, fail: bool):
    """A caller waiting as front.run does (until it has seen the last ring, or the call is
    done), the engine ringing at random pauses, and with `fail` a third thread failing the call
    midway: how long the caller's longest wait took, the versions it saw, the group."""
    rng = random.Random(seed)
    rings = rng.randrange(200, 2000)
    pauses = [rng.choice((0.0, 0.0, 1e-5, 1e-4)) for _ in range(rings)]
    fail_at = rng.randrange(rings)
    g = group(rng.randrange(1, 5))
    seen_versions: list[int] = []
    longest = [0.0]
    ready = threading.Event()

    def caller():
        seen = 0
        while seen < rings and not g.done:
            began = time.monotonic()
            now = g.wait(seen, 30.0)  # a lost ring would leave it here 30 s
            longest[0] = max(longest[0], time.monotonic() - began)
            assert now >= seen
            seen = now
            seen_versions.append(seen)

    def engine():
        for i, pause in enumerate(pauses):
            g.notify()
            if i == fail_at:
                ready.set()
            if pause:
                time.sleep(pause)

    def failing():
        ready.wait(30)
        g.fail(RuntimeError("the engine failed"))

    threads = [
        threading.Thread(target=f)
        for f in ((caller, engine, failing) if fail else (caller, engine))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert seen_versions == sorted(seen_versions)
    return longest[0], seen_versions, g, rings


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_no_ring_is_lost_between_the_engine_and_its_caller(seed):
    longest, seen, g, rings = _storm(seed, fail=False)
    assert longest < 10, f"a ring was lost: the caller slept {longest:.1f} s"
    assert seen[-1] == g.version == rings and g.error is None


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(2)])
def test_a_call_failed_from_another_thread_mid_storm_ends_its_caller(seed):
    longest, seen, g, rings = _storm(seed, fail=True)
    assert longest < 10, f"a ring was lost: the caller slept {longest:.1f} s"
    assert g.done and isinstance(g.error, RuntimeError)
    assert g.version == rings + 1  # every ring and the failure's
    assert g.wait(seen[-1], 5.0) >= seen[-1]  # done: returns at once


def test_a_second_error_does_not_replace_the_first():
    g = group()
    first, second = ValueError("first"), ValueError("second")
    g.fail(first)
    g.fail(second)
    assert g.error is first and g.version == 2
