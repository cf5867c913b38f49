"""The float64 references are the ground truth of every kernel test and the CPU path of the
integration, so they are checked against torch's own attention and against each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from oxygen_torch.triton_kernels import (
    dense_attention_ref,
    kv_append_ref,
    paged_decode_ref,
    paged_prefill_ref,
)
from oxygen_torch.triton_kernels import reference as R
from test_kernels_helpers import make_paged, randn

F64 = torch.float64


def _sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_matches_sdpa_gqa(causal):
    q, k, v = (
        randn((2, 6, 19, 32), F64, 1),
        randn((2, 2, 19, 32), F64, 2),
        randn((2, 2, 19, 32), F64, 3),
    )
    ref = _sdpa(q, k, v, is_causal=causal, scale=0.3)
    torch.testing.assert_close(dense_attention_ref(q, k, v, causal=causal, scale=0.3), ref)


def test_dense_masks_match_sdpa():
    q, k, v = (
        randn((1, 4, 7, 16), F64, 4),
        randn((1, 4, 11, 16), F64, 5),
        randn((1, 4, 11, 16), F64, 6),
    )
    keep = torch.rand(1, 1, 7, 11, generator=torch.Generator().manual_seed(7)) > 0.3
    keep[..., 0] = True  # no fully masked row: SDPA gives NaN there, we give zeros
    torch.testing.assert_close(
        dense_attention_ref(q, k, v, attn_mask=keep), _sdpa(q, k, v, attn_mask=keep)
    )
    bias = randn((1, 4, 7, 11), F64, 8)
    torch.testing.assert_close(
        dense_attention_ref(q, k, v, attn_mask=bias), _sdpa(q, k, v, attn_mask=bias)
    )


def test_dense_sliding_window_and_bottom_right_causal():
    """Window W: query at p sees (p - W, p]; with Sq < Sk queries are the last Sq positions."""
    q, k, v = (
        randn((1, 2, 5, 16), F64, 9),
        randn((1, 2, 12, 16), F64, 10),
        randn((1, 2, 12, 16), F64, 11),
    )
    p = torch.arange(7, 12)[:, None]
    j = torch.arange(12)[None, :]
    keep = (j <= p) & (j > p - 4)
    ref = _sdpa(q, k, v, attn_mask=keep)
    torch.testing.assert_close(dense_attention_ref(q, k, v, causal=True, sliding_window=4), ref)


def test_fully_masked_rows_are_zero_and_chunking_is_invisible(monkeypatch):
    q, k, v = (
        randn((1, 2, 9, 16), F64, 12),
        randn((1, 2, 9, 16), F64, 13),
        randn((1, 2, 9, 16), F64, 14),
    )
    keep = torch.ones(1, 1, 9, 9, dtype=torch.bool)
    keep[..., 3, :] = False
    whole = dense_attention_ref(q, k, v, attn_mask=keep, causal=True)
    assert (whole[:, :, 3] == 0).all() and torch.isfinite(whole).all()
    monkeypatch.setattr(R, "_CHUNK_ELEMS", 20)  # one query row per chunk
    torch.testing.assert_close(dense_attention_ref(q, k, v, attn_mask=keep, causal=True), whole)


def _contiguous(p, b, n):
    """Sequence b's first n tokens as [1, Hkv, n, D] float64."""
    pos = torch.arange(n)
    rows = p.block_table[b, pos // p.k_cache.shape[1]].long()
    k = p.k_cache[rows, pos % p.k_cache.shape[1]].permute(1, 0, 2)[None].double()
    v = p.v_cache[rows, pos % p.v_cache.shape[1]].permute(1, 0, 2)[None].double()
    return k, v


def test_paged_refs_equal_dense_ref_on_gathered_kv():
    lens = [23, 40]
    p = make_paged(lens, 2, 32, 16, torch.float32, seed=15)
    q = randn((45, 6, 32), F64, 16)
    cu = torch.tensor([0, 5, 45], dtype=torch.int32)
    out = paged_prefill_ref(
        q, p.k_cache, p.v_cache, p.block_table, cu, p.seq_lens, sliding_window=7
    )
    dec = paged_decode_ref(
        q[[4, 44]], p.k_cache, p.v_cache, p.block_table, p.seq_lens, sliding_window=7
    )
    for b, n in enumerate(lens):
        k, v = _contiguous(p, b, n)
        qb = q[cu[b] : cu[b + 1]].transpose(0, 1)[None]
        ref = dense_attention_ref(qb, k, v, causal=True, sliding_window=7)[0].transpose(0, 1)
        torch.testing.assert_close(out[cu[b] : cu[b + 1]], ref)
        torch.testing.assert_close(dec[b], ref[-1])  # decode = the last prefill row


def test_zero_length_sequence_gives_zeros_and_dtype_is_kept():
    p = make_paged([0, 17], 2, 32, 16, torch.float16, seed=17)
    q = randn((2, 2, 32), torch.float16, 18)
    out = paged_decode_ref(q, p.k_cache, p.v_cache, p.block_table, p.seq_lens)
    assert out.dtype == torch.float16 and (out[0] == 0).all() and (out[1] != 0).any()


def test_kv_append_ref_copies_unless_inplace():
    kc, vc = randn((3, 16, 1, 32), torch.float32, 19), randn((3, 16, 1, 32), torch.float32, 20)
    k, v = randn((2, 1, 32), torch.float32, 21), randn((2, 1, 32), torch.float32, 22)
    slots = torch.tensor([17, -5])
    before = kc.clone()
    nk, nv, ks, vs = kv_append_ref(k, v, kc, vc, slots)
    assert torch.equal(kc, before) and ks is None and vs is None
    assert torch.equal(nk[1, 1, 0], k[0, 0]) and torch.equal(nv[1, 1, 0], v[0, 0])
    res = kv_append_ref(k, v, kc, vc, slots, inplace=True)
    assert res[0] is kc and torch.equal(kc, nk)


def test_fp8_codes_roundtrip_and_scale_policy():
    x = torch.tensor([[[0.5, -3.0]], [[100.0, 1.0]]])  # two tokens into one block: [T, H=1, D=2]
    codes = torch.zeros(1, 16, 1, 2, dtype=torch.uint8)
    kc, _, ks, _ = kv_append_ref(
        x,
        x,
        codes,
        codes.clone(),
        torch.tensor([0, 1]),
        k_scale=torch.zeros(1, 1),
        v_scale=torch.zeros(1, 1),
    )
    assert ks.item() == pytest.approx(100.0 * R.FP8_HEADROOM / 448, rel=1e-6)  # amax of the call
    deq = R.fp8_codes_to_float(kc[0, :2, 0]) * ks.item()
    torch.testing.assert_close(deq, x[:, 0].double(), rtol=2**-4, atol=0)
