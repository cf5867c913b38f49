"""The prefix cache's memoized walks (kv/prefix.py `_walk`): every mutation that adds or removes a
node -- insert, demote (a full tier drops cold nodes), drop_cold, evict, clear -- must leave no
stale walk behind.

On the cache itself, a random script of mutations and lookups on fresh random tokens, each
lookup checked against a walk of the node dict with no memo (blocks found and hit/miss counts);
through generate(), later hits after each mutation give the tokens of the same calls with the
prefix cache off, and the hit/miss counts say what was found."""

from __future__ import annotations

import random

import pytest
import torch
from test_hf_generate import tiny
from test_prefix_cache import BT, _prompts, _reference, _tokens

from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool as kv_pool
from oxygen_torch.kv.pool import PoolKey, get_pool, release_pools

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

MiB = 1 << 20


@pytest.fixture
def tier_pool():
    """A host pool with a CPU tier of 24 blocks and a prefix cache."""
    key = PoolKey(torch.device("cpu"), 2, 2, 64, torch.float32, BT, "auto", 16 * MiB, 2 * MiB)
    pool = get_pool(key)
    pool.cpu_tier(24 * pool.block_bytes())
    pool.prefix_cache(8 * MiB)
    yield pool
    with pool.lock:
        pool.prefix.clear()
    release_pools()


def _truth(pc, ns, tokens, cold: bool = False) -> list[int]:
    """Device blocks of the longest hot cached prefix (cold: hot or cold nodes, their blocks
    COLD), from the node dict alone (no memo)."""
    parent, out = pc._roots.get(ns), []
    for i in range(len(tokens) // BT):
        node = pc._nodes.get((parent, tuple(tokens[i * BT : (i + 1) * BT])))
        if node is None or (node.slot is not None and not cold):
            break
        out.append(node.block)
        parent = node.id
    return out


def _reclaimable_truth(pc) -> tuple[int, set[int]]:
    """PrefixCache.reclaimable() and _free_subtrees() from the node dict alone, children before
    parents (ids grow with insertion): a node is busy when a sequence shares its block or a
    descendant's."""
    refcount, busy = pc.manager.refcount, set()
    for node in sorted(pc._by_id.values(), key=lambda n: -n.id):
        if node.id in busy or (node.slot is None and refcount(node.block) > 1):
            busy.add(node.id)
            busy.add(node.parent)
    hot = [n for n in pc._by_id.values() if n.slot is None]
    drop = sum(n.id not in busy for n in hot)
    single = sum(refcount(n.block) == 1 for n in hot)
    leaves = sum(n.slot is not None and not n.children for n in pc._by_id.values())
    return max(drop, min(single, pc.tier.num_free + leaves)), set(pc._by_id) - busy


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_mutation_leaves_a_stale_walk(tier_pool, seed):
    """Also: the hot nodes' index and reclaimable() stay true to the node dict, sequences
    holding (sharing) cached blocks now and then."""
    pool, pc, rng = tier_pool, tier_pool.prefix, random.Random(seed)
    system = _tokens(100 + seed, 3 * BT)
    rows = [system + _tokens(200 + 10 * seed + i, rng.randrange(BT, 4 * BT)) for i in range(5)]
    rows.append(_tokens(300 + seed, 2 * BT + 3))  # shares nothing
    hits = misses = 0
    held: list[int] = []  # blocks a running sequence shares with the cache
    for step in range(120):
        op = rng.choice(
            ["insert", "lookup", "lookup", "demote", "drop", "evict", "promote", "hold"]
        )
        if step % 40 == 39:
            op = "clear"
        row = rng.choice(rows)
        row = row[: rng.randrange(BT, len(row) + 1)]
        with pool.lock:
            if op == "insert":  # a finished sequence: fresh blocks, only the cache keeps them
                blocks = pool.manager.allocate(len(row) // BT)
                pc.insert("ns", row, blocks)
                pool.manager.decref(blocks)
            elif op == "demote":
                pc.demote(rng.randrange(1, 8))
            elif op == "drop":
                pc.drop_cold(rng.randrange(1, 8))
            elif op == "evict":
                pc.evict(rng.randrange(1, 8))
            elif op == "promote":
                pc.promote("ns", [row, rng.choice(rows)])
            elif op == "clear":
                pc.clear()
            elif op == "hold":  # a sequence starts on the row's cached blocks, or one ends
                if held and rng.random() < 0.5:
                    pool.manager.decref(held)
                    held = []
                else:
                    got = pc.peek("ns", row)  # its tail only at times (a window's row)
                    got = got[rng.randrange(len(got)) :] if got else got
                    pool.manager.incref(got)
                    held += got
            assert pc._hot_nodes == {i: n for i, n in pc._by_id.items() if n.slot is None}, step
            assert (pc.reclaimable(), pc._free_subtrees()) == _reclaimable_truth(pc), (step, op)
            want = _truth(pc, "ns", row)
            assert pc.peek("ns", row) == want, (step, op)
            assert pc.lookup("ns", row) == want, (step, op)
            hits, misses = hits + bool(want), misses + (not want)
            assert (pc.counts["hits"], pc.counts["misses"]) == (hits, misses)
            assert len(pc._nodes) == len(pc._by_id)
    assert hits > 10 and misses > 10  # the script found both
    with pool.lock:
        pool.manager.decref(held)


def test_a_walk_remembered_before_an_insert_goes_on_past_its_end(tier_pool):
    """A row walked while only its first block was cached, then the rest of its chain inserted
    (another call that finished it): the row's next walk finds every block, not the one it
    remembered, and an insert of other tokens leaves the remembered walk right as far as it
    goes."""
    pool, pc = tier_pool, tier_pool.prefix
    row = _tokens(400, 3 * BT + 2)
    other = row[:BT] + _tokens(401, 2 * BT)  # shares the first block
    with pool.lock:
        first = pool.manager.allocate(1)
        pc.insert("ns", row[:BT], first)
        assert pc.lookup("ns", row) == first
        blocks = pool.manager.allocate(3)
        assert pc.insert("ns", row, blocks) == 2  # (the first block was cached)
        assert pc.peek("ns", row) == first + blocks[1:] == _truth(pc, "ns", row)
        assert pc.lookup("ns", row) == first + blocks[1:]
        others = pool.manager.allocate(3)
        assert pc.insert("ns", other, others) == 2
        assert pc.lookup("ns", row) == first + blocks[1:]
        assert pc.lookup("ns", other) == first + others[1:3] == _truth(pc, "ns", other)
        pool.manager.decref(first + blocks + others)


# --- through generate() ------------------------------------------------------------------


def _mutate(pool, how: str) -> int:
    """Between two calls: gives cached blocks back one of the ways a node goes or moves;
    returns how many nodes it moved or removed."""
    pc = pool.prefix
    with pool.lock:
        if how == "demote":
            return pc.demote(pc.num_hot)
        if how == "drop":  # down, then cold leaves dropped: chains lose their tails
            pc.demote(pc.num_hot)
            return pc.drop_cold(max(1, pc.num_cold // 2))
        if how == "evict":
            return pc.evict(max(1, pc.num_hot // 2))
        return pc.clear()


def _expected_hits(pc, kw) -> int:
    """Rows of the call that will take cached columns, from a walk of the node dict (cold
    nodes count: the call promotes them first; the pool has room): integrations/hf/prefix.py's
    rule, L = min over rows of padding + cached tokens, at most width - 1."""
    (ns,) = pc._roots
    mask = kw["attention_mask"]
    pads = (mask == 0).sum(1).tolist()
    rows = [r[p:] for r, p in zip(kw["input_ids"].tolist(), pads)]
    found = [len(_truth(pc, ns, r, cold=True)) * BT for r in rows]
    cols = max(0, min(min(p + f for p, f in zip(pads, found)), mask.shape[1] - 1))
    return sum(cols - p > 0 for p in pads)


@pytest.mark.parametrize("how", ["demote", "drop", "evict", "clear"])
def test_hits_after_each_mutation_give_the_tokens_of_misses(oxygen, how):
    g = torch.Generator().manual_seed(len(how))
    system = torch.randint(1, 128, (3 * BT + 5,), generator=g).tolist()
    calls = []
    for i in range(4):  # a call per turn, each a new user turn behind the same system prompt
        ids, mask = _prompts(40 + i, system, users=[7 + 5 * i, 11], pads=[0, 3])
        calls.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False))
    ref = _reference("llama", calls)
    model = hf.apply(tiny("llama"), load_config(prefix_cache=True, pool={"cpu_tier_bytes": MiB}))
    out, hits, misses = [], 0, 0
    with torch.no_grad():
        for i, kw in enumerate(calls):
            pool = next((p for p in kv_pool._pools.values() if p.prefix is not None), None)
            if i:
                if how != "clear" or i == 1:  # (a clear before every call: never a hit)
                    assert _mutate(pool, how) > 0
                want = _expected_hits(pool.prefix, kw)
                hits, misses = hits + want, misses + 2 - want
                before = dict(pool.prefix.counts)
            out.append(model.generate(**kw))
            if i:
                c = pool.prefix.counts
                assert c["hits"] - before["hits"] == want, (i, how)
                assert c["misses"] - before["misses"] == 2 - want, (i, how)
    for got, exp in zip(out, ref):
        assert torch.equal(got, exp)
    assert hits > 0  # later calls found the system prompt (after clear: the call before's)
