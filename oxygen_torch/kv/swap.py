"""Swap preemption: a core's KV moves to its pool's CPU tier and back, instead of being dropped
and recomputed (the multi-task engine's preempted calls, when pool.cpu_tier_bytes > 0).

While swapped out, the core holds no sequence (as after `drop_kv`) and keeps `Swapped`: each
row's block list where a block only this core held is a tier slot (written -1 - slot) and a
block someone else also holds (a prefix-cache block, a fork's) stays a device block, still
referenced. `swap_in` (from the core's next `_reserve`, or the merged step's) gives every slot a
fresh device block, copies them up in one transfer, and puts the rows back as they were; a beam
reorder while swapped out reorders the rows in place (`select`). A swap-out takes precedence
over the prefix cache's cold blocks: those are dropped (LRU-K) when the tier lacks its room.
Entries a row gave back behind its sliding window (GUARD_BLOCK, kv/window.py) stay as they are:
nothing is moved or referenced for them. A core whose rows narrowed blocks (a hybrid model's,
kv/window.py) is not swapped: those blocks' sliding layers' pages may be unmapped, so a gather
of whole blocks may not read them (`swappable`).

A swap-in may also start ahead of the core's step (`swap_in(core, ahead=True)`: the engine's
prefetch, kv.prefetch_distance): the rows are put back at once, the copy runs on the tier's side
stream, and the core keeps the copy's event (`core._ready`) instead of the current stream waiting
for it. Whatever next reads or gives back the core's blocks first has its stream wait for that
event (`settle`, from `resident` before a step and from the core's other operations), so no step
reads a block the copy is still writing and no block is reused under it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import chain

import torch

from .block_manager import SequenceBlocks
from .storage import GUARD_BLOCK
from .tier import TierFull


@dataclass
class Swapped:
    rows: list[list[int]]  # per row: device block (> 0), -1 - tier slot, or GUARD_BLOCK
    lens: list[int]
    dropped: list[int]  # per row: leading GUARD_BLOCK entries (given back behind the window)
    slots: set[int]  # every slot taken (some may no longer be referenced after a select)

    def device_blocks(self) -> list[int]:
        return [b for row in self.rows for b in row if b >= 0 and b != GUARD_BLOCK]

    def blocks_needed(self) -> int:
        """Fresh device blocks `swap_in` takes."""
        return len({b for row in self.rows for b in row if b < 0})

    def blocks_needed_with(self, counts: list[int], block_tokens: int, refcount) -> int:
        """Fresh device blocks `swap_in` takes, then `counts[b]` more tokens of each row b on
        top of the tokens it comes back with (as `SequenceBlocks.blocks_needed` counts them
        after the swap-in: a partly filled last block shared, copied). Counting the new tokens
        against the swapped core's empty rows counted each row's last block twice."""
        uses = Counter(b for row in self.rows for b in row if b < 0)  # (a slot of several rows)
        need = len(uses)
        for row, n, extra in zip(self.rows, self.lens, counts):
            if extra <= 0:
                continue
            need += max(0, -(-(n + extra) // block_tokens) - len(row))
            if n % block_tokens and row:
                last = row[-1]
                need += (uses[last] if last < 0 else refcount(last)) > 1
        return need


def swappable(core) -> bool:
    """Whether swap_out may move the core: no row narrowed a block (kv/window.py)."""
    return core.seqs is not None and not any(core.seqs.narrowed)


def swap_out(core, low_priority: bool = False) -> int | None:
    """Moves the core's own blocks to the tier; returns the device blocks freed, or None (the
    tier lacks room, or its disk failed: nothing changed). `low_priority`: the tier may store
    them as fp8 (pool.tier_fp8_lowering)."""
    pool, seqs = core.pool, core.seqs
    tier = pool.tier
    if tier is None or not swappable(core) or core._swapped is not None:
        return None
    with pool.lock:
        uses = Counter(chain.from_iterable(map(seqs.held, range(len(seqs)))))
        refs = pool.manager.refcounts(uses)
        own = sorted([b for (b, n), r in zip(uses.items(), refs) if r == n])
        pc = pool.prefix
        if pc is not None and tier.num_free < len(own) <= tier.num_free + pc.num_cold:
            pc.drop_cold(len(own) - tier.num_free)  # a swap comes before cold cached blocks
        if len(own) > tier.num_free:
            return None
        try:
            where = dict(zip(own, tier.down(own, low_priority)))
        except TierFull:
            return None
        rows = [[-1 - where[b] if b in where else b for b in row] for row in seqs.blocks]
        before = pool.manager.num_free
        # freed behind the copy's event: neither reuse nor unmapping overtakes it
        gone = [b for row in seqs.blocks for b in row if b in where]
        pool.manager.decref(gone, after=tier.fence())
        if pool.heat is not None:
            pool.heat.forget(own)
        core._ready = None  # a swap-in ahead still in flight: the side stream orders the two
        core._swapped = Swapped(rows, list(seqs.lens), list(seqs.dropped), set(where.values()))
        core.seqs = SequenceBlocks(pool.manager, core.block_tokens, len(rows))
        freed = pool.manager.num_free - before
    core._table_host.fill_(GUARD_BLOCK)
    core._lent = True  # the device table is reloaded from the host at the next step
    return freed


def swap_in(core, ahead: bool = False) -> None:
    """Brings a swapped-out core's blocks back (KVCacheFull: nothing changed, still swapped).
    `ahead`: the current stream does not wait for the copy; the core keeps its event for its
    next step (`settle`)."""
    sw, pool = core._swapped, core.pool
    with pool.lock:
        uses = Counter([b for row in sw.rows for b in row if b < 0])  # -1 - slot: its entries
        live = sorted([-1 - b for b in uses])
        new = pool.manager.allocate(len(live))
        try:
            core._ready = pool.tier.up(live, new, wait=not ahead)
        except BaseException:
            pool.manager.decref(new)
            raise
        to_block = dict(zip(live, new))
        rows = [[to_block[-1 - b] if b < 0 else b for b in row] for row in sw.rows]
        pool.manager.incref([to_block[-1 - s] for s, n in uses.items() for _ in range(n - 1)])
        pool.tier.release(sorted(sw.slots))
        core.seqs.blocks, core.seqs.lens, core.seqs.dropped = rows, list(sw.lens), sw.dropped
        core._swapped = None
    width = {len(r) for r in rows}
    core._grow_table(max(width, default=1))
    if len(width) == 1:  # rows of one length (the usual batch): one write, not two calls a row
        core._table_host[: len(rows), : width.pop()] = torch.tensor(rows, dtype=torch.int32)
    else:
        for r, row in enumerate(rows):
            core._table_host[r, : len(row)] = core._table_host.new_tensor(row)
    core._reload()


def resident(core) -> None:
    """Before a step reads the core's blocks: a swapped-out core comes back (the current stream
    waits for the copy), and a core swapped in ahead has the current stream wait for its copy."""
    if core._swapped is not None:
        swap_in(core)
    settle(core)


def settle(core) -> None:
    """The current stream's next work comes after the core's swap-in ahead, if one is pending
    (before its blocks are read, shared or given back)."""
    done, core._ready = core._ready, None
    if done is not None:
        torch.cuda.current_stream(core.pool.key.device).wait_event(done)


def pending(core) -> bool:
    """Whether the core's swap-in ahead is still copying (never on the host)."""
    return core._ready is not None and not core._ready.query()


def select(core, order: list[int]) -> None:
    """A beam reorder while swapped out: row i becomes old row order[i]."""
    sw, pool = core._swapped, core.pool
    with pool.lock:
        old = sw.device_blocks()
        sw.rows = [list(sw.rows[j]) for j in order]
        sw.lens = [sw.lens[j] for j in order]
        sw.dropped = [sw.dropped[j] for j in order]
        pool.manager.incref(sw.device_blocks())
        pool.manager.decref(old)
    core.seqs = SequenceBlocks(pool.manager, core.block_tokens, len(order))


def release(core) -> None:
    """The core ends while swapped out: its slots and device references go back."""
    sw, pool = core._swapped, core.pool
    with pool.lock:
        pool.manager.decref(sw.device_blocks())
        pool.tier.release(sorted(sw.slots))
    core._swapped = None
