"""Hot and cold zones of the prefix cache on the CPU tier (kv/prefix.py, kv/swap.py,
integrations/hf/prefix.py): cached blocks given back move down to the tier instead of being
dropped, and a hit brings them up.

Migration is checked byte for byte on the host backend; generate() on CPU-tier hits against the
same calls with the prefix cache off (float32, greedy: the same tokens), counting the tokens the
forward really embedded (test_prefix_cache.Counted)."""

from __future__ import annotations

import gc

import pytest
import torch
from test_engine import llama
from test_hf_generate import tiny
from test_prefix_cache import BT, Counted, _prompts, _reference, _tokens

from oxygen_torch import _patching
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import prefix as hf_prefix
from oxygen_torch.kv import pool as kv_pool
from oxygen_torch.kv.pool import PoolKey, get_pool, release_pools
from oxygen_torch.kv.swap import swap_out
from oxygen_torch.tools import metrics

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

MiB = 1 << 20


@pytest.fixture
def host_pool():
    key = PoolKey(torch.device("cpu"), 3, 2, 64, torch.float32, BT, "auto", 16 * MiB, 2 * MiB)
    pool = get_pool(key)
    yield pool
    with pool.lock:
        if pool.prefix is not None:
            pool.prefix.clear()
    release_pools()


def _fill(pool, blocks: list[int]) -> list[torch.Tensor]:
    """Random K/V in `blocks` of every layer; returns what was written, per K/V cache."""
    idx, out = torch.tensor(blocks), []
    for cache in (*pool.storage.k, *pool.storage.v):
        data = torch.randn(len(blocks), *cache.shape[1:])
        cache.index_copy_(0, idx, data)
        out.append(data)
    return out


def _cached(pool, ns, tokens_list: list[list[int]]) -> list[list[int]]:
    """Per chain, blocks that end the cache's chain: each sequence `tokens` held in fresh
    blocks with random K/V, inserted, then its sequence ends (only the cache holds them)."""
    out = []
    with pool.lock:
        for tokens in tokens_list:
            blocks = pool.manager.allocate(len(tokens) // BT)
            _fill(pool, blocks)
            assert pool.prefix.insert(ns, tokens, blocks) == len(blocks)
            pool.manager.decref(blocks)
            out.append(blocks)
    return out


def _held(pc, ns, tokens) -> int:
    """Nodes of the chain of `tokens` the cache still has, hot or cold."""
    return len(pc._walk(ns, tokens))


# --- the zones on a host pool ----------------------------------------------------------------


def test_demoted_blocks_come_back_byte_exact_in_one_transfer_each_way(host_pool):
    pool = host_pool
    tier = pool.cpu_tier(4 * MiB)
    pc = pool.prefix_cache(8 * MiB)
    assert pc.tier is tier  # made after the tier: attached
    seq = _tokens(1, 5 * BT + 3)
    with pool.lock:
        blocks = pool.manager.allocate(5)
    want = _fill(pool, blocks)
    with pool.lock:
        pc.insert("ns", seq, blocks)
        pool.manager.decref(blocks)
        assert pc.evict(5) == 5  # the pool asks them back: down to the tier, not dropped
    assert pool.manager.num_used == 0 and pc.peek("ns", seq) == []  # never a cold block
    st = pc.stats()
    assert (st["cold_blocks"], st["hot_blocks"], st["demoted"]) == (5, 0, 5)
    with pool.lock:  # someone else writes the freed blocks meanwhile
        other = pool.manager.allocate(5)
        _fill(pool, other)
        got = pc.promote("ns", [seq])
        back = pc.peek("ns", seq)
        pool.manager.decref(other)
    assert got == 5 and len(back) == 5 and not set(back) & set(other)
    for cache, data in zip((*pool.storage.k, *pool.storage.v), want):
        assert torch.equal(cache.index_select(0, torch.tensor(back)), data)
    t = tier.stats()
    assert (t["migrations_down"], t["migrations_up"]) == (1, 1)  # gathered, both ways
    assert t["bytes_down"] == t["bytes_up"] == 5 * tier.block_bytes and t["slots_used"] == 0
    assert pc.stats()["cold_blocks"] == 0


def test_promotion_is_cut_where_the_pool_has_no_room(host_pool):
    pool = host_pool
    pool.cpu_tier(4 * MiB)
    pc = pool.prefix_cache(8 * MiB)
    seq = _tokens(2, 4 * BT)
    _cached(pool, "ns", [seq])
    with pool.lock:
        assert pc.evict(4) == 4
        busy = pool.manager.allocate(pool.manager.num_free - 2)  # two blocks left
        assert pc.promote("ns", [seq]) == 2
        assert len(pc.peek("ns", seq)) == 2  # a shorter hit, the rest still cold
        assert pc.stats()["cold_blocks"] == 2 and _held(pc, "ns", seq) == 4
        pool.manager.decref(busy)


def test_threshold_sweep_moves_the_coldest_first_and_keeps_chain_heads(host_pool):
    """Three chains of three blocks: A read twice more, B once more, C never. Above the
    threshold the sweep moves C's and B's tails (LRU-K: C's were read once), not A's, and no
    chain's head even though C's head is colder than all of A; between the hot-zone ratio and
    the threshold nothing moves (hysteresis)."""
    pool = host_pool
    pool.cpu_tier(4 * MiB)
    pc = pool.prefix_cache(8 * MiB)
    m = pool.manager
    total = m.num_blocks - m.first_id
    pc.threshold, pc.hot_ratio = 16.5 / total, 15.5 / total  # in blocks: 16.5 and 15
    chains = {name: _tokens(10 + i, 3 * BT) for i, name in enumerate("ABC")}
    _cached(pool, "ns", [chains["C"], chains["B"], chains["A"]])
    for name in "AAB":
        pc.lookup("ns", chains[name])
    with pool.lock:
        busy = m.allocate(7)  # a call's blocks: 16 used, under the threshold
        assert pc.sweep() == 0
        busy += m.allocate(3)  # 19 used
        assert pc.sweep() == 4 and m.num_used == 15
        hot = {name: len(pc.peek("ns", chains[name])) for name in "ABC"}
        busy += m.allocate(1)  # 16: above the ratio, under the threshold
        assert pc.sweep() == 0
        busy += m.allocate(1)  # 17: back down to 15, A's tail next
        assert pc.sweep() == 2
        heads = {name: len(pc.peek("ns", chains[name])) for name in "ABC"}
        m.decref(busy)
    assert hot == {"A": 3, "B": 1, "C": 1}
    assert heads == {"A": 1, "B": 1, "C": 1}
    assert all(_held(pc, "ns", c) == 3 for c in chains.values())  # moved, not dropped
    assert pc.stats()["cold_blocks"] == 6 and pc.counts["evicted"] == 0


def test_heads_go_down_last_when_everything_must(host_pool):
    pool = host_pool
    pool.cpu_tier(4 * MiB)
    pc = pool.prefix_cache(8 * MiB)
    a, b = _tokens(20, 2 * BT), _tokens(21, 2 * BT)
    ((a0, a1), (b0, b1)) = _cached(pool, "ns", [a, b])
    pc.lookup("ns", a)
    pc.lookup("ns", a)  # a's tail is hotter than b's head: the head goes down after it all
    with pool.lock:
        assert pc.demote(2) == 2  # both tails, a1 although it is hotter than b0
        assert pc.peek("ns", a) == [a0] and pc.peek("ns", b) == [b0]
        assert pc.demote(1) == 1 and pc.peek("ns", b) == []  # then the colder head
        assert pc.demote(1) == 1 and pc.stats()["hot_blocks"] == 0


def test_a_full_tier_drops_cold_nodes_lru_k_with_one_warning(host_pool, caplog):
    _patching.forget_warnings()
    pool = host_pool
    tier = pool.cpu_tier(3 * pool.block_bytes())
    assert tier.num_slots == 3
    pc = pool.prefix_cache(8 * MiB)
    seqs = {name: _tokens(30 + i, BT) for i, name in enumerate("WXYZ")}
    _cached(pool, "ns", [seqs[n] for n in "WXYZ"])
    for name in "XXWYY":  # LRU-K: Z (read once) goes first, then W (2nd-last read oldest), X
        pc.lookup("ns", seqs[name])
    with pool.lock:
        assert pc.demote(3) == 3  # Z, W, X: the tier is full
        assert [n for n in "WXYZ" if pc.peek("ns", seqs[n])] == ["Y"]
        assert pc.demote(1) == 1  # Y down: the coldest cold node (Z) makes room
    assert [n for n in "WXYZ" if _held(pc, "ns", seqs[n])] == ["W", "X", "Y"]
    assert pc.stats()["cold_blocks"] == 3 and pc.counts["evicted"] == 1
    assert not [r for r in caplog.records if "CPU tier is full" in r.getMessage()]
    # cold nodes that cannot go (each a parent of a node still there): the block is dropped
    with pool.lock:
        pc.clear()
    chain, lone = _tokens(40, 4 * BT), _tokens(41, BT)
    ((c0, c1, c2, c3), (d,)) = _cached(pool, "ns", [chain, lone])
    with pool.lock:
        pool.manager.incref([c3])  # a sequence holds the chain's tail: it stays hot
        pc.lookup("ns", lone)
        pc.lookup("ns", lone)
        assert pc.demote(3) == 3  # c1, c2, then the head c0: all three slots
        assert pc.evict(1) == 1  # the pool asks: no slot, none to drop: the lone block goes
        assert pc.peek("ns", lone) == [] and _held(pc, "ns", chain) == 4
        pool.manager.decref([c3])
    full = [r for r in caplog.records if "CPU tier is full" in r.getMessage()]
    assert len(full) == 1


# --- a swap-out comes first --------------------------------------------------------------------


def test_a_swap_out_takes_the_slots_of_cold_cached_blocks(oxygen):
    model = hf.apply(llama(seed=3))
    ids = torch.randint(1, 128, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    core = out.past_key_values._core
    pool = core.pool
    own = len({b for row in core.seqs.blocks for b in row})
    block_bytes = pool.block_bytes()
    tier = pool.cpu_tier((own + 1) * block_bytes)
    pc = pool.prefix_cache(64 * MiB)
    seqs = [_tokens(50 + i, BT) for i in range(own + 1)]
    _cached(pool, "ns", seqs)
    for s in seqs[1:]:
        pc.lookup("ns", s)  # seqs[0] is the LRU-K coldest
    with pool.lock:
        assert pc.evict(own + 1) == own + 1 and tier.num_free == 0
    assert swap_out(core) > 0  # it got its slots: the coldest cold nodes dropped
    assert [_held(pc, "ns", s) for s in seqs] == [0] * own + [1]
    assert pc.stats()["cold_blocks"] == 1
    core.release()


# --- generate() on CPU-tier hits -----------------------------------------------------------------


def _pool_obj():
    (pool,) = [p for p in kv_pool._pools.values() if p.prefix is not None]
    return pool


def _all_down(pool) -> int:
    """Moves every cached block to the CPU tier (the calls' caches are gone; on a GPU the
    engine makes the tier beside its steps: waited for)."""
    pool.wait_tier_ahead(30)
    gc.collect()
    with pool.lock:
        n = pool.prefix.num_hot
        assert pool.prefix.evict(n) == n
        assert pool.manager.num_used == 0
    return n


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cpu_tier_hits_give_the_tokens_of_misses_and_gpu_hits(arch, oxygen):
    system = [t % 127 + 1 for t in _tokens(3, 2 * BT + 5)]
    ids, mask = _prompts(4, system, users=[9, 20, 5], pads=[3, 0, 6])
    greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    beams = dict(input_ids=ids[1:], attention_mask=mask[1:], max_new_tokens=4, num_beams=3,
                 num_return_sequences=2, do_sample=False, length_penalty=1.0)  # fmt: skip
    ref, ref_beams = _reference(arch, [greedy, beams])
    cfg = load_config(prefix_cache=True, pool={"cpu_tier_bytes": 64 * MiB})
    model = hf.apply(tiny(arch), cfg)
    seen = Counted(model)
    with torch.no_grad():
        miss = model.generate(**greedy)
        n_miss = seen.take()
        gpu = model.generate(**greedy)
        n_gpu = seen.take()
        pool = _pool_obj()
        cold = _all_down(pool)
        cpu = model.generate(**greedy)
        n_cpu = seen.take()
        st = pool.prefix.stats()
        assert st["cpu_hit_blocks"] > 0 and st["promoted"] > 0
        _all_down(pool)
        hit_beams = model.generate(**beams)
    assert torch.equal(miss, ref) and torch.equal(gpu, ref) and torch.equal(cpu, ref)
    assert torch.equal(hit_beams, ref_beams)
    assert n_cpu == n_gpu < n_miss  # the CPU-tier hit skips the same columns as a GPU hit
    assert cold > 0
    gc.collect()
    st = pool.prefix.stats()
    assert pool.manager.num_used == st["hot_blocks"]  # nothing else holds a block: no leak
    assert pool.tier.stats()["slots_used"] == st["cold_blocks"]


def test_zone_sweep_and_hot_zone_hit_ratio_on_a_scripted_sequence(oxygen):
    """Rows share nothing (no system prompt). Call 1 fills the cache; call 2 (another prompt)
    finds the pool above a tiny threshold and its sweep moves call 1's blocks down; call 3 (call
    1 again) hits them in the CPU tier, call 4 (the same) on the GPU: half the hit blocks came
    from the tier."""
    # padding of a whole block: no row takes part of a block (whose copy-on-write would leave
    # the cached block to the sweep, and call 4 would find it cold again)
    a_ids, a_mask = _prompts(60, [], users=[40, 24], pads=[0, BT])
    b_ids, b_mask = _prompts(61, [], users=[33], pads=[0])
    kw_a = dict(input_ids=a_ids, attention_mask=a_mask, max_new_tokens=3, do_sample=False)
    kw_b = dict(input_ids=b_ids, attention_mask=b_mask, max_new_tokens=3, do_sample=False)
    ref_a, ref_b = _reference("llama", [kw_a, kw_b])
    cfg = load_config(
        prefix_cache=True,
        pool={"cpu_tier_bytes": 64 * MiB, "migration_threshold": 1e-6, "hot_zone_ratio": 1e-6},
    )
    model = hf.apply(tiny("llama"), cfg)
    with torch.no_grad():
        assert torch.equal(model.generate(**kw_a), ref_a)
        gc.collect()
        assert torch.equal(model.generate(**kw_b), ref_b)  # its start sweeps call 1's down
        pool = _pool_obj()
        st = pool.prefix.stats()
        assert st["cold_blocks"] > 0 and st["demoted"] == st["cold_blocks"]
        assert torch.equal(model.generate(**kw_a), ref_a)
        st = pool.prefix.stats()
        assert st["gpu_hit_blocks"] == 0 and st["cpu_hit_blocks"] > 0
        assert torch.equal(model.generate(**kw_a), ref_a)
    st = pool.prefix.stats()
    # row r takes min(L - pad_r, its whole blocks) tokens, L = the columns every row has
    pads, real = (a_mask == 0).sum(1).tolist(), a_mask.sum(1).tolist()
    cols = min(min(p + r // BT * BT for p, r in zip(pads, real)), a_ids.shape[1] - 1)
    per_call = sum(-(-max(0, cols - p) // BT) for p in pads)
    assert per_call == 3 and st["cpu_hit_blocks"] == st["gpu_hit_blocks"] == per_call
    assert st["hot_zone_hit_ratio"] == 0.5
    text = metrics.scrape()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("oxygen:hot_zone_hit_ratio{")]
    assert float(line.split()[-1]) == 0.5
    series = 'oxygen:prefix_cache_hit_blocks_total{device="0",zone="cpu"}'
    (line,) = [ln for ln in text.splitlines() if ln.startswith(series)]
    assert float(line.split()[-1]) == per_call


def test_a_pool_without_a_tier_drops_as_before(host_pool):
    pool = host_pool
    pc = pool.prefix_cache(8 * MiB)
    seq = _tokens(70, 3 * BT)
    _cached(pool, "ns", [seq])
    pc.threshold = pc.hot_ratio = 1e-6
    with pool.lock:
        assert pc.sweep() == 0 and pc.promote("ns", [seq]) == 0
        assert pc.evict(3) == 3
    assert len(pc) == 0 and pool.manager.num_used == 0 and pc.stats()["demoted"] == 0


def _seq_blocks(pool, seed: int, n: int) -> tuple[list[int], list[int], list[torch.Tensor]]:
    tokens = _tokens(seed, n * BT)
    with pool.lock:
        blocks = pool.manager.allocate(n)
    return tokens, blocks, _fill(pool, blocks)


@pytest.mark.parametrize("tier", [True, False])
def test_a_long_insert_into_a_full_cache_makes_its_room_in_one_go(host_pool, tier):
    """A sequence past the budget makes room once (one eviction, one transfer down), not a
    block at a time: 64 calls of ~450 tokens ending together into a full cache took 3.9-6.5 s
    that way on the H200. What goes is still the coldest (chain heads last); the new sequence
    is all kept; demoted blocks come back byte-exact."""
    pool = host_pool
    if tier:
        pool.cpu_tier(4 * MiB)
    pc = pool.prefix_cache(8 * MiB)
    pc.budget = 6
    calls = []
    evict = pc.evict
    pc.evict = lambda n, protect=frozenset(): calls.append(n) or evict(n, protect)
    a, a_blocks, a_data = _seq_blocks(pool, 1, 4)
    b, b_blocks, _ = _seq_blocks(pool, 2, 4)
    with pool.lock:
        assert pc.insert("ns", a, a_blocks) == 4 and calls == []
        pool.manager.decref(a_blocks)  # A's call ended: only the cache holds its blocks
        assert pc.insert("ns", b, b_blocks) == 4
        pool.manager.decref(b_blocks)
    assert calls == [2] and pc.num_hot == 6
    assert pc.peek("ns", b) == b_blocks  # the new sequence whole
    # two of A's blocks went (down to the tier, or dropped leaves first); its head stayed
    hot_a = [nd.block for nd in pc._walk("ns", a) if nd.slot is None]
    assert len(hot_a) == 2 and a_blocks[0] in hot_a
    assert _held(pc, "ns", a) == (4 if tier else 2)
    c, c_blocks, _ = _seq_blocks(pool, 3, 8)  # longer than the budget: its first 6 kept
    with pool.lock:
        assert pc.insert("ns", c, c_blocks) == 6
        pool.manager.decref(c_blocks)
    assert calls == [2, 6] and pc.num_hot == 6 and pc.peek("ns", c) == c_blocks[:6]
    if not tier:
        assert pc.peek("ns", a) == pc.peek("ns", b) == [] and len(pc) == 6
        assert pc.stats()["demoted"] == 0 and pool.manager.num_used == 6
        return
    assert pool.tier.stats()["migrations_down"] == 2  # one transfer down per insert
    assert _held(pc, "ns", a) == 4 and _held(pc, "ns", b) == 4  # cold, not dropped
    with pool.lock:
        pc.budget = 16
        assert pc.promote("ns", [a]) == 4
        back = pc.peek("ns", a)
    for cache, data in zip((*pool.storage.k, *pool.storage.v), a_data):
        assert torch.equal(cache.index_select(0, torch.tensor(back)), data)


# --- on the GPU, for the lead ------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_cpu_tier_hit_gives_the_tokens_of_a_gpu_hit(arch, oxygen):
    """The pinned tier, its side stream and the device gather/scatter: cached blocks that went
    down and came back hold the same bytes, and a hit on them gives the tokens a hit on the
    device gave (debug_checks: every block id a kernel gets is checked against mapped pages)."""
    system = [t % 127 + 1 for t in _tokens(80, 3 * BT)]
    ids, mask = _prompts(81, system, users=[9, 20], pads=[4, 0])
    kw = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=8,
              do_sample=False)  # fmt: skip
    cfg = load_config(
        prefix_cache=True,
        pool={"cpu_tier_bytes": 64 * MiB},
        kv={"debug_checks": True},
        kernel={"precision": "fp32_safe"},
    )
    model = hf.apply(tiny(arch).cuda(), cfg)
    with torch.no_grad():
        miss = model.generate(**kw)
        gpu = model.generate(**kw)
        pool = _pool_obj()
        torch.cuda.synchronize()
        gc.collect()
        chains = [row[p:].tolist() for row, p in zip(ids, (mask == 0).sum(1).tolist())]
        # this model's namespace (a model of an earlier test may have left its own in the pool)
        (ns,) = [n for n in pool.prefix._roots if n[0] == hf_prefix._serial(model)]
        with pool.lock:
            blocks = pool.prefix.peek(ns, chains[1])
        idx = torch.tensor(blocks, device="cuda")
        before = [c.index_select(0, idx).cpu() for c in (*pool.storage.k, *pool.storage.v)]
        _all_down(pool)
        cpu = model.generate(**kw)
        with pool.lock:
            back = torch.tensor(pool.prefix.peek(ns, chains[1]), device="cuda")
        after = [c.index_select(0, back).cpu() for c in (*pool.storage.k, *pool.storage.v)]
    assert pool.tier.host.is_pinned()
    assert pool.prefix.stats()["cpu_hit_blocks"] > 0 and len(back) == len(blocks) > 0
    for b, a in zip(before, after):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(cpu, gpu)
    print(f"\n{arch}: CPU-tier hit == miss: {torch.equal(cpu, miss)}")
