"""A hybrid model's sliding layers keep only their window mapped (kv/window.py, kv/storage.py):
some layers slide, the others see every token; one table serves both, so the blocks behind a
row's window stay for the full-attention layers, but the row *narrows* its references to them,
and once no reference reads a block through a sliding layer its pages in the sliding layers'
regions are unmapped (whole pages only).

The core tests run on the host arena, where touching an unmapped page kills the process: they
attend after narrowing, through select, fork and crop, and compare every layer's output with a
float64 dense reference (full layers over every key, sliding layers over their window).
generate() tests compare with stock transformers on tiny random-weight models (float32, greedy).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
import transformers as T
from test_engine import in_threads, prompt, schedulers, together_as_alone
from test_hf_generate import COMMON
from test_kv_paged_cache import RecordingBacking, _dense_out
from test_sliding_window_blocks import merged_calls_equal_stock

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import prefix as hf_prefix
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.block_manager import BlockManager
from oxygen_torch.kv.core import PagedKVCore
from oxygen_torch.kv.merged import MergedStep, Part
from oxygen_torch.kv.pool import release_pools
from oxygen_torch.kv.storage import KVStorage
from oxygen_torch.kv.swap import swap_out

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

MiB, KiB = 1 << 20, 1 << 10
BT = 16

# --- the block manager and the storage ------------------------------------------------------


def test_narrowed_references_tell_the_storage_when_no_whole_one_is_left():
    told: list[list[int]] = []
    m = BlockManager(8, first_id=1, on_narrow=told.append)
    a, b = m.allocate(2)
    m.incref([a])  # a: two holders
    m.narrow([a, b])
    assert told == [[b]] and not m.is_narrow(a) and m.is_narrow(b)
    m.decref([a])  # the other holder's whole reference goes: only a narrowed one is left
    assert told == [[b], [a]] and m.is_narrow(a)
    with pytest.raises(RuntimeError, match="whole reference to a block only narrowed"):
        m.incref([a])
    m.incref([a], narrowed=True)  # a fork of the narrowed row
    with pytest.raises(RuntimeError, match="narrowed decref without"):
        m.decref([m.allocate(1)[0]], narrowed=True)
    assert m.decref([a], narrowed=True) == [] and m.decref([a], narrowed=True) == [a]
    assert m.decref([b], narrowed=True) == [b]
    with pytest.raises(RuntimeError, match="narrow without a whole reference"):
        m.narrow([m.allocate(1)[0]] * 2)


def test_window_regions_unmap_a_page_once_each_block_on_it_is_narrowed_or_free():
    page = 16 * KiB  # 2 blocks a page (8 KiB blocks): region pages hold blocks 2p, 2p + 1
    backing = RecordingBacking(3 * 2 * 8 * page, page)
    st = KVStorage(backing, 3, 2, 64, torch.float32, BT, window_layers=(1,))
    regions = st.region_pages

    def mapped(layer: int) -> set[int]:
        lo = 2 * layer * regions
        return {p - lo for p in backing.mapped if lo <= p < lo + regions}  # layer's K region

    st.on_alloc([2, 3, 4])
    assert mapped(0) == mapped(1) == mapped(2) == {0, 1, 2}
    st.on_narrow([2])
    assert mapped(1) == {0, 1, 2}  # block 3 still whole on page 1
    st.on_narrow([3])
    assert mapped(1) == {0, 2} and mapped(0) == mapped(2) == {0, 1, 2}
    assert st.window_mapped_bytes() == 2 * 2 * page  # K and V of layer 1, pages 0 and 2
    st.on_free([2, 3])  # narrowed blocks go: only the full layers' pages were still theirs
    assert mapped(0) == {0, 2} and mapped(1) == {0, 2}
    st.on_free([4])  # a whole block: both sets
    assert mapped(0) == mapped(1) == {0}  # the guard block's page stays
    assert st.mapped_bytes(peak=True) == 3 * 6 * page


def test_out_of_memory_in_the_window_regions_maps_nothing_and_raises_once():
    """The full layers' pages map, the sliding layer's do not (out of memory): the allocation
    fails at once, its full-layer pages go again, and the next one that fits maps."""

    class Tight(RecordingBacking):
        refuse, refused = False, 0

        def map_pages(self, first, count):
            if self.refuse and first // 8 // 2 == 1:  # layer 1's regions (8 pages a region)
                self.refused += 1
                raise torch.OutOfMemoryError("no memory")
            super().map_pages(first, count)

    class Pending:  # a retired page set whose kernels are still in flight
        def query(self):
            return False

    page = 16 * KiB
    backing = Tight(3 * 2 * 8 * page, page)
    st = KVStorage(backing, 3, 2, 64, torch.float32, BT, window_layers=(1,))
    assert st.region_pages == 8
    backing.refuse = True
    st._retired.append((Pending(), st._all, []))  # so the allocation waits and tries once more
    with pytest.raises(torch.OutOfMemoryError):
        st.on_alloc([2, 3, 4, 5, 6])  # pages 1-3 (the guard's page 0 is mapped already)
    assert backing.refused == 2 and not st._retired
    assert backing.mapped == {r * 8 for r in range(6)}  # only the guard's page, every region
    backing.refuse = False
    st.on_alloc([2, 3])
    assert len(backing.mapped) == 6 * 2


# --- the core, on the host arena ------------------------------------------------------------

L, HKV, D, W = 3, 2, 64, 40  # layer 1 slides: 8 KiB blocks, 256 a 2 MiB page
SLIDING = (1,)


class Hybrid:
    """A hybrid PagedKVCore on the host arena beside each row's dense K/V history per layer."""

    def __init__(self, batch: int, narrow: bool = True, arena: int = 96 * MiB, **kw):
        self.core = PagedKVCore(
            L, block_tokens=BT, backing="arena", arena_bytes=arena,
            narrow_window=W if narrow else None, window_layers=SLIDING if narrow else (), **kw,
        )  # fmt: skip
        self.k = [[torch.empty(HKV, 0, D) for _ in range(batch)] for _ in range(L)]
        self.v = [[torch.empty(HKV, 0, D) for _ in range(batch)] for _ in range(L)]

    def step(self, q_len: int, check: bool = True) -> None:
        """q_len new tokens a row, every layer; checks each layer's attention when `check`."""
        b = len(self.k[0])
        for layer in range(L):
            q = torch.randn(b, 4, q_len, D)
            k, v = torch.randn(b, HKV, q_len, D), torch.randn(b, HKV, q_len, D)
            plan = self.core.write(layer, k, v)
            for i in range(b):
                self.k[layer][i] = torch.cat([self.k[layer][i], k[i]], 1)
                self.v[layer][i] = torch.cat([self.v[layer][i], v[i]], 1)
            if not check:
                continue
            window = W if layer in SLIDING else None
            out = self.core.attend(layer, q, plan, scale=0.125, sliding_window=window)
            for i in range(b):
                want = _dense_out(q[i], self.k[layer][i], self.v[layer][i], 0.125, window)
                torch.testing.assert_close(out[i], want, rtol=1e-4, atol=1e-4)

    def select(self, order: list[int]) -> None:
        self.core.select(order)
        for layer in range(L):
            self.k[layer] = [self.k[layer][j] for j in order]
            self.v[layer] = [self.v[layer][j] for j in order]


def _window_pages(core) -> int:
    return core.pool.storage.window_mapped_bytes() // (2 * len(SLIDING) * 2 * MiB)


def _full_pages(core) -> int:
    st = core.pool.storage
    return (st.mapped_bytes() - st.window_mapped_bytes()) // (2 * (L - len(SLIDING)) * 2 * MiB)


def test_long_rows_unmap_their_sliding_layer_pages_and_attend_as_dense():
    """Two rows of 8,300 tokens (519 blocks each, 256 blocks a 2 MiB page, allocated row after
    row: row 0 on pages 0-2, row 1 on pages 2-4), then decode: a page that holds only blocks
    behind the windows goes from the sliding layer's regions, the full layers keep every page,
    and attention equals the reference all along, through a beam reorder that duplicates a
    narrowed row, a fork and a crop inside the margin."""
    torch.manual_seed(0)
    rows = Hybrid(2)
    core = rows.core
    rows.step(8300, check=False)  # (the prefill's attention is the fresh path: not checked)
    assert _window_pages(core) == _full_pages(core) == 5
    rows.step(1)
    assert core.seqs.narrowed == [515, 515]  # (8300 - 40 + 1 - 16) // 16
    assert _full_pages(core) == 5 and _window_pages(core) == 3  # pages 1 and 3 went
    assert core.pool.stats()["window_narrowed_blocks"] >= 2 * 515
    rows.select([1, 1])  # row 0's blocks go, row 1's narrowed references double
    assert _full_pages(core) == 4 and _window_pages(core) == 2  # pages 0-1 / 0, 4 left
    rows.step(1)
    twin = core.fork()
    rows.step(1)
    twin.release()
    core.crop(2)  # inside the margin: the next windows find their keys
    for layer in range(L):
        rows.k[layer] = [k[:, :-2] for k in rows.k[layer]]
        rows.v[layer] = [v[:, :-2] for v in rows.v[layer]]
    for _ in range(3):
        rows.step(1)
    with pytest.raises(NotImplementedError, match="narrowed"):
        core.crop(100)
    pool = core.pool
    core.release()
    assert pool.manager.num_used == 0 and pool.mapped_bytes() == 2 * L * 2 * MiB  # the guard


def test_fp8_scales_narrow_with_their_blocks_and_attention_equals_the_whole_cache():
    """fp8 K/V (2 KiB blocks, 1,024 a page): one row of 34,000 tokens unmaps its sliding
    layer's page 1, the scales' storage is told too, and the narrowed cache attends exactly as
    one that keeps every block whole, on the same inputs."""
    torch.manual_seed(5)
    kw = dict(block_tokens=BT, backing="arena", arena_bytes=96 * MiB, kv_dtype="fp8_e4m3")
    narrow = PagedKVCore(L, narrow_window=W, window_layers=SLIDING, **kw)
    whole = PagedKVCore(L, **kw)
    for q_len in (34000, 1, 1, 5, 1):
        for layer in range(L):
            q = torch.randn(1, 4, q_len, D)
            k, v = torch.randn(1, HKV, q_len, D), torch.randn(1, HKV, q_len, D)
            plans = [c.write(layer, k, v) for c in (narrow, whole)]
            if q_len == 34000:
                continue  # (the prompt: its fresh attention is not what this checks)
            window = W if layer in SLIDING else None
            got, want = (
                c.attend(layer, q, p, scale=0.125, sliding_window=window)
                for c, p in zip((narrow, whole), plans)
            )
            assert torch.equal(got, want), layer
    assert narrow.seqs.narrowed[0] > 2047 and whole.seqs.narrowed == [0]
    st = narrow.pool.storage
    page = len(SLIDING) * 2 * 2 * MiB  # a region page in the sliding layer's K and V
    assert st.window_mapped_bytes() == 2 * page  # pages 0 (the guard's) and 2: page 1 went
    assert st.mapped_bytes() - st.window_mapped_bytes() == 3 * (L - len(SLIDING)) * 2 * 2 * MiB
    scales, first = narrow.pool.scales, narrow.seqs.blocks[0][0]
    # the scales were told (a scales page holds 262,144 blocks' scales: none can go here)
    assert scales._whole[first] == 0 and st._whole[first] == 0
    assert scales._whole[narrow.seqs.blocks[0][-1]] == 1
    narrow.release()
    whole.release()


def _narrowed_row(seed: int, tokens: int) -> Hybrid:
    """One row of a hybrid core past its window: a prompt of `tokens`, then one decode step."""
    torch.manual_seed(seed)
    rows = Hybrid(1)
    rows.step(tokens, check=False)
    rows.step(1)
    assert rows.core.seqs.narrowed[0] > 0
    return rows


def test_a_sliding_layer_asking_for_a_wider_window_fails_before_the_kernel():
    core = _narrowed_row(1, 600).core
    k = torch.randn(1, HKV, 1, D)
    plan = core.write(0, k, k)
    core.attend(0, torch.randn(1, 4, 1, D), plan, scale=None, sliding_window=None)  # a full one
    plan = core.write(1, k, k)
    with pytest.raises(NotImplementedError, match="layer 1 attends with sliding_window=None"):
        core.attend(1, torch.randn(1, 4, 1, D), plan, scale=None, sliding_window=None)
    core.release()


def test_a_merged_step_refuses_a_wider_window_on_a_sliding_layer_after_narrowing():
    core = _narrowed_row(3, 600).core
    step = MergedStep([Part(core, [1], 1)])
    step.reserve()
    k = torch.randn(1, HKV, 1, D)
    q = torch.randn(1, 4, 1, D)
    plan = step.write(0, k, k)
    step.attend(0, q, plan, scale=None, sliding_window=None)  # a full layer reads everything
    plan = step.write(1, k, k)
    step.attend(1, q, plan, scale=None, sliding_window=W)  # its own window: fine
    with pytest.raises(NotImplementedError, match="layer 1 attends with sliding_window=None"):
        step.attend(1, q, plan, scale=None, sliding_window=None)
    with pytest.raises(NotImplementedError, match=f"sliding_window={W + 1}"):
        step.attend(1, q, plan, scale=None, sliding_window=W + 1)
    step.abandon()
    core.release()


def test_before_anything_is_narrowed_a_wider_window_keeps_every_block():
    rows = Hybrid(1)
    core = rows.core
    k = torch.randn(1, HKV, 30, D)
    for layer in range(L):
        plan = core.write(layer, k, k)
        core.attend(layer, torch.randn(1, 4, 30, D), plan, scale=None, sliding_window=None)
    assert core.narrow_window is None
    rows.step(100, check=False)
    assert core.seqs.narrowed == [0]
    core.release()


def test_a_core_that_narrowed_blocks_is_not_swapped():
    rows = _narrowed_row(2, 200)
    core = rows.core
    core.pool.cpu_tier(16 * MiB)
    held = list(core.seqs.blocks[0])
    assert swap_out(core) is None and core._swapped is None and core.seqs.blocks[0] == held
    rows.step(1)
    core.release()
    release_pools()


# --- generate() against stock transformers --------------------------------------------------

WG = 24  # the tiny models' window (not a multiple of BT)
ARCHS = {
    # layer 0 full, layer 1 sliding
    "qwen2": (
        T.Qwen2Config,
        T.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": WG, "max_window_layers": 1},
    ),
    "gemma3": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        {"sliding_window": WG, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


def tiny(arch: str, seed: int = 0, positions: int = 512):
    conf_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    conf = conf_cls(
        **{**COMMON, "max_position_embeddings": positions}, **extra, attn_implementation="sdpa"
    )
    model = model_cls(conf).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def _generate(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, **kw)


def _ids(b: int, n: int, seed: int, pads=()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (b, n), generator=g)
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads):
        mask[i, :p] = ids[i, :p] = 0
    return ids, mask


def _narrowed() -> int:
    return sum(p["window_narrowed_blocks"] for p in pool_stats())


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_greedy_equals_stock_and_rows_narrow(oxygen, arch):
    ids, mask = _ids(2, 40, seed=3, pads=(0, 7))
    model = tiny(arch)
    ref = _generate(model, ids, mask, 40)
    hf.apply(model)
    before = _narrowed()
    got = _generate(model, ids, mask, 40, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    core = got.past_key_values._core
    assert core.narrow_window == WG and core.window_layers == {"qwen2": (1,), "gemma3": (0,)}[arch]
    assert all(n >= 2 for n in core.seqs.narrowed) and core.seqs.dropped == [0, 0]
    assert _narrowed() - before >= 4


def test_beam_search_equals_stock(oxygen):
    ids, mask = _ids(2, 36, seed=4, pads=(3, 0))
    model = tiny("gemma3")
    ref = _generate(model, ids, mask, 30, num_beams=2)
    hf.apply(model)
    got = _generate(model, ids, mask, 30, num_beams=2, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    assert any(got.past_key_values._core.seqs.narrowed)


def test_off_keeps_every_block_whole(oxygen):
    ids, mask = _ids(1, 40, seed=5)
    model = tiny("qwen2")
    ref = _generate(model, ids, mask, 30)
    hf.apply(model, load_config(kv={"hybrid_windows": False}))
    got = _generate(model, ids, mask, 30, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    core = got.past_key_values._core
    assert core.narrow_window is None and core.seqs.narrowed == [0]


def test_a_long_prompt_keeps_only_the_window_of_its_sliding_layer_mapped(oxygen):
    """8,400 tokens (526 blocks; 256 blocks of 8 KiB a 2 MiB page): after the prompt the
    sliding layer's region keeps 2 of the full layer's 3 pages, and the tokens are stock's."""
    ids, mask = _ids(1, 8400, seed=6)
    model = tiny("qwen2", positions=8600)
    ref = _generate(model, ids, mask, 4)
    hf.apply(model)
    got = _generate(model, ids, mask, 4, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    pool = got.past_key_values._core.pool
    st = pool.storage
    window = st.window_mapped_bytes() // (2 * 2 * MiB)  # one sliding layer: K and V regions
    full = (st.mapped_bytes() - st.window_mapped_bytes()) // (2 * 2 * MiB)
    assert full == 3 and window == 2, (full, window)  # page 1 held only narrowed blocks
    assert pool.stats()["window_mapped_bytes"] == st.window_mapped_bytes()


def test_the_prefix_cache_keeps_the_prompt_before_its_blocks_are_narrowed(oxygen):
    """Row 0 narrows during the call: its prompt's whole blocks join the prefix cache first,
    and the same call again starts on them, with stock's tokens."""
    hf_prefix.clear()
    ids, mask = _ids(2, 40, seed=7, pads=(0, 18))
    model = tiny("gemma3")
    ref = _generate(model, ids, mask, 30)
    hf.apply(model, load_config(prefix_cache=True))
    got = _generate(model, ids, mask, 30, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    assert got.past_key_values._core.seqs.narrowed[0] > 0
    (pc,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"] is not None]
    assert pc["cached_blocks"] >= 40 // BT
    again = _generate(model, ids, mask, 30, return_dict_in_generate=True)
    assert torch.equal(again.sequences, ref)
    (pc2,) = [p["prefix_cache"] for p in pool_stats() if p["prefix_cache"] is not None]
    assert pc2["hit_tokens"] > pc["hit_tokens"]


def test_concurrent_calls_on_the_engine_equal_stock(oxygen):
    kws = []
    for s in range(3):
        ids, mask = _ids(2, 30 + 6 * s, seed=10 + s, pads=(s, 0))
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=34, do_sample=False))
    before = _narrowed()
    merged_calls_equal_stock(lambda: tiny("qwen2"), kws)
    assert _narrowed() > before


def test_preempted_calls_that_narrowed_are_recomputed_not_swapped(oxygen, caplog):
    """Six calls of six rows (200-odd tokens + 40 new) on a pool of 255 blocks of 16 tokens,
    the CPU tier on: younger calls are preempted; those whose rows narrowed blocks are
    recomputed (one warning), and every call gives the tokens it gives alone."""
    cfg = load_config(kv={"arena_bytes": 8 * MiB}, pool={"cpu_tier_bytes": 64 * MiB})
    model = hf.apply(tiny("qwen2", positions=512), cfg)
    kws = []
    for s in range(6):
        ids, mask = prompt(s, rows=6, length=200 + s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        together_as_alone(model, kws, "hybrid")
    (sched,) = schedulers(model)
    assert sched.stats.preemptions > 0 and sched.stats.swaps < sched.stats.preemptions
    warned = [r for r in caplog.records if "recomputed instead of swapped" in r.getMessage()]
    assert len(warned) == 1
    (pool,) = [p for p in pool_stats() if p["blocks_total"] == 255]
    assert pool["blocks_used"] == 0 and pool["window_narrowed_blocks"] > 0


def test_merged_decode_graphs_on_a_hybrid_model_give_each_call_its_tokens_alone(oxygen):
    """The merged decode graphs' bookkeeping (on CPU its stand-in re-runs the captured forward
    on the graph's buffers) over calls whose rows narrow blocks."""
    cfg = load_config(
        kv={"cpu_decode_graphs": "rerun"}, scheduler={"decode_graphs": True, "gather_ms": 50}
    )
    model = hf.apply(tiny("qwen2"), cfg)
    kws = []
    for s in range(3):
        ids, mask = _ids(2, 30 + 6 * s, seed=20 + s, pads=(s, 0))
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=34, do_sample=False))
    before = _narrowed()
    together_as_alone(model, kws, "hybrid, merged graphs")
    assert oxygen_torch.decode_graph_stats(model)["merged"]["replays"] > 0
    assert _narrowed() > before


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_on_the_gpu_greedy_equals_stock_and_sliding_pages_go(oxygen, arch):
    """The same on CUDA (the VMM arena, decode graphs on), float32: a 8,400-token prompt."""
    ids, mask = _ids(1, 8400, seed=8)
    model = tiny(arch, positions=8600).cuda()
    ids, mask = ids.cuda(), mask.cuda()
    ref = _generate(model, ids, mask, 40)
    hf.apply(model)
    got = _generate(model, ids, mask, 40, return_dict_in_generate=True)
    assert torch.equal(got.sequences, ref)
    st = got.past_key_values._core.pool.storage
    assert st.backing.name == "arena"
    # the map-ahead thread (kv.map_ahead_bytes) holds empty pages mapped until 0.1 s after the
    # last allocation: the pages the call's blocks hold are what is left once they go
    deadline = time.monotonic() + 10.0
    while True:
        with st.lock:
            window = st.window_mapped_bytes() // (2 * 2 * MiB)
            full = (st.mapped_bytes() - st.window_mapped_bytes()) // (2 * 2 * MiB)
        if (full == 3 and window == 2) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert full == 3 and window == 2, (full, window)


@pytest.mark.cuda
def test_on_the_gpu_merged_decode_graphs_over_hybrid_calls_that_narrow(oxygen):
    """Concurrent calls on a hybrid model merged into decode graphs on CUDA (float32: merged
    and alone runs use different kernel shapes, so tokens agree at a rate, as in
    test_tier_cuda.py), their rows narrowing blocks behind the window meanwhile."""
    cfg = load_config(scheduler={"decode_graphs": True, "gather_ms": 50})
    model = hf.apply(tiny("qwen2").cuda(), cfg)
    kws = []
    for s in range(4):
        ids, mask = _ids(2, 30 + 6 * s, seed=30 + s, pads=(s, 0))
        kws.append(dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40,
                        do_sample=False))  # fmt: skip
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
        before = _narrowed()
        out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
    assert not errors, errors
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    agree = sum((out[i] == r).float().mean().item() for i, r in enumerate(ref)) / len(ref)
    print(f"\nhybrid merged decode graphs on the GPU: agreement {agree:.4f}, {st}")
    assert st["replays"] >= 1 and st["failed"] == 0, st
    assert agree >= 0.9
    assert _narrowed() > before
