"""Heat of a pool's KV blocks: a 2-bit saturating counter and the last K = 2 access times each.

A step's attention reads every block in its table: `touch(table)` bumps those blocks' counters
(saturating at 3) and shifts their access times, once per step (one vectorised op over the
table, no per-block Python). `sweep()` halves every counter, so a block that stops being read
cools to 0 within two sweeps. `coldest(candidates, n)` orders blocks coldest first: counter,
then the K-th last access (LRU-K: a block read once goes before one read twice), then the last.
"""

from __future__ import annotations

import torch

from .lruk import NEVER, K
from .transfer import int64

HOT = 3  # the counter's ceiling (2 bits)


class Heat:
    def __init__(self, num_blocks: int, sweep_every: int = 64, touch_every: int = 1):
        self.counter = torch.zeros(num_blocks, dtype=torch.int8)
        self.times = torch.full((num_blocks, K), NEVER, dtype=torch.int64)  # oldest first
        self.clock = 0
        self.sweep_every = sweep_every  # counted touches between sweeps (0: only explicit)
        # a step's touch counts every this many steps (the others return at once): a touch
        # costs ~0.2 ms of host at 256 rows, the step's launch ~1-2 ms; heat only orders what
        # the prefix cache moves down, which a sampled read orders as well
        self.touch_every = max(1, int(touch_every))
        self._steps = 0

    def touch(self, blocks: torch.Tensor) -> None:
        """One step read `blocks` (any shape of host int block ids; repeats count once, ids
        outside the pool and the guard block 0 not at all)."""
        self._steps += 1
        if self._steps % self.touch_every:
            return
        self.clock += 1
        # no unique(): a repeated id gathers and writes back the same values; out-of-range ids
        # (padding) land on the guard block, reset below
        ids = blocks.reshape(-1).to(torch.int64)
        ids = ids.masked_fill((ids < 0) | (ids >= self.counter.shape[0]), 0)  # (not in place)
        counts = self.counter.index_select(0, ids).add_(1).clamp_(max=HOT)
        self.counter.index_copy_(0, ids, counts)
        times = self.times.index_select(0, ids)
        times[:, :-1] = times[:, 1:].clone()
        times[:, -1] = self.clock
        self.times.index_copy_(0, ids, times)
        self.counter[0], self.times[0] = 0, NEVER
        if self.sweep_every and self.clock % self.sweep_every == 0:
            self.sweep()

    def sweep(self) -> None:
        self.counter >>= 1

    def forget(self, blocks: list[int]) -> None:
        """Blocks freed (or moved off the device): their next owner starts cold."""
        if blocks:
            ids = int64(blocks)  # (a swap-out forgets hundreds)
            self.counter[ids] = 0
            self.times[ids] = NEVER

    def key(self, block: int) -> tuple[int, int, int]:
        return int(self.counter[block]), int(self.times[block, 0]), int(self.times[block, -1])

    def coldest(self, candidates: list[int], n: int) -> list[int]:
        """The n coldest of `candidates`, coldest first."""
        if not candidates or n <= 0:
            return []
        ids = torch.tensor(candidates, dtype=torch.int64)
        # one sortable int per block: counter, then K-th last access, then last access
        span = self.clock + 2
        score = (self.counter[ids].to(torch.int64) * span + self.times[ids, 0] + 1) * span
        score = score + self.times[ids, -1] + 1
        order = torch.argsort(score, stable=True)[:n]
        return ids[order].tolist()
