"""GPU tests of the kernels (H200): bf16, fp16 and real float8_e4m3fn KV at realistic shapes
against the float64 reference (computed on the GPU), every head dim, every tile choice the rule
makes for the common models, and CUDA-graph capture of the decode step. Skipped on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
from oxygen_torch.triton_kernels import (
    LaunchConfig,
    PrecisionMode,
    TileQuery,
    choices,
    kv_append,
    kv_append_ref,
    paged_decode,
    paged_decode_ref,
    paged_prefill,
    paged_prefill_ref,
    select_block_size,
    select_num_stages,
    select_num_warps,
)
from oxygen_torch.triton_kernels.reference import fp8_codes_to_float
from oxygen_torch.triton_kernels.tiling import clear_choices
from test_kernels_helpers import assert_close_rel, make_paged, poisoned_like, randn

from oxygen_torch.config import KernelConfig
from oxygen_torch.config.profiles import get_profile
from oxygen_torch.kv.attention import paged_attention, tiles_for

pytestmark = pytest.mark.cuda
CUDA = "cuda"
BF16, FP16 = torch.bfloat16, torch.float16


def _lens(batch, max_len, seed):
    """Ragged lengths in [1, max_len], one of them exactly max_len, most not block multiples."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen).tolist()
    lens[0] = max_len
    return lens


def _decode(p, q, **kw):
    out = poisoned_like(q)
    paged_decode(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, out=out,
                 k_scale=p.k_scale, v_scale=p.v_scale, **kw)  # fmt: skip
    ref = paged_decode_ref(q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                           k_scale=p.k_scale, v_scale=p.v_scale,
                           sliding_window=kw.get("sliding_window"))  # fmt: skip
    return out, ref


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("bt", [16, 64])
@pytest.mark.parametrize("batch,max_len", [(32, 4096), (3, 4096), (1, 20000)])
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_realistic(batch, max_len, bt, dtype, splits):
    p = make_paged(_lens(batch, max_len, seed=batch), 8, 128, bt, dtype, device=CUDA, seed=bt)
    q = randn((batch, 32, 128), dtype, seed=1, device=CUDA)
    out, ref = _decode(p, q, num_splits=splits)
    assert_close_rel(out, ref, dtype)


@pytest.mark.parametrize("window", [1, 100, 4000])
def test_decode_sliding_window(window):
    p = make_paged(_lens(16, 5000, seed=2), 8, 128, 16, BF16, device=CUDA)
    q = randn((16, 32, 128), BF16, seed=3, device=CUDA)
    out, ref = _decode(p, q, sliding_window=window)
    assert_close_rel(out, ref, BF16)


@pytest.mark.parametrize("precision", list(PrecisionMode))
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_decode_precision_modes(precision, dtype):
    p = make_paged(_lens(8, 3000, seed=4), 8, 128, 16, dtype, device=CUDA)
    q = randn((8, 32, 128), dtype, seed=5, device=CUDA)
    out, ref = _decode(p, q, precision=precision)
    assert_close_rel(out, ref, dtype)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("hq,hkv", [(28, 4), (8, 1), (16, 16)])
def test_head_dims_and_group_sizes(d, hq, hkv):
    lens = _lens(5, 700, seed=d)
    p = make_paged(lens, hkv, d, 32, BF16, device=CUDA, seed=hq)
    q = randn((5, hq, d), BF16, seed=6, device=CUDA)
    out, ref = _decode(p, q)
    assert_close_rel(out, ref, BF16)
    cu = torch.tensor([0, 1, 50, 50, 300, 301], dtype=torch.int32, device=CUDA)
    qp = randn((301, hq, d), BF16, seed=7, device=CUDA)
    outp = poisoned_like(qp)
    paged_prefill(qp, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, out=outp)
    refp = paged_prefill_ref(qp.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens)
    assert_close_rel(outp, refp, BF16)


def _fp8_cache(lens, bt, hkv=8, d=128, seed=0):
    """Fill a float8_e4m3fn cache with kv_append from bf16 values (the real write path)."""
    p = make_paged(lens, hkv, d, bt, BF16, device=CUDA, seed=seed)
    nb = p.k_cache.shape[0]
    kc = torch.zeros(p.k_cache.shape, dtype=torch.float8_e4m3fn, device=CUDA)
    vc = torch.zeros_like(kc)
    ks = torch.zeros(nb, hkv, device=CUDA)
    vs = torch.zeros(nb, hkv, device=CUDA)
    slots = []
    for b, n in enumerate(lens):
        pos = torch.arange(n, device=CUDA)
        slots.append(p.block_table[b, pos // bt].long() * bt + pos % bt)
    slots = torch.cat(slots)
    k = randn((slots.numel(), hkv, d), BF16, seed=seed + 1, device=CUDA)
    v = randn((slots.numel(), hkv, d), BF16, seed=seed + 2, device=CUDA)
    kv_append(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    return p, kc, vc, ks, vs, (k, v, slots)


@pytest.mark.parametrize("bt", [16, 64])
def test_kv_append_fp8_matches_reference(bt):
    p, kc, vc, ks, vs, (k, v, slots) = _fp8_cache(_lens(6, 1000, seed=8), bt)
    zeros = torch.zeros_like(kc)
    rk, rv, rks, rvs = kv_append_ref(
        k,
        v,
        zeros,
        zeros.clone(),
        slots,
        k_scale=torch.zeros_like(ks),
        v_scale=torch.zeros_like(vs),
    )
    torch.testing.assert_close(ks, rks, rtol=0, atol=0)
    torch.testing.assert_close(vs, rvs, rtol=0, atol=0)
    # codes: equal but for rare last-bit differences of the GPU's fp32 division
    same = (kc.view(torch.uint8) == rk.view(torch.uint8)).float().mean().item()
    assert same > 0.999, f"only {same:.5f} of the codes match"
    deq = fp8_codes_to_float(kc) - fp8_codes_to_float(rk)
    assert deq.abs().max().item() <= 32  # at most one e4m3 step (32 at the top binade)


@pytest.mark.parametrize("bt", [16, 64])
@pytest.mark.parametrize("precision", [PrecisionMode.FP16_ONLY, PrecisionMode.AUTO_MIXED])
@pytest.mark.parametrize("qdtype", [BF16, FP16])
def test_decode_fp8_realistic(bt, precision, qdtype):
    lens = _lens(32, 4096, seed=9)
    p, kc, vc, ks, vs, _ = _fp8_cache(lens, bt, seed=10)
    p.k_cache, p.v_cache, p.k_scale, p.v_scale = kc, vc, ks, vs
    q = randn((32, 32, 128), qdtype, seed=11, device=CUDA)
    out, ref = _decode(p, q, precision=precision)
    assert_close_rel(out, ref, qdtype)


@pytest.mark.parametrize("fp8_words", [True, False])
@pytest.mark.parametrize("bt", [16, 64])
def test_decode_fp8_prefetch_on_the_gpu(bt, fp8_words):
    """fp8_prefetch compiled for the GPU (the next tile's codes in registers while this one
    computes): the reference's output on the rule's tiles and on 128-key tiles, split, unsplit
    and balanced, over a long skewed batch."""
    lens = _lens(16, 8192, seed=15) + [0, 20000]
    p, kc, vc, ks, vs, _ = _fp8_cache(lens, bt, seed=16)
    p.k_cache, p.v_cache, p.k_scale, p.v_scale = kc, vc, ks, vs
    q = randn((len(lens), 32, 128), BF16, seed=17, device=CUDA)
    for block_n, warps in ((64, 4), (128, 8)):
        for splits in (1, 4, None):  # None: balanced mode
            launch = LaunchConfig(16, block_n, warps, 3, num_splits=splits, fp8_words=fp8_words,
                                  fp8_prefetch=True)  # fmt: skip
            out, ref = _decode(p, q, launch=launch, balance=splits is None)
            assert_close_rel(out, ref, BF16)


def _prefill_case(dtype, bt, window=None, fp8=False):
    lens = [1024, 777, 2048, 300]
    new = [1024, 100, 513, 1]  # a dense prefill, prefixes, a single token
    cu = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32, device=CUDA)
    if fp8:
        p, kc, vc, ks, vs, _ = _fp8_cache(lens, bt, seed=12)
        p.k_cache, p.v_cache, p.k_scale, p.v_scale = kc, vc, ks, vs
    else:
        p = make_paged(lens, 8, 128, bt, dtype, device=CUDA, seed=13)
    q = randn((int(cu[-1]), 32, 128), dtype, seed=14, device=CUDA)
    out = poisoned_like(q)
    kw = dict(k_scale=p.k_scale, v_scale=p.v_scale, sliding_window=window)
    paged_prefill(q, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, out=out, **kw)
    ref = paged_prefill_ref(q.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, **kw)
    return out, ref


@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize("bt", [16, 64])
@pytest.mark.parametrize("window", [None, 256])
def test_prefill_realistic(dtype, bt, window):
    out, ref = _prefill_case(dtype, bt, window)
    assert_close_rel(out, ref, dtype)


def test_prefill_fp8():
    out, ref = _prefill_case(BF16, 64, fp8=True)
    assert_close_rel(out, ref, BF16)


def _gpu_choices():
    """(phase, launch, head_dim, storage dtype) the rule picks for common model shapes."""
    found = set()
    grid = itertools.product(
        [1024, 4096],
        [64, 128, 256],
        [(32, 8), (28, 4)],
        [BF16, torch.uint8],
        ["decode", "prefill"],
        [40, 4096],
    )
    for hidden, d, (hq, hkv), dt, phase, n in grid:
        tq = TileQuery(hidden, d, hq, hkv, dt, phase, n)
        bm, bn = select_block_size(tq)
        cfg = LaunchConfig(bm, bn, select_num_warps(tq, bm, bn), select_num_stages(tq))
        found.add((phase, cfg, d, dt))
    return sorted(found, key=str)


@pytest.mark.parametrize("phase,launch,d,dt", _gpu_choices(), ids=str)
def test_every_common_choice_compiles_and_is_correct(phase, launch, d, dt):
    if dt == torch.uint8:
        p, kc, vc, ks, vs, _ = _fp8_cache([300, 129], 16, hkv=4, d=d, seed=15)
        p.k_cache, p.v_cache, p.k_scale, p.v_scale = kc, vc, ks, vs
    else:
        p = make_paged([300, 129], 4, d, 16, dt, device=CUDA, seed=15)
    kw = dict(k_scale=p.k_scale, v_scale=p.v_scale, launch=launch)
    if phase == "decode":
        q = randn((2, 28, d), BF16, seed=16, device=CUDA)
        out, ref = _decode(p, q, launch=launch)  # _decode passes p's scales itself
    else:
        cu = torch.tensor([0, 200, 329], dtype=torch.int32, device=CUDA)
        q = randn((329, 28, d), BF16, seed=17, device=CUDA)
        out = poisoned_like(q)
        paged_prefill(q, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, out=out, **kw)
        kw.pop("launch")
        ref = paged_prefill_ref(q.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens,
                                **kw)  # fmt: skip
    assert_close_rel(out, ref, BF16)


def test_decode_step_is_cuda_graph_capturable():
    """No host synchronisation inside: capture once, change seq_lens in place, replay."""
    lens = _lens(8, 2000, seed=18)
    p = make_paged([n + 50 for n in lens], 8, 128, 16, BF16, device=CUDA)
    p.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    q = randn((8, 32, 128), BF16, seed=19, device=CUDA)
    out = torch.empty_like(q)
    args = (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    paged_decode(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(*args, out=out)
    for step in range(3):
        p.seq_lens.add_(7 * step)
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_decode_ref(q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens)
        assert_close_rel(out, ref, BF16)


@pytest.mark.parametrize("kv", [BF16, "fp8"])
@pytest.mark.parametrize("lens", [[20000] + [512] * 31, [300] * 40 + [9000], [4096] * 32, [1]])
def test_decode_balanced_realistic_and_in_a_graph(lens, kv):
    """Balanced mode at realistic shapes (a long row among short ones, first or last; uniform;
    one token) against the reference, and captured once then replayed as lengths change: the
    chunks follow the lengths on the device."""
    dtype = torch.uint8 if kv == "fp8" else kv
    p = make_paged([n + 700 for n in lens], 8, 128, 16, dtype, device=CUDA, seed=len(lens))
    p.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    q = randn((len(lens), 32, 128), BF16, seed=5, device=CUDA)
    out, ref = _decode(p, q, balance=True)
    assert_close_rel(out, ref, BF16)
    args = (q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    kw = dict(k_scale=p.k_scale, v_scale=p.v_scale, balance=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode(*args, out=out, **kw)
    grow = torch.zeros(len(lens), dtype=torch.int32, device=CUDA)
    for step in (1, 2):
        if step == 1:
            grow[-1] = 600  # the last row alone grows (the skew moves), then every row
        else:
            grow.fill_(100)
        p.seq_lens.add_(grow)
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_decode_ref(q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens,
                               k_scale=p.k_scale, v_scale=p.v_scale)  # fmt: skip
        assert_close_rel(out, ref, BF16)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_dispatch_passes_profile_tiles_to_the_kernels(phase):
    """paged_attention (the one dispatch) with the llama profile's tiles (64, 64 after rounding):
    the launch on the GPU takes them (prefill: both; decode: the key tile), values as before."""
    profile = get_profile("llama", {"llama": {"block_size": [96, 96]}})  # the seed's, rounded
    tiles = tiles_for(KernelConfig(block_n=32), profile)  # (64, 32): kernel wins
    p = make_paged(_lens(4, 3000, seed=20), 8, 128, 16, BF16, device=CUDA, seed=21)
    clear_choices()
    if phase == "decode":
        q = randn((4, 32, 128), BF16, seed=22, device=CUDA)
        out = paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, tiles=tiles)
        ref = paged_decode_ref(q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens)
        want = (16, 32)  # block_m: the GQA group of 4, padded to 16
    else:
        cu = torch.tensor([0, 300, 301, 400, 900], dtype=torch.int32, device=CUDA)
        q = randn((900, 32, 128), BF16, seed=23, device=CUDA)
        out = paged_attention(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, cu, tiles=tiles)
        ref = paged_prefill_ref(q.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens)
        want = (64, 32)
    assert [(c.block_m, c.block_n) for c in choices().values()] == [want]
    clear_choices()
    assert_close_rel(out, ref, BF16)
