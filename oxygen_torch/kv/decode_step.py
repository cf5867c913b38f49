"""One decode token for each of many one-sequence cores: the engine's decode step, planned in
one pass over the rows.

A MergedStep (merged.py) plans any mix of prefill chunks and decode tokens of cores of any
batch, through each core's general reservation. The engine's steady state is simpler and
hotter: hundreds of one-sequence cores each adding one token. This step keeps MergedStep's
attention path (write / attend over the step's table, lengths and slots, or a decode graph's
copies of them) and plans it in one loop: a row whose last block has room and is its own only
counts the token (15 steps in 16 at 16-token blocks); the others, and rows behind a sliding
window or coming back from the CPU tier, take the core's own path.
"""

from __future__ import annotations

from array import array

import torch

from .merged import MergedStep, _pad
from .swap import resident
from .window import narrowed_window


class DecodeStep(MergedStep):
    """A MergedStep of one token for each of `cores` (each holding one sequence)."""

    def __init__(self, cores: list):
        if not cores:
            raise ValueError("DecodeStep: no row")
        first = cores[0]
        self.cores, self.parts = cores, []
        self.pool = first.pool
        self.precision, self.tiles, self.debug = first.precision, first.tiles, first.debug
        self.tokens = len(cores)
        self._plan = None
        self._starts: list[int] = []
        self._narrowed = None

    def blocks_needed(self) -> int:
        return sum(c.seqs.blocks_needed(0, 1) for c in self.cores)

    def reserve(self, *, build: bool = True) -> None:
        """Counts each row's token, taking a block where one is due (hold the pool's lock)."""
        bt = self.pool.key.block_tokens
        refcount = self.pool.manager.refcount
        starts = self._starts = []
        windows = False
        for c in self.cores:
            if c._swapped is not None or c._ready is not None:
                resident(c)  # back from the CPU tier first (kv/swap.py)
            s = c.seqs
            n = s.lens[0]
            if c.window or c.narrow_window:
                windows = True
                c._reserve([1])  # (gives back or narrows the blocks behind the window first)
            elif n % bt and refcount(s.blocks[0][-1]) == 1:
                s.lens[0] = n + 1
            else:  # a new block (or a copy of a shared last one): the host table follows
                new, cow = s.reserve(0, 1)
                if cow is not None:
                    c._copy_blocks([cow])
                c._lent = True  # (the device table is reloaded whole before an eager step)
                for col, blk in new:
                    if col >= c._table_host.shape[1]:
                        c._grow_table(col + 1)
                    c._table_host[0, col] = blk
            starts.append(n)
        if windows:
            self._narrowed = narrowed_window(self.cores)
        if build:
            self.build()

    def host_plan(self) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        bt = self.pool.key.block_tokens
        lists = [c.seqs.blocks[0] for c in self.cores]
        width = max(map(len, lists))
        table = torch.frombuffer(
            array("i", [b for blocks in lists for b in (*blocks, *_pad(width - len(blocks)))]),
            dtype=torch.int32,
        ).view(len(lists), width)  # [R, W]
        starts = self._starts
        slots = [blocks[n // bt] * bt + n % bt for blocks, n in zip(lists, starts)]
        if self.pool.heat is not None:  # the step's attention reads every block in the table
            self.pool.heat.touch(table)
        return table, slots, [n + 1 for n in starts], [1] * len(starts)

    def commit(self) -> None:
        for c in self.cores:
            c.length += 1
            c._lent = True

    def abandon(self) -> None:
        with self.pool.lock:
            for c, n in zip(self.cores, self._starts):
                c.seqs.truncate(0, n)
        for c in self.cores:
            c._lent = True
