"""One decode token for each of many one-sequence cores: the engine's decode step, planned in
one pass over the rows.

A MergedStep (merged.py) plans any mix of prefill chunks and decode tokens of cores of any
batch, through each core's general reservation. The engine's steady state is simpler and
hotter: hundreds of one-sequence cores each adding one token. This step keeps MergedStep's
attention path (write / attend over the step's table, lengths and slots, or a decode graph's
copies of them) and plans it in one loop: a row whose last block has room and is its own only
counts the token (15 steps in 16 at 16-token blocks); the others, and rows behind a sliding
window or coming back from the CPU tier, take the core's own path. The step's table is built
with numpy from each core's block ids, kept as an int32 array beside the list they copy until
the list changes (a new block every block_tokens steps, a copy-on-write, a swap-in): 3.3 ms of
Python a step at 256 rows before, on the CPU machine.
"""

from __future__ import annotations

import numpy as np
import torch

from .merged import MergedStep
from .storage import GUARD_BLOCK
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
        """Counts each row's token, taking a block where one is due (hold the pool's lock). The
        rows whose last block is full take their new blocks in one allocation (a row in 16 at
        16-token blocks: one call of the pool's page accounting instead of one each)."""
        bt = self.pool.key.block_tokens
        refcount = self.pool.manager.refcount
        starts = self._starts = []
        windows = False
        full = []  # (core, length) of rows whose blocks are all full: a fresh block each
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
            elif not n % bt and len(s.blocks[0]) * bt == n:
                full.append((c, n))
            else:  # a copy of a shared last block (or blocks not as counted): the core's way
                new, cow = s.reserve(0, 1)
                if cow is not None:
                    c._copy_blocks([cow])
                _note_blocks(c, new)
            starts.append(n)
        if full:
            try:
                fresh = self.pool.manager.allocate(len(full))
            except BaseException:  # (KVCacheFull: the engine counted blocks first) undone
                for c, n in zip(self.cores, starts):
                    c.seqs.truncate(0, n)
                raise
            for (c, n), blk in zip(full, fresh):
                s = c.seqs
                s.blocks[0].append(blk)
                s.lens[0] = n + 1
                _note_blocks(c, [(len(s.blocks[0]) - 1, blk)])
        if windows:
            self._narrowed = narrowed_window(self.cores)
        if build:
            self.build()

    def host_plan(self) -> tuple[torch.Tensor, list[int], list[int], list[int]]:
        bt = self.pool.key.block_tokens
        arrs = [_blocks(c) for c in self.cores]
        r = len(arrs)
        counts = np.fromiter(map(len, arrs), dtype=np.int64, count=r)
        width = int(counts.max())
        flat = np.concatenate(arrs)
        first = np.cumsum(counts) - counts  # each row's first entry in `flat`
        grid = np.full((r, width), GUARD_BLOCK, dtype=np.int32)
        at = np.repeat(np.arange(r, dtype=np.int64) * width - first, counts)
        grid.reshape(-1)[at + np.arange(flat.shape[0])] = flat
        starts = np.asarray(self._starts, dtype=np.int64)
        slots = flat[first + starts // bt].astype(np.int64) * bt + starts % bt
        table = torch.from_numpy(grid)  # [R, W]
        if self.pool.heat is not None:  # the step's attention reads every block in the table
            self.pool.heat.touch(table)
        return table, slots.tolist(), (starts + 1).tolist(), [1] * r

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


def _note_blocks(core, new: list[tuple[int, int]]) -> None:
    """A core's new (column, block) entries in its host table (the device table is reloaded
    whole before an eager step)."""
    core._lent = True
    if new:
        core._grow_table(max(col for col, _ in new) + 1)
    host = core._table_host.numpy()  # (numpy's element writes: a torch one costs ~5 us)
    for col, blk in new:
        host[0, col] = blk


def _blocks(core) -> np.ndarray:
    """The block ids of `core`'s sequence as int32, rebuilt only when its list changed."""
    blocks = core.seqs.blocks[0]
    kept = core.__dict__.get("_blocks_np")
    if kept is not None and kept[0] == blocks:
        return kept[1]
    arr = np.array(blocks, dtype=np.int32)
    core._blocks_np = (list(blocks), arr)
    return arr
