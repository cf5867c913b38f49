"""oxygen::attention on CPU: torch.library.opcheck (schema, fake kernels, AOT dispatch with
dynamic shapes) and values against torch SDPA in float64; the one paged dispatch
(oxygen_torch.kv.attention: append, then decode and prefill) against dense attention over the
same keys; tiles_for's precedence (kernel config > model profile > automatic)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import oxygen_torch.compile  # noqa: F401  (registers torch.ops.oxygen)
from oxygen_torch.config import KernelConfig
from oxygen_torch.config.profiles import ModelProfile, get_profile
from oxygen_torch.kv.attention import Tiles, kv_write, paged_attention, tiles_for

ops = torch.ops.oxygen


def _randn(*shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _sdpa64(q, k, v, mask=None, causal=False, scale=None):
    """torch SDPA in float64 with K/V heads repeated (the semantics oxygen::attention keeps)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.double()
    out = F.scaled_dot_product_attention(
        q.double(), k, v, attn_mask=mask, is_causal=causal, scale=scale
    )
    return out.to(q.dtype)


CASES = [
    # (b, hq, hkv, sq, sk, d, causal, mask kind, scale)
    pytest.param(2, 4, 4, 6, 6, 16, True, None, None, id="causal"),
    pytest.param(2, 4, 2, 5, 9, 16, True, None, None, id="causal-gqa-sq<sk-top-left"),
    pytest.param(1, 6, 2, 7, 7, 32, False, "bool", 0.3, id="bool-gqa3-scale"),
    pytest.param(2, 2, 1, 4, 11, 16, False, "add", None, id="additive-mqa"),
    pytest.param(3, 8, 2, 1, 13, 64, False, "bool", None, id="decode-gqa4"),
]


def _mask(kind, b, sq, sk, seed):
    if kind == "bool":
        m = _randn(b, 1, sq, sk, seed=seed) > -0.5
        m[..., 0] = True  # every query sees a key (SDPA gives NaN for empty rows, we give 0)
        return m
    if kind == "add":
        return _randn(sq, sk, seed=seed)
    return None


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kind,scale", CASES)
def test_attention_matches_sdpa(b, hq, hkv, sq, sk, d, causal, kind, scale):
    q, k, v = (
        _randn(b, h, s, d, seed=i) for i, (h, s) in enumerate([(hq, sq), (hkv, sk), (hkv, sk)])
    )
    mask = _mask(kind, b, sq, sk, seed=7)
    out = ops.attention(q, k, v, mask, causal, scale)
    ref = _sdpa64(q, k, v, mask, causal, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kind,scale", CASES[:4])
def test_attention_opcheck(b, hq, hkv, sq, sk, d, causal, kind, scale):
    q, k, v = (
        _randn(b, hq, sq, d, seed=1),
        _randn(b, hkv, sk, d, seed=2),
        _randn(b, hkv, sk, d, seed=3),
    )
    args = (q, k, v, _mask(kind, b, sq, sk, seed=4), causal, scale, 2, 16, 32)
    torch.library.opcheck(ops.attention.default, args)


def _paged(lens, hkv, d, bt=16, seed=0):
    """Caches filled through kv_write with shuffled blocks; returns the dense K/V too."""
    nblocks = sum(-(-n // bt) for n in lens) + 2
    k_cache = torch.zeros(nblocks, bt, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-n // bt) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    dense = []
    for b, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(-(-n // bt))]
        table[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots = torch.tensor(blocks, dtype=torch.int64)[pos // bt] * bt + pos % bt
        k, v = _randn(n, hkv, d, seed=seed + 2 * b), _randn(n, hkv, d, seed=seed + 2 * b + 1)
        kv_write(k, v, k_cache, v_cache, slots)
        dense.append((k, v))
    return k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32), dense


def test_kv_append_writes_in_place_and_skips_negative_slots():
    k_cache = torch.zeros(4, 16, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    k, v = _randn(3, 2, 16, seed=1), _randn(3, 2, 16, seed=2)
    kv_write(k, v, k_cache, v_cache, torch.tensor([17, -1, 63]))
    torch.testing.assert_close(k_cache[1, 1], k[0])
    torch.testing.assert_close(v_cache[3, 15], v[2])
    assert k_cache.count_nonzero() == 2 * 2 * 16  # the skipped token wrote nothing


def test_paged_decode_and_prefill_match_dense():
    lens, hq, hkv, d = [37, 5, 20], 4, 2, 16
    k_cache, v_cache, table, seq_lens, dense = _paged(lens, hkv, d)
    q = _randn(len(lens), hq, d, seed=9)
    out = paged_attention(q, k_cache, v_cache, table, seq_lens)
    for b, (k, v) in enumerate(dense):
        # decode: the query is the last token, it sees every cached key
        ref = _sdpa64(q[b][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        torch.testing.assert_close(out[b], ref[0, :, 0], atol=1e-5, rtol=1e-5)
    new = [3, 1, 4]  # prefill: the last `new` tokens of each sequence, causal over the rest
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    qp = _randn(sum(new), hq, d, seed=10)
    outp = paged_attention(qp, k_cache, v_cache, table, seq_lens, cu)
    for b, (k, v) in enumerate(dense):
        n, m = lens[b], new[b]
        mask = torch.ones(m, n, dtype=torch.bool).tril(n - m)  # bottom-right aligned
        qb = qp[cu[b] : cu[b + 1]].transpose(0, 1)[None]
        ref = _sdpa64(qb, k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask)
        torch.testing.assert_close(
            outp[cu[b] : cu[b + 1]], ref[0].transpose(0, 1), atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    "kernel,profile,expected",
    [
        (dict(), None, Tiles()),
        (dict(), dict(block_m=64, block_n=64), Tiles(64, 64)),
        (dict(block_n=32), dict(block_m=64, block_n=64), Tiles(64, 32)),  # per side
        (dict(block_m=128, block_n=16), dict(block_m=64, block_n=64), Tiles(128, 16)),
        (dict(attention_type="moe"), dict(), Tiles(attention_type="moe")),  # empty profile
        (dict(decode_balance=True), dict(block_n=32), Tiles(None, 32, balance=True)),
    ],
)
def test_tiles_for_explicit_over_profile_over_automatic(kernel, profile, expected):
    prof = None if profile is None else ModelProfile("llama", **profile)
    assert tiles_for(KernelConfig(**kernel), prof) == expected


def test_tiles_for_takes_a_rounded_profile_block_size():
    # block_size [96, 96]: Triton sides are powers of two, 96 rounds (ties down) to 64
    given = {"llama": {"block_size": [96, 96]}}
    assert tiles_for(KernelConfig(), get_profile("llama", given)) == Tiles(64, 64)
    assert tiles_for(KernelConfig(), get_profile("llama")) == Tiles()  # built-in: adaptive
    assert tiles_for(KernelConfig(), get_profile("gpt2")) == Tiles()


def test_paged_attention_checks_tiles_and_keeps_cpu_values():
    lens, hq, hkv, d = [21, 9], 4, 2, 16
    k_cache, v_cache, table, seq_lens, _ = _paged(lens, hkv, d, seed=3)
    q = _randn(len(lens), hq, d, seed=4)
    plain = paged_attention(q, k_cache, v_cache, table, seq_lens)
    tiled = paged_attention(q, k_cache, v_cache, table, seq_lens, tiles=Tiles(block_n=16))
    torch.testing.assert_close(tiled, plain, atol=0, rtol=0)  # CPU: the same SDPA
    with pytest.raises(ValueError, match="tiles: expected a Tiles"):
        paged_attention(q, k_cache, v_cache, table, seq_lens, tiles=(16, 16))
