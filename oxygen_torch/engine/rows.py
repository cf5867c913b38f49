"""The engine's rows and their KV: admission, preemption (swap or recompute), slots, ends.

Part of Engine (loop.py): what schedule.choose asks of it, and what a row's life does to its
KV (through its accounting, kv_rows.py). Runs on the engine thread only."""

from __future__ import annotations

import contextlib

import torch

from ..kv import transfer
from .request import Request
from .stats import METRICS


class Rows:
    """Engine's row bookkeeping (a mixin: the state lives in Engine.__init__)."""

    # --- what schedule.choose asks --------------------------------------------------------------

    def blocks_for(self, r: Request, n: int) -> int:
        return self.kvs.blocks_for(r.kv, n)

    def decode_blocks(self, reqs: list[Request]) -> list[int]:
        return self.kvs.decode_blocks([r.kv for r in reqs])

    def total_blocks(self) -> int:
        return self.kvs.total_blocks()

    def tokens_fitting(self, r: Request, free: int, n: int) -> int:
        """The most tokens (≤ n) of r's next chunk that `free` blocks hold."""
        lo, hi = 0, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.kvs.blocks_for(r.kv, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def admit(self, r: Request) -> bool:
        """A waiting row joins the running ones: a slot, an empty KV (its tokens computed
        again from the start after a preemption)."""
        if r.kv is not None:
            return True
        r.kv = self.runner.new_kv()
        r.recompute = len(r.seq()) if r.out else 0
        # the prefix cache's blocks of its first tokens (kv.prefix_cache): computed already
        r.computed = self.kvs.start(r.kv, r.seq())
        r.slot = self._take_slot()
        if r.params.penalised:
            ids = r.penalty_ids if r.penalty_ids is not None else torch.tensor(r.prompt)
            held = torch.cat([ids.cpu(), torch.tensor(r.out, dtype=torch.int64)])
            self.sampler.start_row(r.slot, held)
        self.waiting.remove(r)
        self.running.append(r)
        return True

    def preempt(self, r: Request) -> int:
        """Frees r's KV blocks: its KV goes to the CPU tier (swapped: it comes back as it
        was, `resume`) or, when there is none or it lacks room, is dropped (its tokens are
        computed again when it comes back, from the prefix cache as far as it kept them).
        Returns the blocks freed."""
        before = self.kvs.free_blocks()
        low = r.task.level < 1  # (below "normal": the tier may keep it as fp8)
        if self.kvs.swap_out(r.kv, low) is not None:
            r.swapped = True  # (its slot stays: its next input is the draw in `last`)
            self.stats.swaps += 1
        else:
            self.kvs.keep(r.kv, r.seq())
            self._unbind(r)
        self.running.remove(r)
        self.waiting.append(r)
        self.stats.preemptions += 1
        METRICS.preempted()
        return self.kvs.free_blocks() - before

    def resume(self, r: Request) -> bool:
        """A swapped row's KV comes back from the CPU tier (the step's stream waits for the
        copy); it runs again from its next step. False: not enough free blocks."""
        if not self.kvs.swap_in(r.kv):
            return False
        r.swapped = False
        self.waiting.remove(r)
        self.running.append(r)
        return True

    def swapped_blocks(self, r: Request) -> int:
        return self.kvs.swapped_blocks(r.kv)

    def reclaim_kept(self) -> int:
        """Rows that ended and keep their KV for their call's output cache, while the call's
        other rows still wait, give the blocks back (the call then returns no cache): else a
        call larger than the pool would wait for itself. Returns the blocks freed."""
        before = self.kvs.free_blocks()
        for r in self._kept:
            if not r.group.done and r.kv is not None:
                self.kvs.release(r.kv)
                r.kv = None
        self._kept = []
        return self.kvs.free_blocks() - before

    def fail(self, r: Request, err: BaseException) -> None:
        self._end(r, "error")
        r.group.fail(err)

    # --- rows ---------------------------------------------------------------------------------

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        slot, self._slots = self._slots, self._slots + 1
        if slot >= self.last.shape[0]:
            grown = torch.zeros(max(64, 2 * slot), dtype=torch.int64, device=self.runner.device)
            grown[: self.last.shape[0]] = self.last
            self.last = grown
        return slot

    def _unbind(self, r: Request) -> None:
        if r.kv is not None:
            self.kvs.release(r.kv)
            r.kv = None
        if r.slot >= 0:
            self._free_slots.append(r.slot)
            r.slot = -1

    def _end(self, r: Request, why: str) -> None:
        if r.finished is None:
            r.finished = why
        keep = why in ("eos", "length", "stop") and r.kv is not None
        if keep and self._ending is not None:
            self._ending.append((r, why))  # its KV to the prefix cache with the step's others
        else:
            if keep:
                self.kvs.keep(r.kv, r.seq())  # its blocks join the prefix cache (a next turn)
            self._let_go(r, why)
        for lst in (self.running, self.waiting):
            if r in lst:
                lst.remove(r)

    def _let_go(self, r: Request, why: str) -> None:
        """An ended row's KV goes back, or stays its call's (its output's cache), and its
        slot goes back."""
        if r.keep_kv and why in ("eos", "length", "stop"):
            r.kv, kept = None, r.kv  # the caller's now (its output's cache)
            self._unbind(r)
            r.kv = kept
            if not r.group.done:
                self._kept.append(r)  # (taken back if its call's other rows need the blocks)
        else:
            self._unbind(r)

    @contextlib.contextmanager
    def ending(self):
        """A context for reading one step's tokens: the rows that end in it give their KV to
        the prefix cache in one insert at its close (one room-making past the cache's budget
        for all of them), then let it go as `_end` would have."""
        self._ending = []
        try:
            yield
        finally:
            ended, self._ending = self._ending, None
            if ended:
                try:
                    self.kvs.keep_many([(r.kv, r.seq()) for r, _ in ended])
                finally:
                    for r, why in ended:
                        self._let_go(r, why)


def upload(values: list[int], device: torch.device) -> torch.Tensor:
    return transfer.to_device(transfer.int64(values), device)
