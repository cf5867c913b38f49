"""Which rows a step serves: every decoding row, then prefill chunks in the policy's order.

The engine's rows are Requests (engine/request.py). A step takes, in this order:

1. every row that decodes (its prompt is written and it still draws), up to max_step_seqs;
2. prefill chunks of rows still writing their prompt (admitted ones first, then the waiting
   ones) in the policy's order (WFQ: the lowest virtual-token counter first), each cut to the
   token budget left (max_step_tokens). While a row of a higher priority level is live, the
   chunks of lower-level rows share at most `scheduler.lower_prefill_tokens` of a step: a
   higher row's steps stay short, and a lower row still gets some of every step. While rows of
   the highest live level decode in the step, every prefill chunk beside them shares at most
   `scheduler.decode_prefill_tokens` (0: no such cap), so their time per token stays near a
   decode step's when prompts arrive.

KV blocks are counted before a row joins: when they are short, rows of a lower priority level
(or the same level, younger) are preempted, their blocks freed and their tokens computed again
when they come back. A row whose KV could never fit the whole pool fails with a clear error.
Decode rows keep their place over prefills: a high-priority arrival gets its prefill into the
next step beside the running decodes (chunked within the budget), and a lower row is preempted
for it when KV is short.
"""

from __future__ import annotations

from dataclasses import dataclass

from .request import Request
from .scheduler import KVBudgetError  # (one class: the per-call path raises it too)


@dataclass(eq=False)  # (identity: a list's remove() compared every field of every row)
class StepRow:
    """One row of a step: `n` tokens from position `start`; `ids` on the host for a prefill
    chunk, None for a decode token (the row's last draw, still on the device); `keep`: its last
    token's logits are drawn from."""

    req: Request
    n: int
    start: int
    ids: list[int] | None
    keep: bool
    blocks: int = 0  # fresh KV blocks the step counted for it


class Budget:
    """What a step has left to give while it is being chosen."""

    def __init__(self, tokens: int, seqs: int, free: int, more=None):
        self.tokens, self.seqs, self.free = tokens, seqs, free
        # () -> blocks a cache would give back on demand, counted into `free` the first time a
        # demand exceeds it (the prefix cache's count walks its hot nodes: most steps never
        # need it)
        self._more = more
        # rows preempted while this step is chosen: none of them joins it (a prefill row
        # preempted for the decodes' blocks was still in the list of prefills: swapped out, it
        # joined the step anyway, and its swap-in took the blocks the decodes had been counted)
        self.preempted: set[int] = set()
        # the strongest row (level, then age) found with no running row it may preempt: a row
        # it outranks or equals finds none either, until a row joins the running ones (hundreds
        # of rows waiting while KV is short each scanned every running row: 301 scans of 256
        # rows, 16 of a choosing's 23 ms on the CPU machine)
        self.no_victims: Request | None = None

    def short(self, blocks: int) -> bool:
        """Whether `blocks` exceed what the step has left, the cache's share counted first."""
        if blocks > self.free and self._more is not None:
            more, self._more = self._more, None
            self.free += more()
        return blocks > self.free

    def preempt(self, engine, r: Request) -> None:
        self.short(self.free + 1)  # (the cache's share counted before the row's blocks go)
        self.free += engine.preempt(r)
        self.preempted.add(id(r))


def outranks(a: Request, b: Request) -> bool:
    """Whether `a` may preempt `b`: a higher level, or the same level and older."""
    la, lb = a.task.level, b.task.level
    return la > lb or (la == lb and a.arrived < b.arrived)


def choose(engine, budget: Budget) -> list[StepRow]:
    """The rows of the next step (see the module docstring). `engine` gives the running and
    waiting rows, the policy, the KV figures (`blocks_for`, `total_blocks`) and `preempt`."""
    rows: list[StepRow] = []
    decoding, prefills = [], []
    allowed = engine.allowed
    for r in engine.running:  # (one pass: hundreds of rows a step)
        if not allowed(r):
            continue
        if r.computed < (r.recompute or len(r.prompt)):
            prefills.append(r)
        elif r.sampled < r.stop.max_new and r.finished is None:
            decoding.append(r)
    if len(decoding) > budget.seqs:
        decoding = _ordered(engine, decoding)[: budget.seqs]
    need = dict(zip(decoding, engine.decode_blocks(decoding)))
    while budget.short(sum(need.values())):  # KV short for the running decodes: the lowest go
        victim = _lowest(engine, [r for r in engine.running if r.kv is not None])
        if victim is None:
            break
        budget.preempt(engine, victim)
        need.pop(victim, None)
    for r, b in need.items():
        if budget.seqs <= 0:
            break
        if budget.short(b):
            continue
        budget.free -= b
        budget.tokens -= 1
        budget.seqs -= 1
        rows.append(StepRow(r, 1, r.computed, None, True, b))
    gone = budget.preempted
    back = [r for r in engine.waiting if r.swapped and r.finished is None and id(r) not in gone]
    for r in _ordered(engine, back):
        # swapped rows first (they hold their tokens): back when their blocks fit, running from
        # the next step
        need = engine.swapped_blocks(r) + 1
        if budget.seqs <= 0 or budget.short(need):
            break
        if engine.resume(r):
            budget.free -= need
    prefills = _ordered(engine, prefills) + _ordered(
        engine,
        [r for r in engine.waiting
         if r.pending == 0 and r.finished is None and not r.swapped and allowed(r)],
    )  # fmt: skip
    cap, top = engine.cfg.lower_prefill_tokens, None
    shared = engine.cfg.decode_prefill_tokens or None
    if (cap or shared) and prefills:  # the highest level live
        top = max((r.task.level for rs in (engine.running, engine.waiting) for r in rs
                   if r.finished is None), default=None)  # fmt: skip
    if shared is not None and (top is None or not any(w.req.task.level >= top for w in rows)):
        shared = None  # (no row of the highest level decodes in this step: no shared cap)
    capped = bool(cap) and top is not None
    # the highest level at which a waiting row found no running row below it to give its
    # place: the rows after it at that level or lower find none either (until a row of that
    # level or lower joins the step), so they skip the scan of every running row (hundreds
    # waiting beside a full step of 256 rows: 145 scans, 8 ms of a step's choosing on the CPU
    # machine)
    no_room = None
    for r in prefills:
        if budget.tokens <= 0:
            break
        if id(r) in gone:
            continue
        lower = capped and r.task.level < top  # lower rows share `cap`
        limit = cap if lower else None
        if shared is not None:  # every prefill chunk beside the top level's decodes
            limit = shared if limit is None else min(limit, shared)
        if limit is not None and limit <= 0:
            continue
        if budget.seqs <= 0:
            if r.kv is not None or (no_room is not None and r.task.level <= no_room):
                continue
            room = _make_room(engine, r, budget, rows)
            if room is None:
                no_room = r.task.level if no_room is None else max(no_room, r.task.level)
            if not room:
                continue  # (a higher row further on may still find a lower one to preempt)
        row = _chunk(engine, r, budget, rows, limit)
        if row is not None:
            rows.append(row)
            if no_room is not None and r.task.level <= no_room:
                no_room = None  # (a row at that level runs now: it may give its place)
            if lower:
                cap -= row.n
            if shared is not None:
                shared -= row.n
    return rows


def _victims(engine, r: Request, budget: Budget | None = None) -> list[Request]:
    """The running rows `r` may preempt for KV (none without a look when the budget knows a
    row that outranks or equals `r` and found none)."""
    f = budget.no_victims if budget is not None else None
    if f is not None and (r.task.level, -r.arrived) <= (f.task.level, -f.arrived):
        return []
    found = [v for v in engine.running if v is not r and v.kv is not None and outranks(r, v)]
    if not found and budget is not None:
        budget.no_victims = r  # (stronger than the one before, else it returned above)
    return found


def _make_room(engine, r: Request, budget: Budget, chosen: list[StepRow]) -> bool | None:
    """A step full of rows (max_step_seqs) and `r` waiting: a running row that `r` outranks by
    level gives its place (preempted: it comes back when there is room). Whether the step has
    a place now; None: no running row is below `r`'s level."""
    if r.kv is not None:
        return False  # (a row already running waits for its next step)
    lower = [v for v in engine.running if v.kv is not None and v.task.level < r.task.level]
    victim = _lowest(engine, lower)
    if victim is None:
        return None
    _preempt(engine, victim, budget, chosen)
    return budget.seqs > 0


def _preempt(engine, v: Request, budget: Budget, chosen: list[StepRow]) -> None:
    """Preempts `v`, and takes it out of the step being chosen if it was in it."""
    budget.preempt(engine, v)
    mine = [row for row in chosen if row.req is v]
    if mine:
        chosen[:] = [row for row in chosen if row.req is not v]
    for row in mine:
        budget.free += row.blocks
        budget.tokens += row.n
        budget.seqs += 1


def _chunk(engine, r: Request, budget: Budget, chosen: list[StepRow],
           limit: int | None = None) -> StepRow | None:  # fmt: skip
    """A prefill chunk of `r` within the budget (and `limit` tokens), preempting lower rows
    when KV is short. A waiting row is admitted first (its KV, and what the prefix cache holds
    of its tokens)."""
    tokens = budget.tokens if limit is None else min(budget.tokens, limit)
    if r.kv is None:
        whole = engine.kvs.blocks_for(None, len(r.prompt) + r.stop.max_new)
        if whole > engine.total_blocks():  # it could never hold its tokens, whoever else left
            engine.fail(
                r,
                KVBudgetError(
                    f"oxygen_torch: a row of {len(r.prompt)} prompt tokens and "
                    f"{r.stop.max_new} new ones needs {whole} KV blocks, the whole KV pool "
                    f"holds {engine.total_blocks()}: raise kv.arena_bytes or ask for fewer "
                    "tokens"
                ),
            )
            return None
        first = min(len(r.seq()), tokens)
        if budget.short(engine.kvs.blocks_for(None, first)) and not _victims(engine, r, budget):
            budget.free += engine.reclaim_kept()  # (ended rows kept for an output cache)
            if budget.short(engine.kvs.blocks_for(None, first)):
                return None  # no room and no one to make it: it waits (not admitted)
        engine.admit(r)
        f = budget.no_victims
        if f is not None and outranks(f, r):  # (a row joined the running ones: it may be one)
            budget.no_victims = None
    left = r.target - r.computed
    n = min(left, tokens)
    blocks = engine.blocks_for(r, n)
    if budget.short(blocks):
        for v in reversed(_ordered(engine, _victims(engine, r, budget))):
            if not budget.short(blocks):
                break
            _preempt(engine, v, budget, chosen)
    if budget.short(blocks):  # a shorter chunk that fits the blocks left
        n = engine.tokens_fitting(r, budget.free, n)
        if n <= 0:
            return None  # (admitted: its prefill starts when blocks come back)
        blocks = engine.blocks_for(r, n)
    budget.free -= blocks
    budget.tokens -= n
    budget.seqs -= 1
    ids = r.seq()[r.computed : r.computed + n]
    return StepRow(r, n, r.computed, ids, r.computed + n == r.target, blocks)


def _ordered(engine, reqs: list[Request]) -> list[Request]:
    order = engine.policy.order([r.account for r in reqs])
    by = {id(r.account): r for r in reqs}
    return [by[id(a)] for a in order]


def _lowest(engine, reqs: list[Request]) -> Request | None:
    """The row to preempt first: the lowest level, then the youngest."""
    if not reqs:
        return None
    return min(reqs, key=lambda r: (r.task.level, -r.arrived))
