"""The engine's KV accounting: each row's blocks in its model's KV pool, the prefix cache, swap.

Every engine row owns a PagedKVCore of one sequence in the pool (kv/core.py). This class counts
blocks for the scheduler (schedule.py), starts a row on the prefix cache's blocks of its first
tokens and gives a row's blocks to it when it ends or is preempted (kv.prefix_cache), and moves a
preempted row's KV to the pool's CPU tier and back (swap preemption). It knows nothing of the
model: the runner makes the rows' empty cores and binds them.
"""

from __future__ import annotations

import functools

import torch

from ..kv import swap
from ..kv.block_manager import KVCacheFull
from ..kv.core import PagedKVCore
from ..kv.pool import KVPool


class RowKV:
    """KV accounting for the rows of one engine: `pool` the rows' pool, `cfg` the configuration
    (kv.prefix_cache, pool.cpu_tier_bytes, the zones), `ns` what keys the rows' K/V in the
    prefix cache besides their precision, tiles and dtype (the model), `bind(core)` binds an
    empty core to the pool for one sequence."""

    def __init__(self, pool: KVPool, cfg, ns: tuple, bind):
        self.pool, self.cfg, self._ns_base, self._bind = pool, cfg, ns, bind
        self.block_tokens = pool.key.block_tokens

    # --- counting ------------------------------------------------------------------------------

    def blocks_for(self, core: PagedKVCore | None, n: int) -> int:
        """Fresh blocks n more tokens of the row take (a row without KV: from nothing)."""
        if core is None or core.seqs is None:
            return -(-n // self.block_tokens)
        return core.seqs.blocks_needed(0, n)

    def decode_blocks(self, cores: list[PagedKVCore]) -> list[int]:
        """blocks_for(core, 1) of each row, in one pass: a block is due where the last one is
        full, or shared and partly filled (copy-on-write)."""
        bt, refcount = self.block_tokens, self.pool.manager.refcount
        out = []
        for core in cores:
            s = core.seqs
            n = s.lens[0]
            out.append(1 if not n % bt else int(refcount(s.blocks[0][-1]) > 1))
        return out

    def free_blocks(self) -> int:
        return self.pool.manager.num_available

    def step_blocks(self) -> tuple:
        """(the free blocks, a function giving those the prefix cache would give back, or
        None): a step's Budget asks the second only when a demand exceeds the first, since it
        walks the cache's hot nodes (the CPU machine, 64 calls at once with a full cache: a
        decode step 1.28 ms against 0.57 with the cache off, when every step asked)."""
        m = self.pool.manager
        return m.num_free, (m.reclaimer.reclaimable if m.reclaimer is not None else None)

    def total_blocks(self) -> int:
        m = self.pool.manager
        return m.num_blocks - m.first_id

    def release(self, core: PagedKVCore) -> None:
        core.release()

    # --- the prefix cache (kv.prefix_cache) ----------------------------------------------------

    def _prefix(self):
        """The pool's prefix cache, its zones set from the configuration; None when off."""
        kv = self.cfg.kv
        if not kv.prefix_cache:
            return None
        pc = self.pool.prefix_cache(kv.prefix_cache_bytes)
        if pc is not None:
            zones = self.cfg.pool
            self.pool.cpu_tier_of(zones, wait=False)  # (made beside the steps: it pins GiBs)
            pc.threshold, pc.hot_ratio = zones.migration_threshold, zones.hot_zone_ratio
        return pc

    def _ns(self, core: PagedKVCore) -> tuple:
        """The namespace of a row's K/V in the prefix cache: the model, precision, tiles and
        stored dtype (as generate()'s per-call prefix cache keys them)."""
        return (*self._ns_base, int(core.precision), core.tiles, core.kv_dtype)

    def start(self, core: PagedKVCore, tokens: list[int]) -> int:
        """A new row takes the prefix cache's blocks of its first tokens (at most all but the
        last, whose logits it draws from): their count, 0 on a miss."""
        with self.pool.lock:
            pc = self._prefix()
            if pc is None or len(tokens) < 2:
                return 0
            ns = self._ns(core)
            # a row about to give blocks back behind its window keeps its tokens' blocks first
            core.before_drop = functools.partial(self._keep_early, ns, list(tokens))
            pc.promote(ns, [tokens])
            bt = self.block_tokens
            take = min(len(pc.peek(ns, tokens)) * bt, len(tokens) - 1)
            blocks = pc.lookup(ns, tokens, use=take)
            if take > 0:
                self._bind(core)
                mine = blocks[: -(-take // bt)]
                self.pool.manager.incref(mine)
                core.seqs.blocks[0], core.seqs.lens[0] = list(mine), take
                core._grow_table(len(mine))
                core._table_host[0, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
                core.length = take
                core._lent = True  # (the device table is built by the step)
            pc.sweep()
        return take

    def keep(self, core: PagedKVCore | None, tokens: list[int]) -> None:
        """A row's whole blocks join the prefix cache (a later call, or the row itself after a
        preemption, starts on them); not a row that gave blocks back behind its window."""
        self.keep_many([(core, tokens)])

    def keep_many(self, rows: list[tuple[PagedKVCore | None, list[int]]]) -> None:
        """`keep` for the rows (core, tokens) that end at one step, in one insert: the room
        past the cache's budget is made once for all of them."""
        with self.pool.lock:
            pc = self._prefix()
            if pc is None:
                return
            items = []
            for core, tokens in rows:
                if core is None or core.seqs is None or core.pool is not self.pool:
                    continue
                seqs = core.seqs
                if seqs.dropped[0] or seqs.narrowed[0]:
                    continue
                n = min(len(tokens), seqs.lens[0])
                items.append((self._ns(core), tokens[:n], seqs.blocks[0]))
            if items:
                pc.insert_many(items)
                pc.sweep()

    def _keep_early(self, ns: tuple, tokens: list[int], core, rows: list[int]) -> None:
        """A core's before_drop (pool lock held): the row's first blocks join the prefix cache
        before its window lets them go (its tokens known at admission, as far as computed)."""
        pc, seqs = self.pool.prefix, core.seqs
        if pc is not None and seqs is not None and rows == [0]:
            pc.insert(ns, tokens[: min(len(tokens), seqs.lens[0])], seqs.blocks[0])

    # --- swap preemption (the pool's CPU tier: pool.cpu_tier_bytes) ----------------------------

    def swap_out(self, core: PagedKVCore, low: bool) -> int | None:
        """The row's KV to the CPU tier: the device blocks freed, or None (no tier, no room, a
        row in debug mode, or one that narrowed blocks behind its window: recomputed instead).
        On a GPU the first preemption starts making the tier beside the steps (pinning its GiBs
        stalled every running call for 1.3 s on an H100): until it is made, rows are recomputed;
        oxygen_torch.warm_up() makes it before the traffic comes."""
        if core.seqs is None or core.debug or not any(core.seqs.blocks):
            return None
        with self.pool.lock:
            if self.pool.cpu_tier_of(self.cfg.pool, wait=False) is None:
                return None
        return swap.swap_out(core, low_priority=low)

    def swap_in(self, core: PagedKVCore) -> bool:
        """A swapped row's KV back (the current stream waits for the copy); False: blocks short."""
        try:
            swap.swap_in(core)
        except KVCacheFull:
            return False
        return True

    def swapped_blocks(self, core: PagedKVCore) -> int:
        s = core._swapped
        return s.blocks_needed() if s is not None else 0
