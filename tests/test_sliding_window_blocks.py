"""Sliding-window layers keep only their window in the pool (kv/window.py): when every layer of a
model attends to the same window W, each row gives back its blocks wholly before the window
(a block of margin kept), and its table entries become GUARD_BLOCK.

Core-level tests check the attention against a float64 dense reference and the reference counts
through select / fork / crop / swap; generate() tests compare with stock transformers (its own
sliding-window cache) on tiny random-weight models, float32, greedy, and read the pool's used
blocks at every step."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_engine import generate, in_threads, schedulers
from test_hf_generate import COMMON, batch
from test_kv_paged_cache import _dense_out

from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import graphs as hf_graphs
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import prefix as hf_prefix
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.core import PagedKVCore
from oxygen_torch.kv.pool import release_pools
from oxygen_torch.kv.storage import GUARD_BLOCK
from oxygen_torch.kv.swap import swap_in, swap_out

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

MiB = 1 << 20
BT = 16
W = 12  # not a multiple of BT
BOUND = -(-(W + BT) // BT) + 1  # blocks a row may hold: its window, the margin, one partial


# --- the core ------------------------------------------------------------------------------


class Rows:
    """A PagedKVCore of one layer beside each row's whole K/V history (the dense reference)."""

    def __init__(self, batch: int, window: int | None = W):
        self.core = PagedKVCore(1, block_tokens=BT, backing="torch", window=window)
        self.k = [torch.empty(2, 0, 64) for _ in range(batch)]
        self.v = [torch.empty(2, 0, 64) for _ in range(batch)]

    def step(self, q_len: int, real: torch.Tensor | None = None):
        """One step of q_len new tokens per row; asserts the attention equals the reference."""
        b = len(self.k)
        real = real if real is not None else torch.ones(b, q_len, dtype=torch.bool)
        q = torch.randn(b, 4, q_len, 64)
        k, v = torch.randn(b, 2, q_len, 64), torch.randn(b, 2, q_len, 64)
        plan = self.core.write(0, k, v, lambda: None if real.all() else real)
        out = self.core.attend(0, q, plan, scale=0.125, sliding_window=W)
        for i in range(b):
            keep = real[i]
            self.k[i] = torch.cat([self.k[i], k[i][:, keep]], 1)
            self.v[i] = torch.cat([self.v[i], v[i][:, keep]], 1)
            want = _dense_out(q[i][:, keep], self.k[i], self.v[i], 0.125, W)
            torch.testing.assert_close(out[i][keep], want, rtol=1e-5, atol=1e-5)

    def select(self, order: list[int]) -> None:
        self.core.select(order)
        self.k, self.v = [self.k[j] for j in order], [self.v[j] for j in order]


def _past_the_window(batch: int, seed: int) -> Rows:
    """Rows that prefilled 40 tokens and decoded 20 (every step checked): blocks given back."""
    torch.manual_seed(seed)
    rows = Rows(batch)
    rows.step(40)
    for _ in range(20):
        rows.step(1)
    return rows


def _refcounts_are_uses(core: PagedKVCore, others=()) -> None:
    uses: dict[int, int] = {}
    for c in (core, *others):
        for r in range(len(c.seqs)):
            for b in c.seqs.held(r):
                uses[b] = uses.get(b, 0) + 1
    assert GUARD_BLOCK not in uses
    for b, n in uses.items():
        assert core.pool.manager.refcount(b) == n, b


def test_rows_give_back_blocks_behind_the_window_and_attend_as_dense():
    torch.manual_seed(0)
    rows = Rows(3)
    real = torch.ones(3, 30, dtype=torch.bool)
    real[1, :7] = False  # left padding: row 1 holds 23 tokens
    rows.step(30, real)
    core = rows.core
    pool = core.pool
    used0, freed0 = pool.manager.num_used, pool.window_freed_blocks
    for t in range(40):
        rows.step(1)
        if t == 20:
            rows.select([0, 0, 2])  # a beam reorder over rows that gave blocks back
        assert all(len(core.seqs.held(r)) <= BOUND for r in range(3))
        _refcounts_are_uses(core)
    seqs = core.seqs
    assert seqs.lens == [70, 70, 70] and all(d >= 2 for d in seqs.dropped)
    for r, d in enumerate(seqs.dropped):  # the host table and the device one say GUARD there
        assert (core._table_host[r, :d] == GUARD_BLOCK).all()
        assert (core.table[r, :d] == GUARD_BLOCK).all()
        assert (core._table_host[r, d : len(seqs.blocks[r])] != GUARD_BLOCK).all()
    assert pool.window_freed_blocks > freed0
    assert pool.manager.num_used <= used0 + 3  # 3 rows x 5 blocks held without the window
    core.release()
    assert pool.manager.num_used == used0 - sum(-(-n // BT) for n in (30, 23, 30))


def test_fork_swap_and_prefill_chunks_after_blocks_were_given_back():
    rows = _past_the_window(2, seed=1)
    core = rows.core
    base = core.pool.manager.num_used
    twin = core.fork()  # shares the held blocks, not the given-back entries
    assert twin.seqs.dropped == core.seqs.dropped and core.pool.manager.num_used == base
    _refcounts_are_uses(core, [twin])
    twin.release()
    core.pool.cpu_tier(16 * MiB)
    assert swap_out(core) is not None and core._swapped is not None
    swap_in(core)
    assert (core._table_host[:, : core.seqs.dropped[0]] == GUARD_BLOCK).all()
    _refcounts_are_uses(core)
    rows.step(1)  # the K/V came back where the window reads them
    rows.step(9)  # a prefill chunk on top of a cache that gave blocks back
    rows.step(1)
    _refcounts_are_uses(core)
    core.release()
    release_pools()  # the CPU tier goes with its pool (memory_stats() sums every pool's tier)


def test_crop_inside_the_margin_works_and_below_the_kept_window_fails():
    rows = _past_the_window(1, seed=2)
    core = rows.core
    d = core.seqs.dropped[0]
    assert d == 2  # 60 tokens: the window from 49, one block of margin: blocks 0 and 1 go
    core.crop(3)  # assisted decoding rejects a few draft tokens: the margin holds their keys
    rows.k[0], rows.v[0] = rows.k[0][:, :-3], rows.v[0][:, :-3]
    rows.step(1)
    with pytest.raises(NotImplementedError, match=r"window of 12 tokens.*first 32 tokens"):
        core.crop(core.length - 30)
    assert core.seqs.lens == [58]  # nothing changed
    core.release()


def test_a_layer_with_another_window_keeps_every_block():
    rows = Rows(1)
    core = rows.core
    k = torch.randn(1, 2, 40, 64)
    plan = core.write(0, k, k)
    core.attend(0, torch.randn(1, 4, 40, 64), plan, scale=None, sliding_window=None)
    assert core.window is None  # the first step showed it: nothing is given back
    for _ in range(30):
        core.write(0, k[:, :, :1], k[:, :, :1])
    assert core.seqs.dropped == [0] and len(core.seqs.held(0)) == 5
    core.release()


# --- generate() against stock transformers --------------------------------------------------

ARCHS = {
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": W}),
    "qwen2": (
        T.Qwen2Config,
        T.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 0},
    ),
    "qwen3": (
        T.Qwen3Config,
        T.Qwen3ForCausalLM,
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 0},
    ),
    # hybrid: layer 0 full, layer 1 sliding (one table serves both: nothing is given back)
    "qwen2_hybrid": (
        T.Qwen2Config,
        T.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
    ),
    "mistral_full": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": None}),
}


def tiny(arch: str, seed: int = 0):
    conf_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = model_cls(conf_cls(**COMMON, **extra, attn_implementation="sdpa")).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


class Used(T.LogitsProcessor):
    """The pool's used blocks after every forward of the call (over what was used before)."""

    def __init__(self):
        self.base, self.seen = _used(), []

    def __call__(self, input_ids, scores):
        self.seen.append(_used() - self.base)
        return scores


def _used() -> int:
    return sum(p["blocks_used"] for p in pool_stats())


def _freed() -> int:
    return sum(p["window_freed_blocks"] for p in pool_stats())


def _generate(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)


def _both(arch, ids, mask, new, cfg=None, **kw):
    """(stock tokens, oxygen output, the oxygen call's used blocks per step, the model); `cfg`
    goes to apply, `kw` to generate."""
    model = tiny(arch)
    ref = _generate(model, ids, mask, new, **kw)
    hf.apply(model, cfg)
    used = Used()
    got = _generate(
        model, ids, mask, new, logits_processor=[used], return_dict_in_generate=True, **kw
    )
    return ref, got, used.seen, model


@pytest.mark.parametrize(
    "arch, decode", [("mistral", "eager"), ("qwen3", "eager"), ("mistral", "graphs")]
)
def test_greedy_equals_stock_and_each_row_holds_its_window(oxygen, arch, decode):
    """graphs: the decode-graph bookkeeping (on CPU its stand-in re-runs the forward on the
    graph's buffers), whose steps plan without the block manager 15 steps in 16."""
    cfg = load_config(kv={"cpu_decode_graphs": "rerun" if decode == "graphs" else "off"})
    ids, mask = batch(b=2, n=28, seed=3, pads=(0, 5))
    freed0 = _freed()
    ref, got, used, model = _both(arch, ids, mask, 44, cfg)
    assert torch.equal(got.sequences, ref)
    assert (hf_graphs.stats(model)["replays"] > 0) == (decode == "graphs")
    core = got.past_key_values._core
    assert core.window == W and all(d >= 2 for d in core.seqs.dropped)
    assert max(used[1:]) <= 2 * BOUND  # every decode step: each row its window and margin
    assert _freed() - freed0 >= 2 * 2


def test_a_full_attention_model_of_the_same_size_holds_more(oxygen):
    ids, mask = batch(b=2, n=28, seed=3, pads=(0, 5))
    model = hf.apply(tiny("mistral_full"))
    used = Used()
    out = _generate(model, ids, mask, 44, logits_processor=[used], return_dict_in_generate=True)
    assert out.past_key_values._core.window is None
    assert max(used.seen) == 2 * 5 > 2 * BOUND  # 71 and 66 tokens: 5 blocks each


def test_beam_search_equals_stock(oxygen):
    ids, mask = batch(b=2, n=28, seed=4, pads=(3, 0))
    ref, got, used, _ = _both("mistral", ids, mask, 36, num_beams=2)
    assert torch.equal(got.sequences, ref)
    assert any(got.past_key_values._core.seqs.dropped)
    assert max(used[1:]) <= 4 * BOUND


def test_a_hybrid_model_gives_nothing_back_and_equals_stock(oxygen):
    ids, mask = batch(b=2, n=28, seed=5, pads=(0, 5))
    freed0 = _freed()
    ref, got, _, _ = _both("qwen2_hybrid", ids, mask, 30)
    assert torch.equal(got.sequences, ref)
    core = got.past_key_values._core
    assert core.window is None and core.seqs.dropped == [0, 0]
    assert _freed() == freed0


def test_a_row_that_gives_blocks_back_keeps_its_prompt_in_the_prefix_cache_first(oxygen):
    """Row 0 (28 real tokens + 30 new) gives blocks back: just before it first does, its
    prompt's whole block joins the prefix cache; row 1 (10 + 30, nothing given back) is kept
    whole after the call. The same call again starts on row 0's cached block, with the same
    tokens."""
    hf_prefix.clear()
    ids, mask = batch(b=2, n=28, seed=6, pads=(0, 18))
    model = tiny("mistral")
    ref = _generate(model, ids, mask, 30)
    hf.apply(model, load_config(prefix_cache=True))
    got = _generate(model, ids, mask, 30, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    assert got.past_key_values._core.seqs.dropped[0] > 0
    assert got.past_key_values._core.seqs.dropped[1] == 0
    (pc,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"] is not None]
    # row 0's prompt: 28 // 16 = 1 whole block; row 1's 39 stored tokens: 2 whole blocks
    assert pc["cached_blocks"] == 28 // BT + 39 // BT
    again = _generate(model, ids, mask, 30, return_dict_in_generate=True)
    assert torch.equal(again.sequences, ref)
    (pc2,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"] is not None]
    assert pc2["hit_tokens"] > pc["hit_tokens"]  # row 0 started on its cached prompt block


def test_a_call_that_starts_on_cached_blocks_gives_them_back_behind_the_window(oxygen):
    """A short call is kept whole; a longer one with the same prompt starts on those blocks
    (a hit) and then leaves them behind its window: only its reference goes, the cache's
    stays."""
    hf_prefix.clear()
    cfg = load_config(prefix_cache=True)
    ids, mask = batch(b=1, n=36, seed=7, pads=(0,))
    stock = tiny("mistral")
    ref = _generate(stock, ids, mask, 30)
    model = hf.apply(tiny("mistral"), cfg)
    _generate(model, ids, mask, 2)  # 37 tokens stored: nothing given back, 2 blocks kept
    (pc,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"] is not None]
    assert pc["cached_blocks"] == 2
    out = _generate(model, ids, mask, 30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.past_key_values._core.seqs.dropped[0] >= 2
    (pc2,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"] is not None]
    assert pc2["hits"] == pc["hits"] + 1 and pc2["cached_blocks"] >= 2


def merged_calls_equal_stock(make, kws: list[dict]) -> None:
    """The calls `kws` on a stock `make()` one by one, then on oxygen (a second `make()`) from
    threads at once: the same tokens, and the engine merged their rows."""
    stock = make()
    with torch.no_grad():
        ref = [stock.generate(**kw) for kw in kws]
    model = hf.apply(make())
    out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), i
    assert max(schedulers(model)[0].stats.batch_sizes) > 2  # the calls' rows were merged


def test_concurrent_calls_on_the_engine_equal_stock(oxygen):
    kws = []
    for s in range(3):
        ids, mask = batch(b=2, n=20 + 4 * s, seed=10 + s, pads=(s, 0))
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=34, do_sample=False))
    freed0 = _freed()
    merged_calls_equal_stock(lambda: tiny("mistral"), kws)
    assert _freed() > freed0


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_on_the_gpu_greedy_equals_stock_and_each_row_holds_its_window(oxygen, arch):
    """The same on CUDA (decode graphs on): float32, so the tokens are stock's."""
    ids, mask = batch(b=2, n=28, seed=3, pads=(0, 5))
    model = tiny(arch).cuda()
    ids, mask = ids.cuda(), mask.cuda()
    ref = _generate(model, ids, mask, 60)
    hf.apply(model)
    used = Used()
    got = _generate(model, ids, mask, 60, logits_processor=[used], return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    assert max(used.seen[1:]) <= 2 * BOUND  # after the prefill
    assert all(d >= 2 for d in got.past_key_values._core.seqs.dropped)


def test_a_window_model_is_not_split_for_blocks_it_gives_back(oxygen):
    """19 rows of up to 12 tokens + 200 new on a pool of 255 blocks of 16 tokens: stored whole
    they need 19 x 14 = 266 blocks, so a full-attention model's call runs as row groups
    (kv.oversubscribe); with a window of 12 on every layer a row holds 3 blocks at most, so the
    call runs whole. Both give stock's tokens."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 128, (19, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[::4, :3] = 0  # left padding on every fourth row
    ids = ids * mask
    cfg = load_config(kv={"block_tokens": 16, "arena_bytes": 8 << 20})

    def splits() -> int:
        return sum(p["oversubscribed"]["calls_split"] for p in pool_stats())

    for arch, split in (("mistral", 0), ("mistral_full", 1)):
        model = tiny(arch)
        ref = _generate(model, ids, mask, 200)
        hf.apply(model, cfg)
        before = splits()
        assert torch.equal(_generate(model, ids, mask, 200), ref), arch
        assert splits() - before == split, arch
    (small,) = [p for p in pool_stats() if p["blocks_total"] == 255]
    assert small["peak_blocks_used"] <= 255
