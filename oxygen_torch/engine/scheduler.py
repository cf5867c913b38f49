"""The step scheduler: the forwards of concurrent generate() calls, merged step by step.

Each live call registers (``enter``), and every forward it makes on the paged cache becomes a
request (``submit``) that blocks its thread until the request is done. There is no scheduler
thread: when the calls being waited for have all submitted (or the oldest request has waited
``scheduler.gather_ms``), one of the waiting threads leads the step: the policy orders the queued
requests, the step takes them in that order within ``max_step_tokens`` and ``max_step_seqs`` and
the free KV blocks (a long prefill is cut into chunks that fit, mixed with the others' decode
tokens), and the runner (the integration) runs them as one forward. Everything else a call does
(sampling, processors, stopping, streamers) stays in its own thread.

When KV blocks are short a request waits (its generate() takes longer); to make room for a
request, calls of a lower priority level (or of the same level, younger) that are waiting in
``submit`` are preempted: their KV is freed and recomputed at their next step. A call that
stops submitting is waited for at most ``gather_ms`` once, then marked late: steps go on without
it until it submits again. A call that raises leaves at its generate()'s end (``leave``).

Under tensor parallelism every rank runs the same forwards in the same order (their collectives
pair up), so the steps are agreed (a ``coordinator``, engine/rank_plan.py): rank 0's scheduler
chooses each step as above and publishes it (its preemptions, its errors, and each chunk as the
call's key and the token budget it was planned with), only a step whose KV blocks its own pool
holds now (``Runner.fits``); the other ranks choose nothing: one of their waiting threads receives
the plan, waits until every call it names has submitted, and runs the same step (a rank short of
the step's blocks, its finished calls' caches not yet collected, waits for them). A call's key
names it on every rank (the integration's: its thread and the count of that thread's calls). A
forward the merge cannot take is a step of its own there (a ``Solo``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..config import SchedulerConfig
from . import policy as policies
from .policy import Account
from .stats import METRICS
from .task import Task

log = logging.getLogger("oxygen_torch")

# rank 0 publishes only steps its own pool holds (Runner.fits); a step it chose that has not fit
# for this long fails its calls (on every rank) instead of holding them forever
UNFIT_WAIT_S = 30.0
FOLLOW_TIMEOUT_S = 300.0  # a coordinated rank waits this long for the calls rank 0's step names
# A thread waiting in submit() is woken by a notify (a submit, a leave, a step's end) or by the
# gather deadline; this is only the longest it sleeps between two looks (no wake-up is lost by
# design: 64 threads polling every gather_ms / 4 cost the host more than their steps did)
IDLE_WAIT_S = 0.05


class KVBudgetError(RuntimeError):
    """A request needs more KV blocks than the whole pool holds."""


@dataclass
class Call:
    """A live generate() call."""

    account: Account
    queued: Request | None = None
    late: bool = False  # missed a step while in its own code: not waited for until it submits
    preempted: bool = False  # its KV was freed; its next step recomputes it
    swapped: bool = False  # (set by the runner's preempt) its KV went to the CPU tier instead
    sat_out: int = 0  # steps in a row it sat out while its KV came back ahead (runner.fetch)
    state: Any = None  # the runner's per-call data
    first_done: float | None = None  # when its first request (the prefill) completed
    last_done: float | None = None
    key: Any = None  # the call's name on every rank (coordinated steps only)


@dataclass
class Request:
    """One forward a call asked for; a long prefill is served over several steps."""

    call: Call
    payload: Any  # the runner's
    arrived: float = field(default_factory=time.monotonic)
    taken: bool = False  # in the step that is running
    done: bool = False
    result: Any = None
    error: BaseException | None = None


@dataclass
class Chunk:
    """What of a request one step serves: `tokens` computed, `rows` sequences, `blocks` new KV
    blocks; `part` is the runner's description of it."""

    request: Request
    tokens: int
    rows: int
    blocks: int
    part: Any = None
    budget: int = 0  # the token budget it was planned with (what another rank plans it with)


@dataclass
class Solo:
    """A forward the merge cannot take, run as it is (`run()`), alone in a step of its own:
    under coordinated steps every forward of a registered call goes through the scheduler."""

    run: Any


class Runner(Protocol):
    def plan(self, request: Request, budget: int) -> Chunk | None: ...
    def run(self, chunks: list[Chunk]) -> bool: ...  # False: nothing served, ask again
    # coordinated: whether the step's KV blocks are free now (rank 0 publishes no other step)
    def fits(self, chunks: list[Chunk]) -> bool: ...
    def free_blocks(self) -> int: ...
    def total_blocks(self) -> int: ...
    def preempt(self, call: Call) -> int: ...
    # a chosen call: (a swap-in ahead of its step started, it sits this step out)
    def fetch(self, call: Call) -> tuple[bool, bool]: ...


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0
    swaps: int = 0  # preemptions that moved the KV to the CPU tier (no recompute)
    swaps_ahead: int = 0  # swap-ins started when the step chose the call, not waited for there
    sat_out: int = 0  # steps a chosen call left to the others while its KV was still coming up
    batch_sizes: list[int] = field(default_factory=list)  # sequences per step, the last 1024


class Coordinator(Protocol):
    leader: bool  # chooses the steps (rank 0); the others follow

    def publish(self, plan: dict) -> None: ...
    def receive(self) -> dict: ...


class StepScheduler:
    def __init__(
        self, cfg: SchedulerConfig, runner: Runner, coordinator: Coordinator | None = None
    ):
        self.cfg = cfg
        self.runner = runner
        self.coordinator = coordinator
        self._told: dict = {}  # what the step being chosen did, for the other ranks
        self._ended = 0.0  # when the last step ended (time.monotonic())
        self._step_s = 0.0  # how long a step takes (a moving average of the runner's run)
        self.policy = policies.make(cfg.policy, cfg.alpha, cfg.beta)
        self._cond = threading.Condition()
        self._calls: list[Call] = []
        self._stepping = False
        self._unfit_since: float | None = None  # rank 0: since when its chosen steps do not fit
        self.stats = StepStats()
        self.observers: list = []  # callables(event, call, **figures): metrics
        METRICS.attach(self)

    # --- calls -----------------------------------------------------------------------------------

    def enter(self, task: Task, state: Any = None, key: Any = None) -> Call:
        call = Call(Account(task), state=state, key=key)
        with self._cond:
            self.policy.join(call.account, [c.account for c in self._calls])
            self._calls.append(call)
            self._cond.notify_all()
        return call

    def leave(self, call: Call) -> None:
        with self._cond:
            if call in self._calls:
                self._calls.remove(call)
            self._cond.notify_all()

    def live(self) -> int:
        return len(self._calls)

    def calls(self) -> list[Call]:
        """The live calls (a copy)."""
        with self._cond:
            return list(self._calls)

    def snapshot(self) -> dict:
        """Queue depth, running / waiting / preempted calls, the weight balance."""
        with self._cond:
            accounts = [c.account for c in self._calls]
            return {
                "live": len(self._calls),
                "queued": sum(c.queued is not None for c in self._calls),
                "preempted": sum(c.preempted for c in self._calls),
                "late": sum(c.late for c in self._calls),
                "weight_balance": policies.weight_balance(accounts),
                "steps": self.stats.steps,
                "preemptions": self.stats.preemptions,
                "swaps": self.stats.swaps,
                "swaps_ahead": self.stats.swaps_ahead,
                "sat_out": self.stats.sat_out,
            }

    # --- requests ---------------------------------------------------------------------------------

    def submit(self, call: Call, payload: Any) -> Any:
        """Blocks until the runner has served `payload` (one forward of `call`); its result."""
        req = Request(call, payload)
        with self._cond:
            call.queued, call.late = req, False
            # No notify: this thread looks itself, right below, at what a submit can change (a
            # step now due, a waiting call to preempt), and a woken thread would only look again
            # (64 threads woken at every submit cost the host more than the steps did). A
            # coordinated follower waits for submits (_awaited): it is woken.
            if self.coordinator is not None:
                self._cond.notify_all()
            served = False
            try:
                while not req.done:
                    if self._stepping:  # its end notifies
                        self._cond.wait(IDLE_WAIT_S)
                        continue
                    if self.coordinator is not None and not self.coordinator.leader:
                        self._follow()
                        continue
                    due = self._step_due()
                    if due > 0:  # a submit, a leave, or the gather deadline
                        self._cond.wait(due)
                    elif not self._step():
                        # nothing fits (the KV a request needs is held by a call still in its
                        # own code): wait for a submit, a leave or a step, lock released
                        self._cond.wait(IDLE_WAIT_S)
                served = True
            finally:
                if call.queued is req:
                    call.queued = None
                if not served:  # a step that raised in this thread: the others look again
                    self._cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.result

    def _step_due(self) -> float:
        """0 when a step should start now: a request is queued and every call is either
        waiting in submit or marked late, or the gather deadline has passed (the calls still
        awaited are then marked late). Else the seconds until that deadline (IDLE_WAIT_S when
        nothing is queued).

        The deadline is gather_ms after the latest submit, and at most a step's time (a moving
        average, or gather_ms if longer) after the first, each counted from the last step's end
        at the earliest. So a step waits for the calls of the last one while they keep coming
        back from their own code (sampling, one thread after the other under the interpreter
        lock), and a request that came while a step ran (its call was left out, sat the step
        out, or was late) waits for them too. Counted from that request's arrival, the deadline
        would make the next step due at once, run it alone while the others sample, and keep
        the calls in two phases a step apart from then on: twice the steps, half the rows each.
        Waiting longer than a step would cost more than a step of the latecomers alone."""
        queued = [c for c in self._calls if self._waiting(c)]
        if not queued:
            return IDLE_WAIT_S
        awaited = [c for c in self._calls if (c.queued is None or c.queued.done) and not c.late]
        if not awaited:
            return 0.0
        gather = self.cfg.gather_ms / 1000
        arrived = [max(c.queued.arrived, self._ended) for c in queued]
        longest = min(arrived) + max(gather, self._step_s)
        left = min(max(arrived) + gather, longest) - time.monotonic()
        if left <= 0:
            for c in awaited:  # steps go on without them until they submit again
                c.late = True
            return 0.0
        return max(left, 1e-4)

    @staticmethod
    def _waiting(call: Call) -> bool:
        """Its request is queued, not in the running step, not already served (a served call
        may not have woken up yet to take its result)."""
        req = call.queued
        return req is not None and not req.taken and not req.done

    # --- one step (the leading thread, holding the lock except while the forward runs) -------

    def _step(self) -> bool:
        """Leads one step; False when nothing could be served."""
        self._stepping = True
        self._told = {"preempt": [], "errors": []}
        try:
            chunks = self._select()
            told = self._told
            if self.coordinator is not None and chunks and not self.runner.fits(chunks):
                # every rank runs what rank 0 publishes: a step its own blocks cannot hold
                # (the plan's count fell short of the step's) is no step on any rank; the
                # longest head of it (the policy's order) that fits goes instead
                n = len(chunks) - 1
                while n and not self.runner.fits(chunks[:n]):
                    n -= 1
                if not n:
                    self._unfit(chunks[:1], told)
                chunks = chunks[:n]
            if chunks:
                self._unfit_since = None
            if self.coordinator is not None and (chunks or told["preempt"] or told["errors"]):
                told["chunks"] = [(ch.request.call.key, ch.budget, ch.tokens, ch.rows)
                                  for ch in chunks]  # fmt: skip
                self.coordinator.publish(told)  # (blocks until every rank has it)
        except BaseException:
            self._stepping = False
            raise
        return self._run(chunks)

    def _unfit(self, chunks: list[Chunk], told: dict) -> None:
        """Rank 0's chosen step does not fit its pool, not even its first chunk alone: after
        UNFIT_WAIT_S of such steps (blocks held in callers' own code come back meanwhile), the
        call of `chunks` fails on every rank."""
        now = time.monotonic()
        if self._unfit_since is None:
            self._unfit_since = now
            return
        if now - self._unfit_since < UNFIT_WAIT_S:
            return
        self._unfit_since = None
        free, total = self.runner.free_blocks(), self.runner.total_blocks()
        for ch in chunks:
            call = ch.request.call
            message = (
                f"oxygen_torch: the step rank 0 chose for this call ({ch.tokens} tokens, "
                f"{ch.blocks} KV blocks by its plan) has not fit rank 0's KV pool for "
                f"{UNFIT_WAIT_S:g} s ({free} of {total} blocks free): the call fails rather "
                "than wait longer; raise kv.arena_bytes or make fewer or shorter calls at once"
            )
            call.queued.error, call.queued.done = KVBudgetError(message), True
            told["errors"].append((call.key, message))
        self._cond.notify_all()  # (their threads wait in submit)

    def _follow(self) -> None:
        """Runs the next step rank 0 chose (a coordinated rank other than 0)."""
        self._stepping = True
        try:
            self._cond.release()
            try:
                plan = self.coordinator.receive()
            finally:
                self._cond.acquire()
            calls = self._awaited(plan)
            for key in plan["preempt"]:
                self._preempt(calls[key])
            for key, message in plan["errors"]:
                calls[key].queued.error, calls[key].queued.done = KVBudgetError(message), True
            chunks = []
            for key, budget, tokens, rows in plan["chunks"]:
                ch = self.runner.plan(calls[key].queued, budget)
                if ch is None or (ch.tokens, ch.rows) != (tokens, rows):
                    got = None if ch is None else (ch.tokens, ch.rows)
                    raise RuntimeError(
                        f"oxygen_torch: the ranks disagree on call {key!r}: rank 0 planned "
                        f"{(tokens, rows)} (tokens, rows) for it, this rank {got}; every rank "
                        "must make the same generate() calls with the same inputs"
                    )
                chunks.append(ch)
        except BaseException:
            self._stepping = False
            raise
        self._run(chunks)

    def _awaited(self, plan: dict) -> dict:
        """The calls a plan names, by key, once each has a request waiting, as on rank 0 (which
        preempts only calls waiting in submit; lock held)."""
        keys = (
            set(plan["preempt"]) | {k for k, _ in plan["errors"]} | {c[0] for c in plan["chunks"]}
        )
        end = time.monotonic() + FOLLOW_TIMEOUT_S
        while True:
            calls = {c.key: c for c in self._calls}
            missing = [k for k in keys if k not in calls or not self._waiting(calls[k])]
            if not missing:
                return calls
            if time.monotonic() > end:
                names = sorted(map(str, missing))
                raise RuntimeError(
                    f"oxygen_torch: rank 0's step names generate() calls {names} that this rank "
                    f"has not made within {FOLLOW_TIMEOUT_S:g} s: every rank must make the "
                    "same calls from the same threads (named alike)"
                )
            self._cond.wait(IDLE_WAIT_S)

    def _run(self, chunks: list[Chunk]) -> bool:
        """Runs the chosen chunks as one step (lock held, released while the forward runs)."""
        if not chunks:
            self._stepping = False
            return False
        for ch in chunks:
            ch.request.taken = True
        self._cond.release()
        outcomes: list[tuple[list[Chunk], bool, BaseException | None]] = []
        start = time.monotonic()
        try:
            self._serve(chunks, outcomes)
        finally:
            self._cond.acquire()
            for part, served, failed in outcomes:
                if served or failed is not None:
                    self._finish(part, failed)
            for ch in chunks:  # not run (a KeyboardInterrupt) or nothing served: still queued
                ch.request.taken = False
            self._ended = time.monotonic()
            took = self._ended - start
            self._step_s = took if not self._step_s else 0.8 * self._step_s + 0.2 * took
            self._stepping = False
            self._cond.notify_all()
        for _, _, failed in outcomes:
            if failed is not None and not isinstance(failed, Exception):
                raise failed  # KeyboardInterrupt in the leading thread: its own call ends
        return any(served or failed is not None for _, served, failed in outcomes)

    def _serve(self, chunks: list[Chunk], outcomes: list) -> None:
        """Runs `chunks` as one forward (lock released); a merged forward that raises is run
        again in halves, down to single chunks, so that the error goes only to the requests
        that fail on their own (a bad input, a processor that raises in the forward) and the
        others are served. Appends (chunks, served, error) per forward run. Not under
        coordinated steps: every rank would have to split alike."""
        try:
            outcomes.append((chunks, self.runner.run(chunks), None))
            return
        except Exception as err:  # noqa: BLE001 - given to the requests that fail alone
            if len(chunks) == 1 or self.coordinator is not None:
                outcomes.append((chunks, False, err))
                return
            log.debug("oxygen_torch: a step of %d requests raised %r; in halves", len(chunks), err)
        except BaseException as err:  # KeyboardInterrupt: the step's requests are served later
            outcomes.append((chunks, False, err))
            return
        half = len(chunks) // 2
        for part in (chunks[:half], chunks[half:]):
            self._serve(part, outcomes)
            if any(not isinstance(f, (Exception, type(None))) for _, _, f in outcomes):
                return

    def _finish(self, chunks: list[Chunk], failed: BaseException | None) -> None:
        now = time.monotonic()
        self.stats.steps += 1
        seqs = sum(ch.rows for ch in chunks)
        self.stats.batch_sizes = (self.stats.batch_sizes + [seqs])[-1024:]
        total = sum(ch.tokens for ch in chunks) or 1
        for a in (c.account for c in self._calls):
            a.share *= 0.9
        for ch in chunks:
            req, call = ch.request, ch.request.call
            req.taken = False
            if failed is not None:
                if isinstance(failed, Exception):
                    req.error, req.done = failed, True
                continue  # KeyboardInterrupt elsewhere: served again by the next step
            self.stats.tokens += ch.tokens
            self.policy.charge(call.account, ch.tokens)
            call.account.share += ch.tokens / total
            if req.done:
                self._record_done(call, ch, now)
        accounts = [c.account for c in self._calls]
        if isinstance(self.policy, policies.WFQ):
            self.policy.reweigh(accounts)
        if failed is None:
            balance = policies.weight_balance(accounts)
            for observe in self.observers:
                observe("step", None, tokens=total, rows=seqs, balance=balance)

    def _record_done(self, call: Call, ch: Chunk, now: float) -> None:
        a = call.account
        if call.first_done is None:
            call.first_done = now
            event, seconds = "first_token", now - a.arrived
        else:
            per_token = now - (call.last_done or now)  # a step: one more token for each row
            a.latency = per_token if a.latency is None else 0.8 * a.latency + 0.2 * per_token
            event, seconds = "next_token", per_token
        call.last_done = now
        for observe in self.observers:
            observe(event, call, seconds=seconds, rows=ch.rows)

    def _select(self) -> list[Chunk]:
        queued = [c for c in self._calls if self._waiting(c)]
        order = {id(a): c for c in queued for a in (c.account,)}
        ranked = [order[id(a)] for a in self.policy.order([c.account for c in queued])]
        step = _Budget(self.cfg.max_step_tokens, self.cfg.max_step_seqs, self.runner.free_blocks())
        for call in ranked:
            ch = self.runner.plan(call.queued, step.tokens)
            solo = ch is not None and isinstance(call.queued.payload, Solo)
            if ch is None or (step.chosen and (ch.rows > step.seqs or solo)):
                continue
            ch.budget = step.tokens
            if ch.blocks > step.free:
                self._preempt_for(ch.blocks - step.free, call, ranked, step)
            if ch.blocks > step.free:
                if ch.blocks > self.runner.total_blocks():
                    message = (
                        f"oxygen_torch: this generate() step needs {ch.blocks} KV blocks, the "
                        f"whole KV pool holds {self.runner.total_blocks()}: raise kv.arena_bytes "
                        "or split the batch"
                    )
                    call.queued.error, call.queued.done = KVBudgetError(message), True
                    self._told["errors"].append((call.key, message))
                continue
            step.take(ch)
            if step.tokens <= 0 or step.seqs <= 0 or solo:
                break
        if self.coordinator is None:  # (every rank would have to sit the same calls out)
            self._fetch_ahead(step)
        return step.chosen

    def _fetch_ahead(self, step: _Budget) -> None:
        """The chosen calls swapped out to the CPU tier start coming back now (the runner's
        fetch, kv.prefetch_distance): one whose copy is still running sits this step out while
        the others decode, at most the distance's steps in a row. A step that would be left
        with nobody takes them all and waits for their copies."""
        out = []
        for ch in step.chosen:
            if ch.part == "solo":
                continue
            ahead, sit = self.runner.fetch(ch.request.call)
            self.stats.swaps_ahead += ahead
            if sit:
                out.append(ch.request.call)
        if len(out) == len(step.chosen):
            out = []
        for call in out:
            step.drop(call)
            call.sat_out += 1
            self.stats.sat_out += 1
        for ch in step.chosen:
            ch.request.call.sat_out = 0

    def _preempt_for(self, need: int, requester: Call, ranked, step: _Budget) -> None:
        """Frees up to `need` blocks from calls waiting in submit that rank below the requester
        by priority (a lower level; or the same level, younger), lowest-ranked first. A victim
        the step had already taken is put back out of it: priority, not the fair share, decides
        who keeps the KV when it is short."""
        me = requester.account
        victims = [
            c for c in reversed(ranked)
            if c is not requester and not c.preempted
            and (c.account.task.level < me.task.level
                 or (c.account.task.level == me.task.level and c.account.arrived > me.arrived))
        ]  # fmt: skip
        freed = 0
        for c in victims:
            if freed >= need:
                break
            step.drop(c)
            got = self._preempt(c)
            if got:
                self._told["preempt"].append(c.key)
            freed += got
        step.free += freed

    def _preempt(self, c: Call) -> int:
        got = self.runner.preempt(c)
        if got:
            c.preempted = not c.swapped  # a swapped call's KV comes back, no recompute
            self.stats.preemptions += 1
            self.stats.swaps += c.swapped
            for observe in self.observers:
                observe("preempted", c, blocks=got)
        return got


@dataclass
class _Budget:
    """What a step has left to give while it is being chosen."""

    tokens: int
    seqs: int
    free: int  # KV blocks
    chosen: list[Chunk] = field(default_factory=list)

    def take(self, ch: Chunk) -> None:
        self.chosen.append(ch)
        self.free -= ch.blocks
        self.tokens -= ch.tokens
        self.seqs -= ch.rows

    def drop(self, call: Call) -> None:
        for ch in [ch for ch in self.chosen if ch.request.call is call]:
            self.chosen.remove(ch)
            self.free += ch.blocks
            self.tokens += ch.tokens
            self.seqs += ch.rows
