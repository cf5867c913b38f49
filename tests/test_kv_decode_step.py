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


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_part_a_kernel_reads_starts_16_byte_aligned_whatever_the_counts(seed):
    """Triton specialises a kernel on each pointer's 16-byte alignment: a step's lengths packed
    right after its slots were aligned only when the step's token count was a multiple of 4, so
    a first unaligned step compiled a second kernel mid-run (1.3 s on the H200). Every part of a
    packed upload starts aligned and holds the plan's values, for merged steps (the engine's
    prefill and mixed steps) and a core's own decode and prefill steps."""
    rnd = random.Random(seed)
    held = []
    try:
        for _ in range(12):  # merged steps of random rows, prefill chunks and decodes
            cores = [_core(rnd.randint(1, 40)) for _ in range(rnd.randint(1, 7))]
            held += cores
            counts = [rnd.choice([1, rnd.randint(1, 37)]) for _ in cores]
            step = MergedStep([Part(c, [n], n) for c, n in zip(cores, counts)])
            with step.pool.lock:
                step.reserve(build=False)
            table, slots, lens, got_counts = step.host_plan()
            step.build()
            plan = step._plan
            assert _aligned(step.seq_lens) and _aligned(plan.slot_mapping)
            assert step.seq_lens.tolist() == lens and plan.slot_mapping.tolist() == slots
            if any(n > 1 for n in counts):
                cu = plan.cu_seqlens_q
                assert _aligned(cu)
                assert cu.tolist() == [sum(got_counts[:i]) for i in range(len(counts) + 1)]
            step.commit()
        for _ in range(6):  # a core's own steps: batch rows, q tokens each (q 1: decode)
            batch, q = rnd.randint(1, 7), rnd.choice([1, rnd.randint(2, 23)])
            core = PagedKVCore(2, block_tokens=BT, arena_bytes=8 << 20)
            held.append(core)
            k = torch.randn(batch, 1, q, 64)
            for layer in range(2):
                plan = core.write(layer, k, k)
            assert _aligned(plan.slot_mapping) and _aligned(core.seq_lens)
            assert core.seq_lens.tolist() == [q] * batch
            assert plan.slot_mapping.shape[0] == batch * q
            if q > 1:
                assert _aligned(plan.cu_seqlens_q)
                assert plan.cu_seqlens_q.tolist() == [q * i for i in range(batch + 1)]
    finally:
        for c in held:
            c.release()
        release_pools()
        assert pool_stats() == []


@pytest.mark.parametrize("seed", [0, 1])
def test_a_cores_own_step_short_of_blocks_takes_none_and_leaves_every_row_as_it_was(seed):
    """A core's own forward (a lone call's) reserves its rows together: short of blocks it
    raises before any row takes one, so the same forward can run again later (through the
    scheduler) from the state it had."""
    from oxygen_torch.kv.block_manager import KVCacheFull

    rnd = random.Random(seed)
    batch = rnd.randint(3, 6)
    core = PagedKVCore(2, block_tokens=BT, arena_bytes=8 << 20)
    k = torch.randn(batch, 1, BT - 1, 64)
    try:
        for layer in range(2):
            core.write(layer, k, k)  # every row one token short of a full block
        pool = core.pool
        with pool.lock:
            hog = pool.manager.allocate(pool.manager.num_available - rnd.randint(1, batch - 1))
        lens, blocks = list(core.seqs.lens), [list(b) for b in core.seqs.blocks]
        step = torch.randn(batch, 1, 2, 64)  # two tokens a row: each row needs a new block
        with pytest.raises(KVCacheFull, match="block"):
            core.write(0, step, step)
        assert core.seqs.lens == lens and [list(b) for b in core.seqs.blocks] == blocks
        with pool.lock:
            pool.manager.decref(hog)
        for layer in range(2):  # with room, the same forward goes through
            core.write(layer, step, step)
        assert core.seqs.lens == [n + 2 for n in lens]
    finally:
        core.release()
        release_pools()
        assert pool_stats() == []


@pytest.mark.parametrize("seed", [0, 1])
def test_a_merged_steps_prefill_slots_equal_the_block_lists(seed):
    """Chunks of 1 to 300 tokens after prefixes of any length (short chunks a Python step a
    token, long ones through numpy): every new token's slot is its block's id x block_tokens +
    its offset, read off the row's block list."""
    rnd = random.Random(seed * 7919 + int(torch.randint(0, 1000, (1,))))
    cores = [_core(rnd.randint(1, 90)) for _ in range(rnd.randint(2, 6))]
    try:
        for _ in range(4):
            counts = [rnd.choice([1, rnd.randint(2, 63), rnd.randint(64, 300)]) for _ in cores]
            starts = [c.seqs.lens[0] for c in cores]
            step = MergedStep([Part(c, [n], n) for c, n in zip(cores, counts)])
            with step.pool.lock:
                step.reserve(build=False)
            _, slots, lens, got_counts = step.host_plan()
            want = []
            for c, n0, n in zip(cores, starts, counts):
                row = c.seqs.blocks[0]
                want += [row[t // BT] * BT + t % BT for t in range(n0, n0 + n)]
            assert slots == want and got_counts == counts
            assert lens == [n0 + n for n0, n in zip(starts, counts)]
            step.commit()
    finally:
        for c in cores:
            c.release()
        release_pools()
        assert pool_stats() == []
