"""schedule.choose on a stand-in engine (no model, no KV): who takes a full step's places.

A step full of decoding rows (max_step_seqs) and rows waiting: each waiting row, in the policy's
order, takes the place of the lowest running row below its level (the youngest first), or
waits. The reference below follows that rule one waiting row at a time; choose must pick the
same rows and preempt the same ones, while scanning the running rows only for waiting rows
that may find one below them (hundreds of rows waiting beside 256 running ones made every
waiting row scan every running one: 145 scans a step on the CPU machine's trace)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from oxygen_torch.engine import policy, schedule
from oxygen_torch.engine.request import Request, StopRule
from oxygen_torch.engine.sampling import SamplingParams
from oxygen_torch.engine.task import Task


class Engine:
    """What choose asks of the engine; KV never short, a prefill chunk one block a 16 tokens."""

    def __init__(self, running: list[Request], waiting: list[Request]):
        self.running, self.waiting = running, waiting
        self.policy = policy.FCFS()
        self.cfg = SimpleNamespace(lower_prefill_tokens=0, decode_prefill_tokens=0)
        self.kvs = SimpleNamespace(blocks_for=lambda core, n: -(-n // 16))
        self.preempted: list[Request] = []

    def allowed(self, r):
        return True

    def decode_blocks(self, reqs):
        return [0] * len(reqs)

    def blocks_for(self, r, n):
        return -(-n // 16)

    def total_blocks(self):
        return 1 << 30

    def preempt(self, r):
        self.running.remove(r)
        self.waiting.append(r)
        r.kv = None
        self.preempted.append(r)
        return getattr(r, "held", 0)  # (the blocks it held: set by a test)

    def tokens_fitting(self, r, free, n):
        return min(n, 16 * free)

    def admit(self, r):
        r.kv = object()
        self.waiting.remove(r)
        self.running.append(r)
        return True

    def swapped_blocks(self, r):
        return 0

    def reclaim_kept(self):
        return 0


def _row(level: int, arrived: float, decoding: bool) -> Request:
    r = Request([1] * 20, SamplingParams(), StopRule(max_new=8), Task(level=level))
    r.arrived = arrived
    r.account = policy.Account(r.task, arrived=arrived)
    if decoding:
        r.kv, r.computed, r.sampled, r.out = object(), 20, 1, [5]
    return r


def _expected(running: list[Request], waiting: list[Request]) -> tuple[list, list]:
    """The rule, one waiting row at a time: (the step's rows, the rows preempted, in order)."""
    step, live, gone = list(running), list(running), []
    for w in sorted(waiting, key=lambda r: r.arrived):
        below = [v for v in live if v.task.level < w.task.level]
        if not below:
            continue
        victim = min(below, key=lambda v: (v.task.level, -v.arrived))
        live.remove(victim)
        step.remove(victim)
        gone.append(victim)
        live.append(w)
        step.append(w)
    return step, gone


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_full_steps_places_go_to_the_waiting_rows_above_the_lowest_running_ones(
    seed, monkeypatch
):
    rng = random.Random(seed)
    seats = rng.choice([8, 64, 256])
    levels = [0, 1, 2, 3]
    running = [_row(rng.choice(levels[1:]), float(i), True) for i in range(seats)]
    # mostly waiting rows that find no one below them, a few that do (random levels)
    waiting = [
        _row(rng.choice(levels) if rng.random() < 0.1 else rng.choice([0, 1]), seats + i, False)
        for i in range(rng.randint(20, 300))
    ]
    want_step, want_gone = _expected(running, waiting)
    engine = Engine(list(running), list(waiting))
    scans = []
    real = schedule._make_room
    monkeypatch.setattr(schedule, "_make_room", lambda *a: scans.append(a[1]) or real(*a))
    rows = schedule.choose(engine, schedule.Budget(1 << 20, seats, 1 << 20))
    assert [row.req for row in rows if row.ids is None] == [r for r in want_step if r in running]
    assert sorted(id(row.req) for row in rows) == sorted(id(r) for r in want_step)
    assert engine.preempted == want_gone
    # a running row below it was looked for once a level that found none, not once a row
    found_none = {w.task.level for w in waiting if w not in want_step}
    assert len(scans) <= len(want_gone) + len(found_none), (len(scans), len(waiting))


def test_a_row_that_joins_the_step_at_a_level_that_found_no_place_may_give_its_place():
    """Level 1 found no running row below it (w2 waits); then a higher row's chunk takes two
    places and does not fit the blocks left (h: admitted, no chunk), so a level 0 row joins
    the step (w3): a later level 1 row (w5) finds w3 below it and takes its place, as the
    rule says (the skip of level 1 ends when a row of level 1 or lower joins)."""
    d1 = _row(2, 0.0, True)
    w1, w2, h, w3, w4, w5 = (_row(lv, 1.0 + i, False) for i, lv in enumerate([1, 1, 3, 0, 1, 1]))
    h.prompt = [1] * 1000  # 63 blocks: more than the 10 free, even cut (below)
    engine = Engine([d1], [w1, w2, h, w3, w4, w5])
    engine.tokens_fitting = lambda r, free, n: 0 if r is h else n
    rows = schedule.choose(engine, schedule.Budget(1 << 20, 2, 10))
    assert engine.preempted == [w1, d1, w3]
    assert [row.req for row in rows] == [w4, w5]
    assert h.kv is not None and w2.kv is None


def loaded(rng: random.Random, waiting: int) -> Engine:
    """256 running rows holding blocks, `waiting` rows of random levels and ages, most with no
    one to take the place of or preempt (as young as the youngest running rows or younger, and
    not above them), some above (they do); WFQ's order, not the rows' age
    (benchmarks/bench_choose.py times choose on it)."""
    running = [_row(rng.choice([1, 2]), rng.uniform(0, 100), True) for _ in range(256)]
    for r in running:
        r.held = rng.randint(1, 3)
    rows = [_row(rng.choice([2, 3]) if rng.random() < 0.1 else rng.choice([0, 1]),
                 rng.uniform(90, 150), False) for _ in range(waiting)]  # fmt: skip
    for i, r in enumerate(running + rows):
        r.i = i
        r.account.vtime = rng.uniform(0, 10)
    engine = Engine(running, rows)
    engine.policy = policy.WFQ(0.5, 0.5)
    return engine


def _short_of_kv(seed: int):
    """A loaded engine's step with places for all, KV for a few prompts."""
    rng = random.Random(seed)
    engine = loaded(rng, rng.randint(50, 300))
    return engine, schedule.Budget(1 << 20, 1 << 20, rng.randint(0, 8))


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_rows_short_of_kv_skip_the_look_a_stronger_row_found_nothing_in(seed, monkeypatch):
    """KV short for most waiting rows: a row that a row found with no one to preempt outranks
    or equals takes no look at the running rows either; the step and its preemptions are those
    of a look at every row (the reference: the same choose, each row looking)."""
    real, looks = schedule._victims, []

    def counted(engine, r, budget=None):
        looks.append(budget is None or budget.no_victims is None or r is budget.no_victims)
        return real(engine, r, budget)

    def every_row_looks(engine, r, budget=None):
        return real(engine, r)

    got = {}
    for name, fn in (("ours", counted), ("reference", every_row_looks)):
        monkeypatch.setattr(schedule, "_victims", fn)
        engine, budget = _short_of_kv(seed)
        rows = schedule.choose(engine, budget)
        got[name] = ([(row.req.i, row.n) for row in rows], [r.i for r in engine.preempted])
    assert got["ours"] == got["reference"]
    assert got["ours"][1], "the case preempts no row: it tests nothing"
    asked = len(looks)
    assert asked > 20 and sum(looks) < asked / 2, (sum(looks), asked)
