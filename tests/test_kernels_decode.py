"""paged_decode against the float64 reference, in Triton's CPU interpreter (fp16/fp32, fp8 codes).

Shapes are tiny (the interpreter runs every program in Python) but cover: ragged lengths not
multiples of the block, shuffled tables, GQA 2:1 / 3:1 / 7:1 / MQA, padded head dim 80, sliding
windows, seq_len 0, split-K forced on and off, every precision mode, fp8 KV codes.
"""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels import LaunchConfig, PrecisionMode, paged_decode, paged_decode_ref
from oxygen_torch.triton_kernels.tiling import Tiles
from test_kernels_helpers import assert_close_rel, make_paged, poisoned_like, randn

CASES = [
    # (lens, q_heads, kv_heads, head_dim, block_tokens, window)
    pytest.param([37, 70, 5], 4, 2, 64, 16, None, id="gqa2-bt16"),
    pytest.param([50, 96], 7, 1, 80, 32, None, id="gqa7-d80-bt32"),
    pytest.param([45, 9, 64], 6, 2, 64, 16, 20, id="gqa3-window20"),
    pytest.param([0, 33], 8, 8, 64, 16, None, id="mha-empty-seq"),
]


def _run(p, q, precision=PrecisionMode.AUTO_MIXED, **kw):
    out = poisoned_like(q)
    res = paged_decode(
        q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, out=out, precision=precision,
        k_scale=p.k_scale, v_scale=p.v_scale, **kw,
    )  # fmt: skip
    assert res is out
    return out


def _ref(p, q, **kw):
    return paged_decode_ref(
        q.double(), p.k_cache, p.v_cache, p.block_table, p.seq_lens,
        k_scale=p.k_scale, v_scale=p.v_scale, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("lens,hq,hkv,d,bt,window", CASES)
def test_decode_matches_reference(lens, hq, hkv, d, bt, window, splits, dtype):
    p = make_paged(lens, hkv, d, bt, dtype, seed=len(lens) + hq)
    q = randn((len(lens), hq, d), dtype, seed=hq)
    out = _run(p, q, sliding_window=window, num_splits=splits)
    assert_close_rel(out, _ref(p, q, sliding_window=window), dtype)
    for b, n in enumerate(lens):
        if n == 0:
            assert (out[b] == 0).all(), "seq_len 0 must give zeros"


@pytest.mark.parametrize("precision", list(PrecisionMode))
def test_decode_precision_modes(precision):
    p = make_paged([40, 77], 2, 64, 16, torch.float16, seed=3)
    q = randn((2, 8, 64), torch.float16, seed=4)
    err = assert_close_rel(_run(p, q, precision=precision, num_splits=2), _ref(p, q), q.dtype)
    assert err > 0  # a half output cannot be exact: the comparison really ran


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("precision", list(PrecisionMode))
def test_decode_fp8_codes(splits, precision):
    p = make_paged([29, 81, 16], 2, 64, 16, torch.uint8, seed=5)
    q = randn((3, 6, 64), torch.float16, seed=6)
    out = _run(p, q, precision=precision, num_splits=splits, sliding_window=50)
    assert_close_rel(out, _ref(p, q, sliding_window=50), torch.float16)


@pytest.mark.parametrize("fp8_words", [True, False])
def test_decode_fp8_both_loads(fp8_words):
    """fp8 codes loaded as int32 words (the default) and as bytes (kept for the H200 to time
    against it) give the reference's output, split and not."""
    p = make_paged([45, 19, 70], 2, 64, 16, torch.uint8, seed=29)
    q = randn((3, 4, 64), torch.float16, seed=30)
    for splits in (1, 3):
        cfg = LaunchConfig(16, 16, 4, 2, num_splits=splits, fp8_words=fp8_words)
        assert_close_rel(_run(p, q, launch=cfg), _ref(p, q), torch.float16)
    with pytest.raises(ValueError, match="fp8_words"):
        LaunchConfig(16, 16, 4, 2, fp8_words=1)


@pytest.mark.parametrize("fp8_words", [True, False])
@pytest.mark.parametrize("d", [64, 80])
def test_decode_fp8_prefetch_gives_the_reference(fp8_words, d):
    """fp8_prefetch (the next key tile's codes and scales loaded before this tile computes):
    the reference's output, with ragged lengths, an empty row, a window, splits and balanced
    mode, on whole and padded head dims; a bf16-style cache ignores the flag."""
    p = make_paged([45, 0, 19, 70], 2, d, 16, torch.uint8, seed=31 + d)
    q = randn((4, 4, d), torch.float16, seed=32 + d)
    for window in (None, 24):
        ref = _ref(p, q, sliding_window=window)
        for splits in (1, 3):
            cfg = LaunchConfig(16, 16, 4, 2, num_splits=splits, fp8_words=fp8_words,
                               fp8_prefetch=True)  # fmt: skip
            out = _run(p, q, launch=cfg, sliding_window=window)
            assert_close_rel(out, ref, torch.float16)
            assert (out[1] == 0).all(), "seq_len 0 must give zeros"
        cfg = LaunchConfig(16, 16, 4, 2, fp8_words=fp8_words, fp8_prefetch=True)
        assert_close_rel(_run(p, q, launch=cfg, sliding_window=window, balance=True), ref,
                         torch.float16)  # fmt: skip
    h = make_paged([33, 8], 2, d, 16, torch.float16, seed=33)
    qh = randn((2, 4, d), torch.float16, seed=34)
    out = _run(h, qh, launch=LaunchConfig(16, 16, 4, 2, fp8_prefetch=True))
    assert_close_rel(out, _ref(h, qh), torch.float16)
    with pytest.raises(ValueError, match="fp8_prefetch"):
        LaunchConfig(16, 16, 4, 2, fp8_prefetch="yes")


def test_decode_fp8_head_dim_80_and_fp32_queries():
    """A padded head dim (80 of 128 columns: the int32 words past it masked) and fp32 queries,
    which the fp8 path scales into fp16 for its dots."""
    p = make_paged([40, 17], 3, 80, 16, torch.uint8, seed=21)
    for precision in (PrecisionMode.AUTO_MIXED, PrecisionMode.FP32_SAFE):
        q = randn((2, 6, 80), torch.float32, seed=22)
        out = _run(p, q, precision=precision, num_splits=2)
        assert_close_rel(out, _ref(p, q), torch.float16)


@pytest.mark.parametrize("precision", list(PrecisionMode))
def test_decode_fp8_every_code_is_decoded_exactly(precision):
    """One key per sequence: the output is that key's V row, code value x scale, so every
    finite e4m3 code (254 of 256, the two NaN codes left out), each in its own column, must come
    back exactly: the integer decode and the tile's column order, element by element."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # 254 finite codes
    codes = torch.cat([codes, torch.tensor([0x01, 0x81], dtype=torch.uint8)])  # 256: 2 rows
    p = make_paged([1, 1], 1, 128, 16, torch.uint8, seed=23)
    for b in range(2):
        blk = int(p.block_table[b, 0])
        p.v_cache[blk, 0, 0] = codes[b * 128 : (b + 1) * 128]
    q = randn((2, 2, 128), torch.float32, seed=24)
    out = _run(p, q, precision=precision)
    ref = _ref(p, q)
    torch.testing.assert_close(out.to(torch.float64), ref, rtol=2e-7, atol=0)


@pytest.mark.parametrize("magnitude", [1e-6, 1e7])
def test_decode_fp8_queries_far_outside_fp16s_range(magnitude):
    """The fp8 path's dots run in fp16: a query far above its range (or far below its
    normals) is scaled by a power of two into it and back, so the output is the reference's,
    not inf or a softmax of clamped scores."""
    p = make_paged([24, 50], 1, 64, 16, torch.uint8, seed=25)
    q = randn((2, 2, 64), torch.float32, seed=26) * magnitude
    out = _run(p, q, num_splits=2)
    assert_close_rel(out, _ref(p, q), torch.float16)


def test_decode_fp8_cache_off_a_word_boundary_is_refused():
    p = make_paged([20], 1, 64, 16, torch.uint8, seed=27)
    flat = torch.zeros(p.k_cache.numel() + 1, dtype=torch.uint8)
    k = flat[1:].view(p.k_cache.shape)  # one byte past a 4-byte boundary
    with pytest.raises(ValueError, match="4-byte boundary"):
        paged_decode(
            randn((1, 1, 64), torch.float16, seed=28), k, k, p.block_table, p.seq_lens,
            k_scale=p.k_scale, v_scale=p.v_scale,
        )  # fmt: skip


def test_decode_window_wider_than_sequence_is_no_window():
    p = make_paged([20, 41], 1, 64, 16, torch.float32, seed=7)
    q = randn((2, 2, 64), torch.float32, seed=8)
    torch.testing.assert_close(_run(p, q, sliding_window=1000), _run(p, q), rtol=0, atol=0)


def test_decode_window_one_is_last_value():
    """W = 1: each query sees only itself, so the output is its own V row."""
    p = make_paged([20, 41], 1, 64, 16, torch.float32, seed=9)
    q = randn((2, 3, 64), torch.float32, seed=10)
    out = _run(p, q, sliding_window=1, num_splits=2)
    for b, n in enumerate([20, 41]):
        blk = p.block_table[b, (n - 1) // 16]
        v_last = p.v_cache[blk, (n - 1) % 16, 0]
        torch.testing.assert_close(out[b], v_last.expand(3, 64), rtol=1e-6, atol=1e-6)


def test_decode_split_choice_is_automatic_and_matches():
    """num_splits=None picks splits from the grid (tiny batch -> split); results agree."""
    p = make_paged([300], 1, 64, 16, torch.float32, seed=11)
    q = randn((1, 4, 64), torch.float32, seed=12)
    torch.testing.assert_close(_run(p, q), _run(p, q, num_splits=1), rtol=1e-5, atol=1e-6)


def test_decode_strided_q_and_out():
    """q and out may be views (e.g. slices of a fused QKV tensor)."""
    p = make_paged([33, 18], 2, 64, 16, torch.float32, seed=13)
    big = randn((2, 12, 64), torch.float32, seed=14)
    q = big[:, 2:6]  # [2, 4, 64], stride(0) = 12 * 64
    out_big = torch.full((2, 9, 64), float("nan"))
    out = out_big[:, 3:7]
    paged_decode(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens, out=out)
    assert_close_rel(out, _ref(p, q), torch.float32)
    assert torch.isnan(out_big[:, :3]).all() and torch.isnan(out_big[:, 7:]).all()


def test_decode_float8_storage_equals_uint8_codes():
    """torch.float8_e4m3fn caches (the GPU dtype) read exactly like their uint8 codes."""
    p = make_paged([30, 47], 2, 64, 16, torch.uint8, seed=15)
    q = randn((2, 4, 64), torch.float16, seed=16)
    codes = _run(p, q, num_splits=2)
    p.k_cache = p.k_cache.view(torch.float8_e4m3fn)
    p.v_cache = p.v_cache.view(torch.float8_e4m3fn)
    torch.testing.assert_close(_run(p, q, num_splits=2), codes, rtol=0, atol=0)


# Balanced mode: the key work cut into chunks of about equal size from the lengths on the device.
# Key tiles of 16 make a chunk as short as 64 keys, so a few hundred keys take several chunks.
BALANCED_CASES = [
    # (lens, q_heads, kv_heads, head_dim, window): the long row first, last, in the middle
    pytest.param([700, 20, 33, 5], 4, 2, 64, None, id="skewed-first"),
    pytest.param([9, 0, 31, 16, 450], 6, 2, 64, None, id="skewed-last-empty"),
    pytest.param([40, 610, 77], 7, 1, 80, 300, id="gqa7-window300"),
    pytest.param([130, 129, 131], 8, 8, 64, None, id="uniform-mha"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,hq,hkv,d,window", BALANCED_CASES)
def test_decode_balanced_matches_reference(lens, hq, hkv, d, window, dtype):
    from oxygen_torch.triton_kernels.paged_decode import balance_target, balanced_chunks

    p = make_paged(lens, hkv, d, 16, dtype, seed=sum(lens) % 97)
    q = randn((len(lens), hq, d), dtype, seed=hq + d)
    tiles = Tiles(block_n=16, balance=True)
    out = _run(p, q, sliding_window=window, tiles=tiles)
    assert_close_rel(out, _ref(p, q, sliding_window=window), dtype)
    # the case really cut rows into several chunks (the combine ran)
    target = balance_target(hkv, 1, 132)  # the interpreter plays an H200's 132 SMs
    n = balanced_chunks(lens, window or 1 << 30, p.block_table.shape[1] * 16, 16, target)
    assert max(n) > 1 and sum(n) < len(lens) + target
    for b, length in enumerate(lens):
        if length == 0:
            assert (out[b] == 0).all(), "seq_len 0 must give zeros"


def test_decode_balanced_cuts_the_long_row_into_about_equal_chunks():
    """The host mirror of the device's cut (what the tests and benchmarks read): one 32k row
    beside 31 of 512 on an H200's shape (8 KV heads, 64-key tiles) takes ~23 chunks of ~1.5k
    keys, the short rows one each; uniform rows that fill the GPU stay one program a row."""
    from oxygen_torch.triton_kernels.paged_decode import balance_target, balanced_chunks

    target = balance_target(8, 1, 132)
    skewed = balanced_chunks([32768] + [512] * 31, 1 << 30, 32768, 64, target)
    assert skewed[1:] == [1] * 31 and 20 <= skewed[0] <= 24
    assert balanced_chunks([1024] * 64, 1 << 30, 1024, 64, target) == [1] * 64
    one = balanced_chunks([32768], 1 << 30, 32768, 64, target)  # the classic grid's 33 splits
    assert one == [33]
    rng = torch.Generator().manual_seed(0)
    for _ in range(200):  # the grid's bound holds for any lengths
        lens = torch.randint(0, 70000, (int(torch.randint(1, 300, (1,), generator=rng)),),
                             generator=rng).tolist()  # fmt: skip
        for t in (1, 5, 33, 264):
            assert sum(balanced_chunks(lens, 1 << 30, 70000, 64, t)) < len(lens) + t


def test_decode_balanced_fp8_codes_and_precisions():
    p = make_paged([29, 400, 16], 2, 64, 16, torch.uint8, seed=31)
    q = randn((3, 6, 64), torch.float16, seed=32)
    for precision in list(PrecisionMode):
        out = _run(p, q, precision=precision, sliding_window=350,
                   tiles=Tiles(block_n=16, balance=True))  # fmt: skip
        assert_close_rel(out, _ref(p, q, sliding_window=350), torch.float16)


def test_decode_balanced_equals_classic_and_refuses_conflicting_choices():
    p = make_paged([500, 12, 40], 2, 64, 16, torch.float32, seed=33)
    q = randn((3, 4, 64), torch.float32, seed=34)
    classic = _run(p, q, tiles=Tiles(block_n=16))
    torch.testing.assert_close(_run(p, q, tiles=Tiles(block_n=16), balance=True), classic,
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="num_splits: given with balance=True"):
        _run(p, q, num_splits=2, balance=True)
    with pytest.raises(ValueError, match="balance: 1 must be"):
        _run(p, q, balance=1)
    with pytest.raises(ValueError, match="tiles.balance"):
        Tiles(balance="yes")
