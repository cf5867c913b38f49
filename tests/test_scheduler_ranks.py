"""Coordinated steps (engine/scheduler.py with a coordinator, as under tensor parallelism), in one
process: a leader and a follower scheduler, each with its own runner over its own simulated KV
pool, and the same calls made by threads of each "rank" at different times. The follower must run
exactly the leader's steps (the same chunks, in the same order, the same preemptions), every
call must get the same result on both, and a follower missing a call must fail with a message
naming it. The real thing over gloo with a transformers model is tests/test_tp_gloo.py."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest

from oxygen_torch.config import SchedulerConfig
from oxygen_torch.engine import scheduler as sched
from oxygen_torch.engine.scheduler import Chunk, Solo, StepScheduler
from oxygen_torch.engine.task import Task

BT = 4  # tokens a simulated KV block holds


class Link:
    """In-process coordinator pair: what the leader publishes, the follower receives in order."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()

    def side(self, leader: bool):
        link = self

        class Side:
            def __init__(self):
                self.leader = leader

            def publish(self, plan):
                link.q.put(plan)

            def receive(self):
                return link.q.get(timeout=60)

        return Side()


class Work:
    def __init__(self, tokens: int):
        self.tokens, self.done = tokens, 0


class FakeRunner:
    """A runner over a pool of `total` blocks: a call holds ceil(tokens / BT) blocks; a preempted
    call's tokens are recomputed with its next chunk. Logs every step and preemption."""

    def __init__(self, total: int, short_once: bool = False):
        self.total = total
        # short_once: the first look at each step finds its blocks short (as when a step's
        # exact count exceeds its plan's): the real runner serves nothing then
        self.short_once, self._looked = short_once, set()
        self.log: list = []
        self.held: dict = {}  # call key -> tokens whose KV it holds
        self.recompute: dict = {}  # call key -> tokens to recompute

    def plan(self, req, budget: int):
        if isinstance(req.payload, Solo):
            return Chunk(req, 1, 0, 0, "solo")
        w, key = req.payload, req.call.key
        redo = self.recompute.get(key, 0)
        n = max(1, min(w.tokens - w.done, budget - redo))
        have = self.held.get(key, 0)
        blocks = -(-(have + redo + n) // BT) - -(-have // BT)
        return Chunk(req, redo + n, 1, blocks, n)

    def _short(self) -> bool:
        if not self.short_once or len(self.log) in self._looked:
            return False
        self._looked.add(len(self.log))
        return True

    def fits(self, chunks) -> bool:
        return not self._short()

    def run(self, chunks) -> bool:
        if self._short():
            return False
        self.log.append(("step", [(ch.request.call.key, ch.part if ch.part == "solo" else ch.tokens)
                                  for ch in chunks]))  # fmt: skip
        for ch in chunks:
            req, key = ch.request, ch.request.call.key
            if ch.part == "solo":
                req.result, req.done = req.payload.run(), True
                continue
            self.held[key] = self.held.get(key, 0) + ch.tokens
            self.recompute.pop(key, None)
            req.call.preempted = False
            req.payload.done += ch.part
            if req.payload.done == req.payload.tokens:
                req.result, req.done = (key, self.held[key]), True
        return True

    def free_blocks(self) -> int:
        return self.total - sum(-(-t // BT) for t in list(self.held.values()))

    def total_blocks(self) -> int:
        return self.total

    def preempt(self, call) -> int:
        call.swapped = False
        have = self.held.pop(call.key, 0)
        if not have:
            return 0
        self.recompute[call.key] = have
        self.log.append(("preempt", call.key))
        return -(-have // BT)

    def leave(self, key) -> None:
        self.held.pop(key, None)
        self.recompute.pop(key, None)


def calls_of(seed: int) -> dict:
    """thread name -> its calls: (priority, prefill tokens, decode steps, a solo step or not)."""
    r = random.Random(seed)
    return {
        f"t{i}": [
            (r.choice(tuple(LEVEL)), r.randint(3, 20), r.randint(2, 8), r.random() < 0.3)
            for _ in range(r.randint(1, 3))
        ]
        for i in range(5)
    }  # fmt: skip


LEVEL = {"high": 2, "normal": 1, "low": 0}


def rank(scheduler: StepScheduler, runner: FakeRunner, plan: dict, seed: int, out: dict, errs):
    """One rank's threads: each makes its calls, sleeping at random (its own draws) between."""

    def thread(name: str):
        r = random.Random(f"{seed}-{name}")
        try:
            for k, (prio, prefill, steps, solo) in enumerate(plan[name]):
                call = scheduler.enter(Task(name, LEVEL[prio]), key=(name, k))
                try:
                    got = [scheduler.submit(call, Work(prefill))]
                    for s in range(steps):
                        time.sleep(r.random() * 0.002)
                        if solo and s == 1:
                            got.append(scheduler.submit(call, Solo(lambda n=name: ("solo", n))))
                        got.append(scheduler.submit(call, Work(1)))
                    out[(name, k)] = got
                finally:
                    scheduler.leave(call)
                    with scheduler._cond:
                        runner.leave((name, k))
        except BaseException as err:  # noqa: BLE001 - reported to the test
            errs.append(f"{name}: {err!r}")

    threads = [threading.Thread(target=thread, args=(n,), name=n) for n in plan]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("short_once", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_follower_runs_the_leaders_steps_and_preemptions(seed, short_once):
    """short_once: rank 0 finds each step's blocks short at its first look; it publishes only
    steps it can run (one it published and then skipped, the follower ran alone: over gloo the
    ranks' collectives hung, test_tp_gloo)."""
    cfg = SchedulerConfig(gather_ms=1.0, max_step_tokens=24)
    link = Link()
    # 12 blocks of 4 tokens: calls contend
    runners = [FakeRunner(12, short_once), FakeRunner(12)]
    leader = StepScheduler(cfg, runners[0], link.side(True))
    follower = StepScheduler(cfg, runners[1], link.side(False))
    plan = calls_of(seed)
    outs, errs = [{}, {}], []
    threads = rank(leader, runners[0], plan, seed, outs[0], errs)
    time.sleep(0.01 * (seed % 2))  # the follower's threads start later (or not)
    threads += rank(follower, runners[1], plan, seed + 100, outs[1], errs)
    for t in threads:
        t.join(60)
    assert not errs, errs
    assert not any(t.is_alive() for t in threads)
    assert runners[1].log == runners[0].log  # the same steps and preemptions, in order
    assert any(e[0] == "preempt" for e in runners[0].log)  # the pool was short: calls preempted
    assert outs[1] == outs[0] and len(outs[0]) == sum(len(c) for c in plan.values())
    steps = [e[1] for e in runners[0].log if e[0] == "step"]
    assert any(len(s) > 1 for s in steps)  # steps took several calls at once
    solos = [s for s in steps if any(t == "solo" for _, t in s)]
    assert solos and all(len(s) == 1 for s in solos)  # a solo forward is a step of its own
    assert follower.stats.steps == leader.stats.steps
    if short_once:  # (every step was found short once, and run at a later look)
        assert len(runners[0]._looked) >= leader.stats.steps > 0


def test_a_follower_that_lacks_a_call_fails_naming_it(monkeypatch):
    # longer than a loaded CI machine takes to start a thread, well short of the join below
    monkeypatch.setattr(sched, "FOLLOW_TIMEOUT_S", 1.0)
    link = Link()
    runners = [FakeRunner(256), FakeRunner(256)]  # (t0 holds up to 77 blocks)
    cfg = SchedulerConfig(gather_ms=1.0)
    leader = StepScheduler(cfg, runners[0], link.side(True))
    follower = StepScheduler(cfg, runners[1], link.side(False))
    # t0 runs long (300 steps, ~0.3 s) so that a thread of the follower still waits when rank 0
    # names t9, however late the leader's t9 thread starts (a call ended before t9 came, every
    # follower thread gone, would leave no one to receive that step)
    both, only_leader = {"t0": [("normal", 5, 300, False)]}, {"t9": [("normal", 5, 2, False)]}
    outs, errs = [{}, {}], []
    threads = rank(leader, runners[0], {**both, **only_leader}, 0, outs[0], errs)
    threads += rank(follower, runners[1], both, 1, outs[1], errs)
    for t in threads:
        t.join(20)
    assert any("t9" in e and "has not made within 1 s" in e for e in errs), errs


class NeverFits(FakeRunner):
    """Rank 0's runner: a step with call `big` in it never fits its pool (as a count that falls
    short of the step's every time would)."""

    def __init__(self, total: int, big):
        super().__init__(total)
        self.big = big

    def fits(self, chunks) -> bool:
        return all(ch.request.call.key != self.big for ch in chunks)


def test_a_step_that_never_fits_rank_0_fails_its_call_on_every_rank(monkeypatch):
    """Rank 0 publishes only steps its pool holds; one with a call whose blocks it never finds
    fails that call on both ranks after UNFIT_WAIT_S, naming the counts; the other calls (in
    steps without it) finish alike on both ranks."""
    monkeypatch.setattr(sched, "UNFIT_WAIT_S", 0.3)
    link = Link()
    runners = [NeverFits(256, ("t1", 0)), FakeRunner(256)]
    cfg = SchedulerConfig(gather_ms=1.0)
    leader = StepScheduler(cfg, runners[0], link.side(True))
    follower = StepScheduler(cfg, runners[1], link.side(False))
    plan = {"t0": [("normal", 5, 40, False)], "t1": [("normal", 6, 3, False)],
            "t2": [("high", 4, 30, False)]}  # fmt: skip
    outs, errs = [{}, {}], []
    threads = rank(leader, runners[0], plan, 0, outs[0], errs)
    threads += rank(follower, runners[1], plan, 1, outs[1], errs)
    start = time.monotonic()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - start < 20
    failed = sorted(e.split(":")[0] for e in errs)
    assert failed == ["t1", "t1"], errs  # on both ranks, the call alone
    assert all("has not fit rank 0's KV pool for 0.3 s" in e and "KVBudgetError" in e
               for e in errs)  # fmt: skip
    assert set(outs[0]) == set(outs[1]) == {("t0", 0), ("t2", 0)}
    assert outs[0] == outs[1]
    assert runners[1].log == runners[0].log
    assert all(("t1", 0) not in [k for k, _ in e[1]] for e in runners[0].log if e[0] == "step")
