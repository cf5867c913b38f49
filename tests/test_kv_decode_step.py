"""The engine's DecodeStep plans what a step reads (table, slots, lengths) from numpy copies of
each core's block ids: against the plain lists, over many steps of cores that take new blocks,
share a last block (copy-on-write), give tokens back (an abandoned step) and come and go."""

from __future__ import annotations

import random

import pytest
import torch

from oxygen_torch.kv.core import PagedKVCore
from oxygen_torch.kv.decode_step import DecodeStep
from oxygen_torch.kv.merged import MergedStep, Part
from oxygen_torch.kv.pool import pool_stats, release_pools
from oxygen_torch.kv.storage import GUARD_BLOCK

BT = 16


def _core(tokens: int) -> PagedKVCore:
    core = PagedKVCore(2, block_tokens=BT, arena_bytes=8 << 20)
    core.bind(1, 1, 64, torch.float32, "cpu")
    step = MergedStep([Part(core, [tokens], tokens)])
    with step.pool.lock:
        step.reserve(build=False)
    step.commit()
    return core


def _expected(cores, starts):
    lists = [c.seqs.blocks[0] for c in cores]
    width = max(map(len, lists))
    table = [[*b, *[GUARD_BLOCK] * (width - len(b))] for b in lists]
    slots = [b[n // BT] * BT + n % BT for b, n in zip(lists, starts)]
    return table, slots, [n + 1 for n in starts]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_step_plan_equals_the_block_lists_through_changes(seed):
    rnd = random.Random(seed)
    cores = [_core(rnd.randint(1, 70)) for _ in range(rnd.randint(3, 9))]
    held = list(cores)
    try:
        for it in range(60):
            starts = [c.seqs.lens[0] for c in cores]
            step = DecodeStep(cores)
            with step.pool.lock:
                step.reserve(build=False)
            table, slots, lens, counts = step.host_plan()
            want = _expected(cores, starts)
            assert (table.tolist(), slots, lens) == want, it
            assert counts == [1] * len(cores) and table.dtype == torch.int32
            if rnd.random() < 0.15:
                step.abandon()  # the lists shrink back
                assert [c.seqs.lens[0] for c in cores] == starts
                continue
            step.commit()
            pick = rnd.random()
            if pick < 0.1:  # a fork shares the last block: the next step copies it (same length)
                twin = cores[rnd.randrange(len(cores))].fork()
                cores.append(twin)
                held.append(twin)
            elif pick < 0.2 and len(cores) > 2:  # a row leaves, another joins
                cores.pop(rnd.randrange(len(cores)))
                fresh = _core(rnd.randint(1, 40))
                cores.insert(rnd.randrange(len(cores) + 1), fresh)
                held.append(fresh)
            elif pick < 0.3:
                rnd.shuffle(cores)
    finally:
        for c in held:
            c.release()
        release_pools()  # (no pool left open for later tests)
        assert pool_stats() == []


def test_a_step_short_of_blocks_takes_none_and_leaves_every_row_as_it_was():
    """Rows whose blocks are full take their new blocks together: when the pool cannot give
    them, reserve raises and every row (those with room included) keeps its length and blocks."""
    from oxygen_torch.kv.block_manager import KVCacheFull

    cores = [_core(BT), _core(5), _core(2 * BT), _core(7)]  # two full, two with room
    try:
        pool = cores[0].pool
        with pool.lock:
            hog = pool.manager.allocate(pool.manager.num_available - 1)  # one block left
        lens = [c.seqs.lens[0] for c in cores]
        blocks = [list(c.seqs.blocks[0]) for c in cores]
        step = DecodeStep(cores)
        with step.pool.lock, pytest.raises(KVCacheFull):
            step.reserve(build=False)
        assert [c.seqs.lens[0] for c in cores] == lens
        assert [c.seqs.blocks[0] for c in cores] == blocks
        with pool.lock:
            pool.manager.decref(hog)
        step = DecodeStep(cores)  # with room, the same step goes through
        with step.pool.lock:
            step.reserve(build=False)
        assert [c.seqs.lens[0] for c in cores] == [n + 1 for n in lens]
    finally:
        for c in cores:
            c.release()
        release_pools()
        assert pool_stats() == []
