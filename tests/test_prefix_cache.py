"""The prefix cache (kv/prefix.py, integrations/hf/prefix.py): KV blocks of finished prompts found
again by token content across generate() calls.

Every generate() test compares against the same call with the prefix cache off (float32, CPU,
greedy or a fixed seed: the same tokens), counts the tokens the forward really embedded, and
reads the hit/miss figures."""

from __future__ import annotations

import pytest
import torch
from test_engine import in_threads, schedulers
from test_hf_generate import tiny

from oxygen_torch import _patching
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import prefix as hf_prefix
from oxygen_torch.kv import BlockManager, pool_stats
from oxygen_torch.kv import pool as kv_pool
from oxygen_torch.kv.prefix import PrefixCache

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

BT = 16


# --- the cache itself ----------------------------------------------------------------------


def _tokens(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (n,), generator=g).tolist()


def test_chained_keys_find_the_longest_cached_prefix():
    m = BlockManager(64, first_id=1)
    pc = PrefixCache(m, BT, budget=32)
    a = _tokens(0, 3 * BT + 5)
    blocks = m.allocate(4)
    assert pc.insert("ns", a, blocks) == 3  # whole blocks only
    assert [m.refcount(b) for b in blocks] == [2, 2, 2, 1]
    assert pc.lookup("ns", a) == blocks[:3]
    assert pc.lookup("ns", a[: 2 * BT + 3]) == blocks[:2]
    b = list(a)
    b[BT + 4] += 1  # a change in block 1: block 2 is not found either (its key holds block 1)
    assert pc.lookup("ns", b) == blocks[:1]
    c = list(a)
    c[0] += 1  # the same later blocks behind another first block: nothing
    assert pc.lookup("ns", c) == []
    assert pc.lookup("other model", a) == []
    assert pc.counts["hits"] == 3 and pc.counts["misses"] == 2
    assert pc.counts["hit_tokens"] == (3 + 2 + 1) * BT
    m.decref(blocks)
    assert pc.clear() == 3 and m.num_used == 0


def test_lru_k_evicts_once_read_blocks_before_twice_read_ones():
    """Scripted: A and B each one block, read twice; C and D read once. LRU would evict A (its
    last read is the oldest); LRU-2 evicts the once-read C first, then D, then A, then B."""
    m = BlockManager(64, first_id=1)
    pc = PrefixCache(m, BT, budget=4)
    seqs = {name: _tokens(i + 10, BT) for i, name in enumerate("ABCD")}
    held = {}
    for name in "ABCD":
        (held[name],) = m.allocate(1)
        pc.insert("ns", seqs[name], [held[name]])
        m.decref([held[name]])  # the sequence ended: only the cache holds it
    pc.lookup("ns", seqs["A"])  # A, B read a second time; A's second read is the oldest
    pc.lookup("ns", seqs["B"])
    order = []
    for _ in range(4):
        before = {n for n in "ABCD" if pc.peek("ns", seqs[n])}
        assert pc.evict(1) == 1
        (gone,) = before - {n for n in "ABCD" if pc.peek("ns", seqs[n])}
        order.append(gone)
    assert order == ["C", "D", "A", "B"]
    assert m.num_used == 0 and pc.counts["evicted"] == 4


def test_budget_and_pool_pressure_give_blocks_back():
    m = BlockManager(9, first_id=1)  # 8 blocks
    pc = PrefixCache(m, BT, budget=3)
    m.reclaimer = pc
    seq = _tokens(1, 5 * BT)
    blocks = m.allocate(5)
    assert pc.insert("ns", seq, blocks) == 3  # the budget: the rest is not kept
    m.decref(blocks)
    assert m.num_free == 5 and m.num_available == 8
    shared = m.allocate(1)
    m.incref(pc.lookup("ns", seq)[:1])  # a sequence shares the first block: not reclaimable
    assert pc.reclaimable() == 2  # its children can go (leaves); it cannot
    m.decref(pc.lookup("ns", seq)[:1])
    got = m.allocate(7)  # more than is free: the cache gives its blocks back, leaves first
    assert len(got) == 7 and len(pc) == 0 and m.num_free == 0
    m.decref(got + shared)


def _shared_rows(seed: int, rows: int) -> list[list[int]]:
    """`rows` sequences: a few prompts (random lengths, some sharing their first blocks) and a
    random answer each."""
    g = torch.Generator().manual_seed(seed)
    prompts = [_tokens(seed * 7 + i, int(torch.randint(BT, 4 * BT, (1,), generator=g)))
               for i in range(3)]  # fmt: skip
    prompts.append(prompts[0][: 2 * BT] + _tokens(seed * 7 + 9, BT + 3))  # shares 2 blocks
    return [
        prompts[int(torch.randint(0, 4, (1,), generator=g))]
        + _tokens(seed * 11 + r, int(torch.randint(1, 3 * BT, (1,), generator=g)))
        for r in range(rows)
    ]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [1000, 24])
def test_insert_many_keeps_what_inserts_one_by_one_keep(seed, budget):
    """Rows ending together go into the cache in one insert_many: under the budget it keeps
    exactly what inserting them one by one keeps (the same chains found, the same block
    references); at a tight budget as many blocks as the budget, every kept chain found."""
    seqs = _shared_rows(seed, 8)
    caches = []
    for many in (False, True):
        m = BlockManager(512, first_id=1)
        pc = PrefixCache(m, BT, budget=budget)
        held = [m.allocate(-(-len(t) // BT)) for t in seqs]
        if many:
            pc.insert_many([("ns", t, b) for t, b in zip(seqs, held)])
        else:
            for t, b in zip(seqs, held):
                pc.insert("ns", t, b)
        for b in held:
            m.decref(b)  # the rows ended: only the cache holds their blocks
        caches.append((m, pc))
    (m1, one), (m2, many) = caches
    distinct = len({(i, tuple(t[: (i + 1) * BT])) for t in seqs for i in range(len(t) // BT)})
    # (the rows' blocks were still theirs while they went in: none could be evicted for them)
    assert one.num_hot == many.num_hot == min(budget, distinct)
    if budget >= distinct:
        assert m2.num_used == m1.num_used
        assert [many.lookup("ns", t) for t in seqs] == [one.lookup("ns", t) for t in seqs]
    for t in seqs:  # whatever is found is a chain of blocks the cache holds
        assert all(m2.refcount(b) >= 1 for b in many.lookup("ns", t))
    many.clear()
    one.clear()
    assert m1.num_used == 0 and m2.num_used == 0


def test_insert_many_makes_room_once_for_a_prompt_new_to_the_cache():
    """Six rows of one new two-block prompt end together, each with a block of its own answer,
    into a cache at 10 of its 12 blocks: 2 + 6 blocks are new, so 6 old ones go (not 6 x 3:
    the prompt's blocks are counted once) and every row's chain is found whole."""
    m = BlockManager(128, first_id=1)
    pc = PrefixCache(m, BT, budget=12)
    for i in range(10):
        (b,) = m.allocate(1)
        pc.insert("ns", _tokens(100 + i, BT), [b])
        m.decref([b])
    prompt = _tokens(7, 2 * BT)
    rows = [prompt + _tokens(200 + r, BT) for r in range(6)]
    held = [m.allocate(3) for _ in rows]
    assert pc.insert_many([("ns", t, b) for t, b in zip(rows, held)]) == 2 + 6
    assert pc.counts["evicted"] == 6 and len(pc) == 12
    for t, b in zip(rows, held):
        found = pc.lookup("ns", t)
        assert found[:2] == held[0][:2] and found[2] == b[2]
        m.decref(b)
    assert pc.clear() == 12 and m.num_used == 0


# --- generate() on the cache ----------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, want",
    [
        ([[1, 1, 1, 1], [1, 1, 1, 1]], [0, 0]),  # no padding
        ([[0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]], [2, 0, 1]),  # left padding
        ([[1, 1, 1, 0], [1, 1, 1, 1]], None),  # right padding
        ([[1, 0, 1, 1]], None),  # a hole
        ([[0, 0, 0, 0], [1, 1, 1, 1]], None),  # a row of padding only
    ],
)
def test_the_cache_serves_left_padded_prompts_only(rows, want):
    mask = torch.tensor(rows)
    assert hf_prefix._left_padding(mask, mask.shape) == want
    assert hf_prefix._left_padding(mask, (mask.shape[0], mask.shape[1] + 1)) is None


def _prompts(seed: int, system: list[int], users: list[int], pads: list[int]):
    """Rows of [left padding, the shared system prompt, a user turn of its own]."""
    g = torch.Generator().manual_seed(seed)
    width = max(p + len(system) + u for p, u in zip(pads, users))
    ids = torch.zeros(len(users), width, dtype=torch.long)
    for i, u in enumerate(users):
        row = system + torch.randint(1, 128, (u,), generator=g).tolist()
        ids[i, width - len(row) :] = torch.tensor(row)
    mask = (ids != 0).long()
    return ids, mask


class Counted:
    """The tokens the model's embedding really sees (every forward's input, padding counted)."""

    def __init__(self, model):
        self.n = 0
        model.model.embed_tokens.register_forward_hook(self._hook)

    def _hook(self, mod, args, out):
        self.n += args[0].numel()

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


@pytest.fixture
def prefix_on():
    _patching.forget_warnings()
    yield load_config(prefix_cache=True)
    hf_prefix.clear()
    hf.disable_hf()


def _stats():
    (pool,) = [p for p in pool_stats() if p["prefix_cache"] is not None]
    return pool["prefix_cache"], pool["blocks_used"]


def _reference(arch, calls, **overrides):
    model = hf.apply(tiny(arch, **overrides), load_config(prefix_cache=False))
    with torch.no_grad():
        out = []
        for kw in calls:
            torch.manual_seed(7)
            out.append(model.generate(**kw))
    return out


# mistral: a window of 32 cuts the prompts (44 to 51 real tokens) while no row gives blocks back
# behind it (that starts at 63 tokens; a row that did is not kept: test_sliding_window_blocks.py)
@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("mistral", {"sliding_window": 32})])
def test_hits_give_the_tokens_of_misses_with_left_padding(arch, overrides, prefix_on):
    system = _tokens(3, 2 * BT + 7)
    system = [t % 127 + 1 for t in system]
    ids, mask = _prompts(4, system, users=[9, 12, 5], pads=[3, 0, 6])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    ids2, mask2 = _prompts(5, system, users=[7, 4], pads=[0, 2])  # another call, same system
    kw2 = dict(input_ids=ids2, attention_mask=mask2, max_new_tokens=6, do_sample=False)
    ref, ref2 = _reference(arch, [kw, kw2], **overrides)
    model = hf.apply(tiny(arch, **overrides), prefix_on)
    seen = Counted(model)
    with torch.no_grad():
        miss = model.generate(**kw)
        n_miss = seen.take()
        hit = model.generate(**kw)
        n_hit = seen.take()
        other = model.generate(**kw2)
        n_other = seen.take()
    assert torch.equal(miss, ref) and torch.equal(hit, ref) and torch.equal(other, ref2)
    rows, width = ids.shape
    # the same prompt again: each row's whole blocks of real tokens are cached; the batch skips
    # the columns every row has (padding + cached tokens), never the last
    pads, real = (mask == 0).sum(1).tolist(), mask.sum(1).tolist()
    skip = min(min(p + r // BT * BT for p, r in zip(pads, real)), width - 1)
    decode = rows * 5
    assert n_miss == rows * width + decode
    assert n_hit == rows * (width - skip) + decode
    # another call: only the system prompt's two whole blocks are its own
    skip2 = min(p + 2 * BT for p in (mask2 == 0).sum(1).tolist())
    assert n_other == ids2.shape[0] * (ids2.shape[1] - skip2) + ids2.shape[0] * 5
    stats, used = _stats()
    assert stats["misses"] == rows and stats["hits"] == rows + ids2.shape[0]
    assert used == stats["cached_blocks"]  # nothing but the cache holds a block: no leak
    assert hf_prefix.clear() == used
    assert _stats()[1] == 0


def test_beams_sampling_and_a_chat_turn_on_cached_blocks(prefix_on):
    system = [t % 127 + 1 for t in _tokens(8, 2 * BT)]
    ids, mask = _prompts(9, system, users=[6, 3], pads=[0, 3])
    beams = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=3,
                 num_return_sequences=2, do_sample=False, length_penalty=1.0)  # fmt: skip
    sample = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=True,
                  top_k=20, num_return_sequences=2)  # fmt: skip
    greedy = dict(input_ids=ids[:1], max_new_tokens=BT + 3, do_sample=False)  # no mask given
    ref_beams, ref_sample, ref_greedy = _reference("llama", [beams, sample, greedy])
    turn = torch.cat([ref_greedy, torch.tensor([[5, 6, 7]])], 1)  # the chat's next turn
    (ref_turn,) = _reference("llama", [dict(input_ids=turn, max_new_tokens=4, do_sample=False)])
    model = hf.apply(tiny("llama"), prefix_on)
    seen = Counted(model)
    with torch.no_grad():
        for kw, ref in ((beams, ref_beams), (sample, ref_sample), (beams, ref_beams)):
            torch.manual_seed(7)
            assert torch.equal(model.generate(**kw), ref)
        seen.take()
        assert torch.equal(model.generate(**greedy), ref_greedy)
        assert seen.take() == (greedy["input_ids"].shape[1] - 2 * BT) + BT + 2
        # the generated tokens were kept too: the next turn skips the prompt and the answer's
        # whole blocks
        got = model.generate(input_ids=turn, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, ref_turn)
        held = (ref_greedy.shape[1] - 1) // BT * BT
        assert seen.take() == turn.shape[1] - held + 3
    stats, used = _stats()
    assert stats["hits"] > 0 and used == stats["cached_blocks"]


def test_threads_share_a_system_prompt(prefix_on):
    """Several threads' calls (the multi-task engine merges their steps) on a cache that one
    call filled: the same tokens as without the cache, no block left behind."""
    system = [t % 127 + 1 for t in _tokens(11, 3 * BT)]
    calls = []
    for s in range(4):
        ids, mask = _prompts(20 + s, system, users=[4 + s, 2 + s][: 1 + s % 2], pads=[0, 3])
        calls.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=4 + s,
                          do_sample=False, num_beams=2 if s == 3 else 1))  # fmt: skip
    ref = _reference("llama", calls)
    model = hf.apply(tiny("llama"), prefix_on)
    with torch.no_grad():
        model.generate(**calls[0])  # fills the cache
        out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in calls])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), f"call {i}"
    stats, used = _stats()
    assert stats["hits"] >= sum(kw["input_ids"].shape[0] for kw in calls)
    assert used == stats["cached_blocks"]


def test_a_suffix_still_chunked_takes_nothing_from_the_cache(oxygen):
    """transformers' chunked prefill starts from column 0: a call whose suffix after the cached
    columns would still be prefilled in chunks (kv.prefill_chunk_tokens) takes none of them and
    counts a miss; one whose suffix fits in one pass starts on them. The tokens of the cache
    off."""
    system = [t % 127 + 1 for t in _tokens(13, 3 * BT)]
    calls = []
    for seed, user in ((60, 2 * BT + 8), (61, 10)):  # suffixes of 40 (> 32: chunked) and 10
        ids, mask = _prompts(seed, system, users=[user], pads=[0])
        calls.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    ref = _reference("llama", calls)
    model = hf.apply(tiny("llama"), load_config(prefix_cache=True, prefill_chunk_tokens=2 * BT))
    seen = Counted(model)
    with torch.no_grad():
        warm, warm_mask = _prompts(62, system, users=[4], pads=[0])
        model.generate(input_ids=warm, attention_mask=warm_mask, max_new_tokens=1)
        seen.take()
        before, _ = _stats()
        chunked = model.generate(**calls[0])
        n_chunked = seen.take()
        mid, _ = _stats()
        hit = model.generate(**calls[1])
        n_hit = seen.take()
        after, _ = _stats()
    assert torch.equal(chunked, ref[0]) and torch.equal(hit, ref[1])
    assert (mid["hits"] - before["hits"], mid["misses"] - before["misses"]) == (0, 1)
    assert (after["hits"] - mid["hits"], after["misses"] - mid["misses"]) == (1, 0)
    assert n_chunked == calls[0]["input_ids"].shape[1] + 2  # the whole prompt, then 2 decodes
    assert n_hit == calls[1]["input_ids"].shape[1] - 3 * BT + 2


@pytest.mark.parametrize("tier", [False, True], ids=["gpu_hit", "cpu_tier_hit"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_calls_arriving_together_each_start_on_the_cached_system_prompt(arch, tier, oxygen):
    """Ten one-row calls released at once after one call cached the system prompt (a serving
    burst; bench_tier.py's prefix_concurrent): the engine merges their steps, and every merged
    call still starts on the cache -- one hit each, only its own turn embedded -- with the
    tokens of the same calls without the cache. tier: every cached block is in the CPU tier
    when the burst comes; the first call brings the chain up, the others find it there."""
    system = [t % 127 + 1 for t in _tokens(12, 3 * BT + 5)]
    calls = []
    for s in range(10):
        ids, mask = _prompts(40 + s, system, users=[2 + s], pads=[0])
        calls.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False))
    ref = _reference(arch, calls)
    cfg = load_config(prefix_cache=True, pool={"cpu_tier_bytes": (64 << 20) if tier else 0})
    model = hf.apply(tiny(arch), cfg)
    seen = Counted(model)
    with torch.no_grad():
        warm, warm_mask = _prompts(39, system, users=[4], pads=[0])
        model.generate(input_ids=warm, attention_mask=warm_mask, max_new_tokens=1)
        if tier:
            (pool,) = [p for p in kv_pool._pools.values() if p.prefix is not None]
            with pool.lock:
                assert pool.prefix.demote(pool.prefix.num_hot) == 3
        before, _ = _stats()
        seen.take()
        out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in calls])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), f"call {i}"
    after, used = _stats()
    burst = {k: after[k] - before[k] for k in ("hits", "misses", "cpu_hit_blocks")}
    assert burst == {"hits": len(calls), "misses": 0, "cpu_hit_blocks": 3 if tier else 0}
    # each call computed its turn past the system prompt's 3 whole blocks, then 2 decode steps
    assert seen.take() == sum(kw["input_ids"].shape[1] - 3 * BT + 2 for kw in calls)
    (sched,) = schedulers(model)
    assert max(sched.stats.batch_sizes) > 1  # several calls' sequences in one forward
    assert used == after["hot_blocks"]  # nothing but the cache holds a block: no leak
