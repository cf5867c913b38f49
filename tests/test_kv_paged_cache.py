"""KV storage page accounting and PagedKVCore against a dense float64 reference."""

import gc
import random

import pytest
import torch
from oxygen_torch.triton_kernels.reference import dense_attention_ref

from oxygen_torch.kv.core import PagedKVCore
from oxygen_torch.kv.pool import pool_stats
from oxygen_torch.kv.storage import GUARD_BLOCK, KVStorage

KiB = 1 << 10


class RecordingBacking:
    """A torch buffer that records which pages are mapped."""

    name = "recording"

    def __init__(self, nbytes, page_size):
        self.page_size, self.capacity = page_size, nbytes
        self.flat = torch.zeros(nbytes, dtype=torch.uint8)
        self.mapped = set()

    def tensor(self):
        return self.flat

    def map_pages(self, first, count):
        new = set(range(first, first + count))
        assert not new & self.mapped, "page mapped twice"
        self.mapped |= new

    def unmap_pages(self, first, count):
        gone = set(range(first, first + count))
        assert gone <= self.mapped, "unmapping a page that is not mapped"
        self.mapped -= gone

    def is_mapped(self, page):
        return page in self.mapped

    def close(self):
        pass


def test_storage_maps_pages_of_live_blocks_in_every_region():
    # block = 16 tokens x 2 heads x 64 x 4 B = 8 KiB; 16 KiB pages hold 2 blocks
    backing = RecordingBacking(4 * 64 * KiB, 16 * KiB)
    st = KVStorage(
        backing, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_tokens=16
    )
    assert st.region_pages == 4 and st.num_blocks == 8
    assert backing.mapped == {0, 4, 8, 12}  # the guard block's page, in the 4 regions
    assert st.k[1].shape == (8, 16, 2, 64) and st.v[1].is_contiguous()
    st.on_alloc([1, 2])  # block 1 shares page 0 with the guard; block 2 opens page 1
    assert backing.mapped == {0, 1, 4, 5, 8, 9, 12, 13}
    st.on_free([2])
    assert backing.mapped == {0, 4, 8, 12}
    st.on_free([1])
    assert backing.mapped == {0, 4, 8, 12}  # the guard stays
    st.on_alloc([7])
    with pytest.raises(RuntimeError, match="unmapped page"):
        st.check_blocks(torch.tensor([GUARD_BLOCK, 7, 5]))


def test_debug_check_reads_the_full_layers_pages_not_the_window_layers():
    """On a hybrid model whose first layer slides (Gemma3), a narrowed block's pages leave the
    window layer's regions (regions 0-1 here) but stay in the full layer's: the debug check
    passes for it, and fails for a block whose full-layer page is really gone. (It looked up
    region pages as arena pages, so it read region 0 -- the window layer -- and raised
    "block ... lies on unmapped page 1" on the H200 for a block the kernels may read.)"""
    backing = RecordingBacking(4 * 64 * KiB, 16 * KiB)
    st = KVStorage(
        backing, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32,
        block_tokens=16, window_layers=(0,),
    )  # fmt: skip
    blocks = [int(b) for b in torch.randperm(st.num_blocks - 2)[:3] + 2]  # pages 1-3
    st.on_alloc(blocks)
    st.on_narrow(blocks)  # behind every holder's window: the window layer's pages go
    pages = {b * st.block_bytes // (16 * KiB) for b in blocks}
    assert not any(p in backing.mapped for p in pages)  # region 0 is the window layer's
    assert all(2 * st.region_pages + p in backing.mapped for p in pages)
    st.check_blocks(torch.tensor([GUARD_BLOCK, *blocks]))
    st.on_free(blocks)
    with pytest.raises(RuntimeError, match="unmapped page"):
        st.check_blocks(torch.tensor([blocks[0]]))
    backing.mapped.discard(2 * st.region_pages)  # the guard's page, gone behind the storage
    with pytest.raises(RuntimeError, match="unmapped page 0"):
        st.check_blocks(torch.tensor([GUARD_BLOCK]))


def _dense_out(q, keys, values, scale, window):
    """q: [Hq, n_q, D] for the LAST n_q of keys [Hkv, n, D] -> [n_q, Hq, D]."""
    o = dense_attention_ref(
        q[None], keys[None], values[None], causal=True, scale=scale, sliding_window=window
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 5])
def test_core_prefill_with_padding_then_decode_matches_dense(window):
    torch.manual_seed(0)
    b, hq, hkv, d, L = 3, 4, 2, 64, 2
    core = PagedKVCore(L, block_tokens=16, backing="torch")
    real = torch.ones(b, 9, dtype=torch.bool)
    real[0, :3] = False  # left padding
    real[2, :8] = False
    hist_k = [[torch.empty(hkv, 0, d) for _ in range(b)] for _ in range(L)]
    hist_v = [[torch.empty(hkv, 0, d) for _ in range(b)] for _ in range(L)]
    for step, q_len in enumerate([9, 1, 1, 7, 1]):
        mask = real if step == 0 else torch.ones(b, q_len, dtype=torch.bool)
        for layer in range(L):
            q = torch.randn(b, hq, q_len, d)
            k, v = torch.randn(b, hkv, q_len, d), torch.randn(b, hkv, q_len, d)
            plan = core.write(layer, k, v, (lambda m=mask: None if m.all() else m))
            out = core.attend(layer, q, plan, scale=0.125, sliding_window=window)
            assert out.shape == (b, q_len, hq, d)
            for i in range(b):
                keep = mask[i]
                hist_k[layer][i] = torch.cat([hist_k[layer][i], k[i][:, keep]], 1)
                hist_v[layer][i] = torch.cat([hist_v[layer][i], v[i][:, keep]], 1)
                want = _dense_out(q[i][:, keep], hist_k[layer][i], hist_v[layer][i], 0.125, window)
                torch.testing.assert_close(out[i][keep], want, rtol=1e-5, atol=1e-5)
                assert not out[i][~keep].any()  # padding rows are zeros
    assert core.length == 19 and core.seqs.lens == [16, 19, 11]
    core.release()


def test_fork_shares_blocks_and_copy_on_write_keeps_the_original():
    torch.manual_seed(1)
    core = PagedKVCore(1, block_tokens=16, backing="torch")
    k, v = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    core.write(0, k, v)
    used = core.pool.manager.num_used
    twin = core.fork()
    assert core.pool.manager.num_used == used  # shared, not copied
    q = torch.randn(1, 4, 1, 64)
    k1, v1 = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    base = core.attend(0, q, core.write(0, k1, v1), scale=None, sliding_window=None)
    k2 = torch.randn(1, 2, 1, 64)
    other = twin.attend(0, q, twin.write(0, k2, v1), scale=None, sliding_window=None)
    assert core.pool.manager.num_used == used + 1  # the half-full last block was copied once
    assert not torch.allclose(base, other)
    again = core.attend(0, q, core._plan, scale=None, sliding_window=None)
    torch.testing.assert_close(again, base)  # the fork's write did not touch the original
    twin.release()
    core.release()


def test_select_crop_and_dense_readback():
    torch.manual_seed(2)
    core = PagedKVCore(1, block_tokens=16, backing="torch")
    k, v = torch.randn(3, 2, 21, 64), torch.randn(3, 2, 21, 64)
    core.write(0, k, v)
    core.select([2, 0, 0])  # beam reorder: 2 -> 0, 0 -> 1 and 2
    kd, vd = core.dense(0)
    torch.testing.assert_close(kd, k[[2, 0, 0]])
    core.crop(6)
    kd, vd = core.dense(0)
    assert core.length == 15 and kd.shape == (3, 2, 15, 64)
    torch.testing.assert_close(vd, v[[2, 0, 0], :, :15])
    assert core.pool.manager.num_used == 2  # one block each for the two distinct sequences
    core.release()


def test_dense_readback_refuses_a_cache_with_skipped_padding():
    core = PagedKVCore(1, block_tokens=16, backing="torch")
    real = torch.tensor([[False, True, True], [True, True, True]])
    core.write(0, torch.randn(2, 2, 3, 64), torch.randn(2, 2, 3, 64), lambda: real)
    with pytest.raises(NotImplementedError, match="skipped padding"):
        core.dense(0)
    with pytest.raises(NotImplementedError, match="cannot cut"):
        core.crop(2)
    core.release()


def test_layers_out_of_step_are_an_error():
    core = PagedKVCore(2, block_tokens=16, backing="torch")
    k = torch.randn(1, 2, 3, 64)
    core.write(0, k, k)
    core.write(1, k, k)
    core.write(0, k, k)  # next forward pass
    with pytest.raises(RuntimeError, match="once per forward"):
        core.write(0, k, k)  # layer 0 again before layer 1
    core.release()


def test_blocks_return_when_the_cache_object_is_dropped():
    from oxygen_torch.integrations.hf import PagedKVCache

    cache = PagedKVCache(num_layers=2, backing="torch")
    k = torch.randn(2, 2, 40, 64)
    cache.update(k, k, 0)
    manager = cache._core.pool.manager
    before = manager.num_used
    cache.update(k, k, 1)
    assert manager.num_used == before  # layers share the blocks (3 per sequence)
    assert any(s["blocks_used"] >= 6 for s in pool_stats())
    del cache
    gc.collect()
    assert manager.num_used == before - 6


def test_host_arena_maps_pages_as_blocks_are_used_and_unmaps_them_after():
    pytest.importorskip("oxygen_torch.pool")
    core = PagedKVCore(2, block_tokens=16, backing="arena", arena_bytes=64 << 20)
    k = torch.randn(2, 2, 1, 64)
    core.write(0, k, k)  # binds the pool: block 0 (guard) + one block per sequence
    arena = core.pool.storage.backing.arena
    guard_only = 4  # page 0 of each of the 4 regions (2 layers x K, V)
    assert arena.mapped_pages() == guard_only
    # 8 KiB blocks, 256 per 2 MiB page: 2 x 263 blocks + the guard span 3 pages per region
    big = PagedKVCore(2, block_tokens=16, backing="arena", arena_bytes=64 << 20)
    x = torch.randn(2, 2, 4200, 64)
    big.write(0, x, x)
    big.write(1, x, x)
    assert arena is big.pool.storage.backing.arena and arena.mapped_pages() == 4 * 3
    kd, _ = big.dense(1)
    torch.testing.assert_close(kd, x)  # the data really went through the mapped arena
    big.release()
    assert arena.mapped_pages() == guard_only
    core.release()


@pytest.mark.parametrize("window", [None, 3])
def test_cpu_paged_attention_matches_the_float64_references(window):
    from oxygen_torch.triton_kernels.reference import paged_decode_ref, paged_prefill_ref

    from oxygen_torch.kv.attention import paged_attention

    torch.manual_seed(4)
    k_cache, v_cache = torch.randn(12, 4, 2, 64), torch.randn(12, 4, 2, 64)
    table = torch.randperm(12)[:9].view(3, 3).to(torch.int32)
    lens = torch.tensor([9, 0, 12], dtype=torch.int32)
    q = torch.randn(3, 4, 64)
    want = paged_decode_ref(q, k_cache, v_cache, table, lens, sliding_window=window)
    got = paged_attention(q, k_cache, v_cache, table, lens, sliding_window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    cu = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    q = torch.randn(11, 4, 64)
    want = paged_prefill_ref(q, k_cache, v_cache, table, cu, lens, sliding_window=window, scale=0.2)
    got = paged_attention(q, k_cache, v_cache, table, lens, cu, sliding_window=window, scale=0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_emptied_pages_wait_for_their_event_and_can_be_reused_before():
    class Event:
        done = False

        def query(self):
            return self.done

    backing = RecordingBacking(4 * 64 * KiB, 16 * KiB)
    st = KVStorage(
        backing, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_tokens=16
    )
    st.on_alloc([2, 4])  # pages 1 and 2
    ev = Event()
    st._all.live[1] -= 1  # free blocks 2 and 4 as on_free does on a GPU: retire, no unmap
    st._all.live[2] -= 1
    st._retired.append((ev, st._all, [1, 2]))
    st._reap()
    assert {1, 2} <= backing.mapped  # kernels queued before the free may still read them
    st.on_alloc([3])  # page 1 comes back into use while still mapped: no second map
    ev.done = True
    st._reap()
    assert 1 in backing.mapped and 2 not in backing.mapped and 6 not in backing.mapped


def _fp8_close(got, want):
    """e4m3 keeps 3 mantissa bits: a value is off by at most 1/16 of itself, or (subnormal
    codes) a few 2^-9 steps of its block's scale, itself <= amax x 4 / 448."""
    amax = want.abs().amax()
    bound = want.abs() / 16 + amax * 4 / 448 * 2**-9 * 2
    assert ((got - want).abs() <= bound).all(), (got - want).abs().max()
    assert (got - want).abs().max() > 0  # really quantised


def test_fp8_core_stores_codes_and_scales_in_mapped_pages():
    pytest.importorskip("oxygen_torch.pool")
    torch.manual_seed(3)
    core = PagedKVCore(2, block_tokens=16, backing="arena", arena_bytes=64 << 20,
                       kv_dtype="fp8_e4m3")  # fmt: skip
    ref = PagedKVCore(2, block_tokens=16, backing="arena", arena_bytes=64 << 20)
    ks, vs = [], []
    for q_len in (21, 1, 1, 12):
        k, v = torch.randn(2, 2, q_len, 64) * 3, torch.randn(2, 2, q_len, 64)
        ks.append(k)
        vs.append(v)
        for layer in range(2):
            core.write(layer, k, v)
            ref.write(layer, k, v)
    pool = core.pool
    assert pool.storage.k[0].dtype == torch.float8_e4m3fn
    assert pool.k_scale(1).shape == (pool.storage.num_blocks, 2)
    st = next(p for p in pool_stats() if p["dtype"] == "float8_e4m3fn")
    base = next(p for p in pool_stats() if p["dtype"] == "float32")
    # 1-byte codes against 4-byte floats; the scales' pages count in the pool's mapped bytes
    assert st["block_bytes_all_layers"] * 4 == base["block_bytes_all_layers"]
    assert pool.scales.mapped_bytes() == 4 * (2 << 20)  # one page in each of the 4 regions
    assert st["mapped_bytes"] == pool.storage.mapped_bytes() + pool.scales.mapped_bytes()
    kd, vd = core.dense(1)
    _fp8_close(kd, torch.cat(ks, 2))
    _fp8_close(vd, torch.cat(vs, 2))
    # attention over the codes = attention over their dequantised values, which the dense
    # readback gives: decode and prefill against the float64 reference
    for q_len in (1, 5):
        q = torch.randn(2, 4, q_len, 64)
        k, v = torch.randn(2, 2, q_len, 64), torch.randn(2, 2, q_len, 64)
        out = core.attend(0, q, core.write(0, k, v), scale=0.125, sliding_window=None)
        core.write(1, k, v)
        kd, vd = core.dense(0)
        for i in range(2):
            want = _dense_out(q[i].double(), kd[i].double(), vd[i].double(), 0.125, None)
            torch.testing.assert_close(out[i], want.float(), rtol=1e-4, atol=1e-4)
    core.release()
    ref.release()


def test_fp8_fork_copies_the_scales_of_a_shared_block():
    torch.manual_seed(4)
    core = PagedKVCore(1, block_tokens=16, backing="torch", kv_dtype="fp8_e4m3")
    k = torch.randn(1, 2, 20, 64)
    core.write(0, k, k)
    twin = core.fork()
    k2 = torch.randn(1, 2, 1, 64) * 100  # a large token: the copy's block keeps the old scale
    twin.write(0, k2, k2)
    core.write(0, k[:, :, :1], k[:, :, :1])
    a, _ = core.dense(0)
    b, _ = twin.dense(0)
    torch.testing.assert_close(a[:, :, :20], b[:, :, :20])  # the copied block: same values
    _fp8_close(a[:, :, :20], k)
    twin.release()
    core.release()


def test_kv_dtype_must_be_known_and_match_a_16_bit_model():
    with pytest.raises(ValueError, match="kv_dtype 'int4' is not allowed"):
        PagedKVCore(1, kv_dtype="int4")
    core = PagedKVCore(1, backing="torch", kv_dtype="bf16")
    with pytest.raises(ValueError, match="kv.kv_dtype='bf16' with a torch.float32 model"):
        core.write(0, torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    assert core.pool is None  # nothing was bound


class _OOMOnce(RecordingBacking):
    """Its next `fails` page maps fail as the device's out of memory does."""

    def __init__(self, nbytes, page_size, fails):
        super().__init__(nbytes, page_size)
        self.fails = fails

    def map_pages(self, first, count):
        if self.fails:
            self.fails -= 1
            from oxygen_torch.pool.native import NativeError

            raise NativeError(5, "map_pages: out of memory")
        super().map_pages(first, count)


@pytest.mark.parametrize("fails", [1, 2])
def test_kv_growth_takes_the_pools_idle_pages_back_before_it_reports_out_of_memory(
    monkeypatch, fails
):
    """The activations' pool keeps idle pages mapped while allocations come: a KV block whose
    pages do not fit asks the pool to unmap its idle pages and maps again, once; out of memory
    after that is reported as torch.OutOfMemoryError, with nothing left mapped."""
    from oxygen_torch.pool import stats

    emptied = []
    monkeypatch.setattr(stats, "empty_cache", lambda: emptied.append(1))
    backing = _OOMOnce(4 * 64 * KiB, 16 * KiB, fails=0)
    st = KVStorage(
        backing, num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_tokens=16
    )
    before = set(backing.mapped)
    backing.fails = fails
    block = random.choice([2, 4, 6])  # a block opening a page of its own
    if fails == 1:
        st.on_alloc([block])
        assert emptied == [1] and len(backing.mapped) == len(before) + 4
    else:
        with pytest.raises(torch.OutOfMemoryError, match="no device memory"):
            st.on_alloc([block])
        assert emptied == [1] and backing.mapped == before
