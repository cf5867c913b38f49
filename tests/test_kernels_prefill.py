"""paged_prefill against the float64 reference, in Triton's CPU interpreter.

Covers dense prefill (no prefix), ragged new tokens over cached prefixes (a sequence with no new
tokens included), non-causal, sliding windows, GQA 7:1 with head dim 80, fp8 codes, and the
two key-loop phases (tiles below the diagonal and masked tiles) through small block sizes.
"""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels import (
    LaunchConfig,
    PrecisionMode,
    dense_attention_ref,
    paged_prefill,
    paged_prefill_ref,
)
from test_kernels_helpers import assert_close_rel, make_paged, poisoned_like, randn

ROWS70 = [3 + (7 * i) % 20 for i in range(70)]
NEW70 = [0 if i == 64 else (n if i in (5, 66) else 1) for i, n in enumerate(ROWS70)]
CASES = [
    # (seq_lens, new tokens per sequence, q_heads, kv_heads, head_dim, block_tokens, window)
    pytest.param([40, 23], [40, 23], 4, 2, 64, 16, None, id="dense-gqa2"),
    pytest.param([70, 12, 33], [9, 12, 0], 4, 4, 64, 16, None, id="prefix-ragged-empty"),
    pytest.param([50, 66], [17, 30], 7, 1, 80, 32, None, id="gqa7-d80-bt32"),
    pytest.param([64, 45], [20, 45], 6, 2, 64, 16, 13, id="window13"),
    # an engine step: 70 rows (past one 64-row scan chunk), most decoding one token, two
    # prefill chunks, an empty row at the chunk boundary
    pytest.param(ROWS70, NEW70, 2, 1, 64, 16, None, id="70-rows"),
]


def _cu(new):
    return torch.tensor([0] + list(torch.tensor(new).cumsum(0)), dtype=torch.int32)


def _run(p, q, cu, **kw):
    out = poisoned_like(q)
    res = paged_prefill(
        q, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, out=out,
        k_scale=p.k_scale, v_scale=p.v_scale, **kw,
    )  # fmt: skip
    assert res is out
    return out


def _ref(p, q, cu, **kw):
    return paged_prefill_ref(
        q.double(), p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens,
        k_scale=p.k_scale, v_scale=p.v_scale, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,new,hq,hkv,d,bt,window", CASES)
def test_prefill_matches_reference(lens, new, hq, hkv, d, bt, window, dtype):
    p = make_paged(lens, hkv, d, bt, dtype, seed=hq + d)
    cu = _cu(new)
    q = randn((int(cu[-1]), hq, d), dtype, seed=d)
    # 16x16 tiles: several query tiles per sequence and both key-loop phases even at this size
    launch = LaunchConfig(16, 16, 4, 2)
    out = _run(p, q, cu, sliding_window=window, launch=launch)
    assert_close_rel(out, _ref(p, q, cu, sliding_window=window), dtype)


@pytest.mark.parametrize("window", [None, 10])
def test_prefill_non_causal(window):
    p = make_paged([30, 52], 2, 64, 16, torch.float32, seed=1)
    cu = _cu([11, 20])
    q = randn((31, 4, 64), torch.float32, seed=2)
    out = _run(p, q, cu, causal=False, sliding_window=window, launch=LaunchConfig(16, 16, 4, 2))
    assert_close_rel(out, _ref(p, q, cu, causal=False, sliding_window=window), torch.float32)


@pytest.mark.parametrize("precision", list(PrecisionMode))
def test_prefill_precision_modes(precision):
    p = make_paged([48, 35], 2, 64, 16, torch.float16, seed=3)
    cu = _cu([48, 10])
    q = randn((58, 4, 64), torch.float16, seed=4)
    out = _run(p, q, cu, precision=precision)
    assert_close_rel(out, _ref(p, q, cu), torch.float16)


@pytest.mark.parametrize("precision", [PrecisionMode.FP16_ONLY, PrecisionMode.AUTO_MIXED])
def test_prefill_fp8_codes(precision):
    p = make_paged([41, 60], 2, 64, 16, torch.uint8, seed=5)
    cu = _cu([41, 7])
    q = randn((48, 4, 64), torch.float16, seed=6)
    out = _run(p, q, cu, precision=precision, sliding_window=25)
    assert_close_rel(out, _ref(p, q, cu, sliding_window=25), torch.float16)


@pytest.mark.parametrize("fp8_words", [True, False])
def test_prefill_fp8_both_loads(fp8_words):
    """fp8 codes loaded as int32 words (the default) and as bytes (kept for the H200 to time
    against it) give the reference's output, at a padded head dim."""
    p = make_paged([30, 52], 2, 80, 16, torch.uint8, seed=31)
    cu = _cu([30, 9])
    q = randn((39, 4, 80), torch.float16, seed=32)
    out = _run(p, q, cu, launch=LaunchConfig(16, 16, 4, 2, fp8_words=fp8_words))
    assert_close_rel(out, _ref(p, q, cu), torch.float16)


def test_prefill_default_tiles():
    """The tiling rule's own choice (not an override) on a dense prefill."""
    p = make_paged([90], 2, 64, 32, torch.float32, seed=7)
    cu = _cu([90])
    q = randn((90, 4, 64), torch.float32, seed=8)
    assert_close_rel(_run(p, q, cu), _ref(p, q, cu), torch.float32)


def test_dense_prefill_equals_dense_reference():
    """No prefix: paged prefill is plain causal attention over the sequence's own K/V."""
    p = make_paged([37], 2, 64, 16, torch.float32, seed=9)
    q = randn((37, 4, 64), torch.float32, seed=10)
    out = _run(p, q, _cu([37]))
    pos = torch.arange(37)
    rows = p.block_table[0, pos // 16].long()
    k = p.k_cache[rows, pos % 16].permute(1, 0, 2)[None]  # [1, Hkv, S, D]
    v = p.v_cache[rows, pos % 16].permute(1, 0, 2)[None]
    ref = dense_attention_ref(q.permute(1, 0, 2)[None], k, v, causal=True)[0].permute(1, 0, 2)
    assert_close_rel(out, ref, torch.float32)
