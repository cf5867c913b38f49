"""engine/door.py: callers' front-door Python runs one caller at a time and never while an engine
thread launches a step; an engine about to launch waits for the caller inside, then callers wait
for the launch. Every wait here has a bound (a hang fails the test)."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
import torch
from test_engine import in_threads
from test_engine_loop import ENGINE, call, engines
from test_hf_generate import tiny

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.engine import door as door_mod
from oxygen_torch.engine.door import Door
from oxygen_torch.engine.loop import Engine
from oxygen_torch.integrations.hf import front
from oxygen_torch.integrations.hf import integration as hf


def test_callers_go_one_at_a_time_and_never_during_a_launch():
    d = Door(launch_wait_s=60)  # (no launch here outlasts it)
    state = {"callers": 0, "launches": 0}
    bad, lock = [], threading.Lock()
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,))))
    waits = [rng.uniform(0, 0.002) for _ in range(400)]
    levels = [rng.choice([0, 1, 1, 2, 5]) for _ in range(120)]  # (priorities mixed)

    def caller(i):
        with d.caller(levels[i]):
            with lock:
                state["callers"] += 1
                if state["callers"] > 1 or state["launches"]:
                    bad.append(("caller", dict(state)))
            time.sleep(waits[i])
            with lock:
                state["callers"] -= 1

    def engine(i):
        for j in range(20):
            with d.launch():
                with lock:
                    state["launches"] += 1
                    if state["callers"]:
                        bad.append(("launch", dict(state)))
                time.sleep(waits[(i * 20 + j) % len(waits)])
                with lock:
                    state["launches"] -= 1

    jobs = [(caller, i) for i in range(120)] + [(engine, i) for i in range(3)]
    rng.shuffle(jobs)
    _, errors = in_threads(lambda f, i: f(i), jobs)
    assert not errors and not bad, (errors, bad[:5])


def test_callers_of_a_higher_priority_go_first():
    """A caller inside; 6 callers of levels 0 and 1 queue, then 2 of level 2: once the one
    inside leaves, both level-2 callers pass first, then the level-1 ones, then level 0."""
    d = Door(launch_wait_s=60)
    order, inside, release = [], threading.Event(), threading.Event()

    def first():
        with d.caller(1):
            inside.set()
            release.wait(30)

    def caller(level):
        with d.caller(level):
            order.append(level)
            time.sleep(0.001)

    t0 = threading.Thread(target=first)
    t0.start()
    assert inside.wait(30)
    levels = [0, 1, 0, 1, 0, 1, 2, 2]
    threads = []
    for lv in levels:
        threads.append(threading.Thread(target=caller, args=(lv,)))
        threads[-1].start()
        deadline = time.monotonic() + 10  # each queued before the next comes
        while d.queued < len(threads) + 1 and time.monotonic() < deadline:
            time.sleep(0.001)
    release.set()
    for t in [t0, *threads]:
        t.join(30)
        assert not t.is_alive()
    assert order == sorted(levels, reverse=True), order


def test_a_launch_waits_for_the_caller_inside_then_callers_wait_for_it():
    d = Door(launch_wait_s=60)
    inside, release = threading.Event(), threading.Event()
    order = []

    def first_caller():
        with d.caller():
            inside.set()
            release.wait(5)
            order.append("caller 1 out")

    def engine():
        with d.launch():
            order.append("launch")
            time.sleep(0.05)
            order.append("launch end")

    def second_caller():
        with d.caller():
            order.append("caller 2 in")

    t1 = threading.Thread(target=first_caller)
    t1.start()
    assert inside.wait(5)
    t2 = threading.Thread(target=engine)
    t2.start()
    time.sleep(0.05)  # the engine waits at the door (shut to new callers)
    t3 = threading.Thread(target=second_caller)
    t3.start()
    time.sleep(0.05)
    assert order == []  # neither the launch nor the second caller while the first is inside
    release.set()
    for t in (t1, t2, t3):
        t.join(5)
        assert not t.is_alive()
    assert order == ["caller 1 out", "launch", "launch end", "caller 2 in"]


def test_callers_queued_longer_than_the_wait_do_not_pass_a_launching_engine():
    """Callers that queued past launch_wait_s behind another caller used to count the wait
    from their arrival, and passed a launching engine one after another: the engine got in
    only once the whole queue had gone through (256 calls at once: the first step 0.3 s late).
    The engine gets in as soon as the caller inside leaves; the queued callers go after its
    launch (or launch_wait_s into it)."""
    d = Door(launch_wait_s=0.02)
    inside, release, launched = threading.Event(), threading.Event(), threading.Event()
    order, lock = [], threading.Lock()
    n = int(torch.randint(6, 16, (1,)))

    def first():
        with d.caller():
            inside.set()
            release.wait(5)
            with lock:
                order.append("first")

    def queued(i):
        with d.caller():
            with lock:
                order.append(i)
            time.sleep(0.001)

    def engine():
        with d.launch():
            with lock:
                order.append("launch")
            time.sleep(0.01)  # (shorter than launch_wait_s: no caller may come in meanwhile)
            with lock:
                order.append("launch end")
            launched.set()

    t1 = threading.Thread(target=first)
    t1.start()
    assert inside.wait(5)
    ts = [threading.Thread(target=queued, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    time.sleep(0.1)  # every queued caller has waited 5x launch_wait_s
    te = threading.Thread(target=engine)
    te.start()
    time.sleep(0.02)
    release.set()
    for t in (t1, te, *ts):
        t.join(5)
        assert not t.is_alive()
    assert launched.is_set()
    assert order[:3] == ["first", "launch", "launch end"], order
    assert sorted(order[3:]) == list(range(n))


def test_a_launch_longer_than_the_wait_holds_callers_no_longer():
    """A launch that blocks (on the device, say) lets callers in after launch_wait_s, still one
    at a time."""
    d = Door(launch_wait_s=0.05)
    launched, end = threading.Event(), threading.Event()
    inside, most = [0], [0]
    lock = threading.Lock()

    def engine():
        with d.launch():
            launched.set()
            end.wait(10)

    def caller(_):
        with d.caller():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.005)
            with lock:
                inside[0] -= 1

    t = threading.Thread(target=engine)
    t.start()
    assert launched.wait(5)
    t0 = time.monotonic()
    _, errors = in_threads(caller, [(i,) for i in range(8)])
    took = time.monotonic() - t0
    end.set()
    t.join(5)
    assert not errors and most[0] == 1
    assert 0.05 <= took < 5  # all in while the launch still ran: after the wait, one by one


def test_a_caller_that_raises_inside_leaves_the_door_open():
    d = Door()
    with pytest.raises(ValueError), d.caller():
        raise ValueError("bad call")
    with d.launch():
        pass
    with d.caller():
        pass


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_finds_the_door_open():
    """A parent thread inside the door at the fork: the child's callers still get in."""
    inside, release = threading.Event(), threading.Event()

    def hold():
        with door_mod.DOOR.caller():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: the door must open at once
        ok = threading.Event()

        def enter():
            with door_mod.DOOR.caller():
                ok.set()

        c = threading.Thread(target=enter, daemon=True)
        c.start()
        os._exit(0 if ok.wait(5) else 1)
    release.set()
    t.join(5)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_the_door_is_for_gpus_only():
    """On a CPU the step's ops run with the interpreter lock released, callers beside them."""
    assert door_mod.applies(torch.device("cuda", 0))
    assert not door_mod.applies(torch.device("cpu"))
    d = door_mod.DOOR
    with door_mod.caller(torch.device("cpu")), door_mod.launch(torch.device("cpu")):
        assert not d._inside and not d._launching


def test_the_engine_launches_with_no_callers_python_inside(oxygen, monkeypatch):
    """16 concurrent calls arriving over 0.1 s (the door on the CPU too, as on a GPU): every
    launch finds no caller inside the door, and each call's request building runs with no
    launch under way; tokens equal stock's."""
    monkeypatch.setattr(door_mod, "EVERY_DEVICE", True)
    monkeypatch.setattr(door_mod.DOOR, "launch_wait_s", 60)  # (CPU launches outlast 5 ms)
    model = tiny("llama")
    kws = [call(s) for s in torch.randint(0, 10_000, (16,)).tolist()]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, ENGINE)
    seen = {"launch": [], "requests": []}
    launch, requests = Engine._launch, front._requests
    running = [0]  # launches under way

    def watched_launch(self, rows):
        seen["launch"].append(door_mod.DOOR._inside)
        running[0] += 1
        try:
            return launch(self, rows)
        finally:
            running[0] -= 1

    def watched_requests(*a, **k):
        seen["requests"].append(running[0])
        return requests(*a, **k)

    monkeypatch.setattr(Engine, "_launch", watched_launch)
    monkeypatch.setattr(front, "_requests", watched_requests)

    def run(kw, delay):
        time.sleep(delay)  # (arrivals spread over the first steps' launches)
        with torch.no_grad():
            return model.generate(**kw)

    delays = (torch.rand(len(kws)) * 0.1).tolist()
    out, errors = in_threads(run, list(zip(kws, delays)))
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), f"call {i}"
    assert len(seen["requests"]) == len(kws) and len(seen["launch"]) > 0
    assert not any(seen["launch"]) and not any(seen["requests"])


def test_the_door_counts_its_callers_and_forgets_those_that_leave():
    d = Door(launch_wait_s=60)
    inside, release = threading.Event(), threading.Event()

    def hold():
        with d.caller():
            inside.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(5)
    got = []

    def wait_in_line():
        with d.caller():
            got.append(d.queued)

    line = [threading.Thread(target=wait_in_line) for _ in range(3)]
    for w in line:
        w.start()
    deadline = time.monotonic() + 5
    while d.queued < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert d.queued == 4  # the one inside and three waiting
    release.set()
    for w in [t, *line]:
        w.join(5)
    assert d.queued == 0 and sorted(got) == [1, 2, 3]
    with pytest.raises(ValueError), d.caller():
        raise ValueError("a caller that raises inside")
    assert d.queued == 0


@pytest.mark.parametrize("gather_ms, fills", [(200, False), (0, False), (200, True)])
def test_an_idle_engine_waits_for_callers_at_the_door(oxygen, monkeypatch, gather_ms, fills):
    """Calls on their way in (held there: DOOR.coming) and an idle engine: it waits up to
    scheduler.burst_gather_ms before its first step, not at all with 0, and not when the calls
    in hand already fill a step (kv.prefill_chunk_tokens below the prompt)."""
    monkeypatch.setattr(door_mod, "EVERY_DEVICE", True)
    model = tiny("llama")
    kw = call(7)
    with torch.no_grad():
        ref = model.generate(**kw)
    kv = {"prefill_chunk_tokens": 2} if fills else {}
    hf.apply(model, load_config(scheduler={"engine": True, "burst_gather_ms": gather_ms}, kv=kv))
    with torch.no_grad():
        model.generate(**call(1))  # (the engine exists; idle now)
    (eng,) = engines(model)
    submitted, submit = [], Engine.submit

    def timed_submit(self, group):
        submitted.append(time.perf_counter())
        return submit(self, group)

    monkeypatch.setattr(Engine, "submit", timed_submit)
    monkeypatch.setattr(door_mod.DOOR, "coming", 5)  # calls that never arrive
    n = len(eng.stats.timeline)
    with torch.no_grad():
        got = model.generate(**kw)
    assert torch.equal(got, ref)
    waited = eng.stats.timeline[n][0] - submitted[0]
    if gather_ms and not fills:
        assert waited >= 0.19, waited
        assert eng.snapshot()["burst_waits"] >= 1
    else:
        assert waited < 0.15, waited


def _slow_burst(monkeypatch, gather_ms: float, spacing_s: float):
    """8 calls given at once on an idle engine (the door on this CPU), the i-th of them to
    read its inputs (before the door) taking (i + 1) * spacing_s; each call's tokens checked
    against stock's. Returns (the engine, the calls' rows in the order they came, the engine's
    timeline length and burst_wait_s before the burst; its burst_wait_max_s is the burst's
    longest wait)."""
    monkeypatch.setattr(door_mod, "EVERY_DEVICE", True)
    model = tiny("llama")
    base = int(torch.randint(0, 1000, (1,)))
    kws = [call(base + i) for i in range(8)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, load_config(scheduler={"engine": True, "burst_gather_ms": gather_ms}))
    with torch.no_grad():
        model.generate(**call(1))  # (the engine exists; idle now)
    (eng,) = engines(model)
    read, lock, order = front.read_inputs, threading.Lock(), iter(range(8))
    came: dict[int, int] = {}  # call (by its prompt's ids object) -> its place in the burst

    def slow_read(c):
        with lock:
            i = next(order)
            came[id(c.inputs)] = i
        time.sleep(spacing_s * (i + 1))
        return read(c)

    monkeypatch.setattr(front, "read_inputs", slow_read)
    n, waits = len(eng.stats.timeline), eng.stats.burst_wait_s
    eng.stats.burst_wait_max_s = 0.0

    def run(kw):
        with torch.no_grad():
            return model.generate(**kw)

    out, errors = in_threads(run, [(kw,) for kw in kws])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), f"call {i}"
    by_place = [kw["input_ids"].shape[0]
                for kw in sorted(kws, key=lambda kw: came[id(kw["input_ids"])])]  # fmt: skip
    return eng, by_place, n, waits


def test_a_burst_of_calls_still_reading_their_inputs_shares_the_first_step(oxygen, monkeypatch):
    """8 calls given at once whose way in (the read of their inputs, before the door) takes
    10-80 ms each: an idle engine waits for them (DOOR.coming counts them from generate()'s
    start), so its first step serves all 8 rows, and each call's tokens equal stock's; every
    arrival is counted out again. Counting only the callers at the door, the first step
    served the first caller alone."""
    eng, rows, n, _ = _slow_burst(monkeypatch, gather_ms=1000, spacing_s=0.01)
    assert eng.stats.timeline[n][1] == sum(rows), list(eng.stats.timeline)[n : n + 3]
    assert door_mod.DOOR.coming == 0


@pytest.mark.parametrize("cap", [10, 1])
def test_an_idle_engine_waits_while_a_burst_keeps_passing(oxygen, monkeypatch, cap):
    """8 calls whose way in takes 30, 60 ... 240 ms: each passes well within
    scheduler.burst_gather_ms (100 ms) of the one before, so the idle engine waits for all of
    them and its first step serves every row (a fixed 100 ms wait ended with about four in). The
    wait is bounded: with loop.BURST_CAP 1 it ends 100 ms after it began, with the later calls
    still on their way (the engine may wait again after that step, while the rest pass: the
    longest wait is the bounded one). Tokens equal stock's either way."""
    from oxygen_torch.engine import loop

    monkeypatch.setattr(loop, "BURST_CAP", cap)
    eng, by_place, n, waits = _slow_burst(monkeypatch, gather_ms=100, spacing_s=0.03)
    first = eng.stats.timeline[n][1]
    waited = eng.stats.burst_wait_s - waits
    if cap == 10:
        assert first == sum(by_place), list(eng.stats.timeline)[n : n + 3]
        assert 0.15 < waited < 1.0, waited
    else:
        assert by_place[0] <= first <= sum(by_place[:5]), (first, by_place)
        # (waiting for all of them would take >= 0.21 s: the last passes 0.24 s in, the first
        # 0.03 s; 0.2 leaves a loaded machine's sleeps their slack)
        assert eng.stats.burst_wait_max_s < 0.2, eng.stats.burst_wait_max_s
    assert door_mod.DOOR.coming == 0


def test_a_high_priority_call_in_hand_ends_the_gathering(oxygen, monkeypatch):
    """6 normal calls whose way in takes 30, 60 ... 180 ms and a high-priority one taking 45 ms,
    on an idle engine gathering a burst for up to 1 s: the engine starts once the high call is
    in, not when the burst is all in (its first step has some of the rows, not all); every
    call's tokens equal stock's."""
    monkeypatch.setattr(door_mod, "EVERY_DEVICE", True)
    model = tiny("llama")
    base = int(torch.randint(0, 1000, (1,)))
    kws = [call(base + i) for i in range(7)]  # the last one: high
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, load_config(scheduler={"engine": True, "burst_gather_ms": 1000}))
    with torch.no_grad():
        model.generate(**call(1))  # (the engine exists; idle now)
    (eng,) = engines(model)
    delay = {id(kw["input_ids"]): 0.03 * (i + 1) for i, kw in enumerate(kws[:6])}
    delay[id(kws[6]["input_ids"])] = 0.045
    read = front.read_inputs

    def slow_read(c):
        time.sleep(delay[id(c.inputs)])
        return read(c)

    monkeypatch.setattr(front, "read_inputs", slow_read)
    n = len(eng.stats.timeline)
    eng.stats.burst_wait_max_s = 0.0

    def run(i):
        with oxygen_torch.task(priority="high" if i == 6 else "normal"), torch.no_grad():
            return model.generate(**kws[i])

    out, errors = in_threads(run, [(i,) for i in range(7)])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), f"call {i}"
    first, every = eng.stats.timeline[n][1], sum(kw["input_ids"].shape[0] for kw in kws)
    assert first < every, list(eng.stats.timeline)[n : n + 3]  # (gathered, the first step had all)
    # (the burst all in: 180 ms; the high call in at 45 ms, a loaded machine's slack on top)
    assert eng.stats.burst_wait_max_s < 0.15, eng.stats.burst_wait_max_s
    assert door_mod.DOOR.coming == 0
