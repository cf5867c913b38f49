"""kv_append against kv_append_ref in Triton's CPU interpreter: plain scatter (fp16/fp32) and
fp8 e4m3 quantisation (uint8 codes) with the per-block-per-head scale policy."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from oxygen_torch.triton_kernels import kv_append, kv_append_ref, paged_decode, paged_decode_ref
from oxygen_torch.triton_kernels.kv_append import _e4m3_code
from oxygen_torch.triton_kernels.reference import FP8_HEADROOM, fp8_codes_to_float
from test_kernels_helpers import randn


def _slots(positions, table, bt):
    """Absolute token positions of each sequence -> slot ids through the block table."""
    out = []
    for b, pos in enumerate(positions):
        for p in pos:
            out.append(int(table[b, p // bt]) * bt + p % bt)
    return torch.tensor(out, dtype=torch.int64)


def _table(batch, max_blocks, num_blocks, seed):
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    return perm[: batch * max_blocks].view(batch, max_blocks).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hkv,d,bt", [(2, 64, 16), (3, 80, 32)])
def test_append_scatters_and_skips_negative_slots(hkv, d, bt, dtype):
    nb = 9
    k_cache = randn((nb, bt, hkv, d), dtype, seed=1)
    v_cache = randn((nb, bt, hkv, d), dtype, seed=2)
    table = _table(2, 3, nb, seed=3)
    slots = _slots([range(5, 40), range(0, 17)], table, bt)
    slots[[3, 20]] = -1  # padding tokens
    n = slots.shape[0]
    k = randn((n, hkv, d), dtype, seed=4)
    v = randn((n, hkv, d), dtype, seed=5)
    ref_k, ref_v, _, _ = kv_append_ref(k, v, k_cache, v_cache, slots)
    kv_append(k, v, k_cache, v_cache, slots.to(torch.int32))
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0)
    written = (ref_k != randn((nb, bt, hkv, d), dtype, seed=1)).any(-1).any(-1).sum()
    assert written == n - 2, "exactly the non-padding tokens are written"


def test_append_accepts_strided_views():
    """k/v as slices of a fused projection output: [T, H, D] with a large token stride."""
    qkv = randn((12, 8, 64), torch.float32, seed=6)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    k_cache = randn((4, 16, 2, 64), torch.float32, seed=7)
    v_cache = randn((4, 16, 2, 64), torch.float32, seed=8)
    slots = torch.arange(12, dtype=torch.int32) + 20
    ref_k, ref_v, _, _ = kv_append_ref(k, v, k_cache, v_cache, slots)
    kv_append(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _fp8_state(nb, bt, hkv, d):
    k_cache = torch.randint(0, 120, (nb, bt, hkv, d), dtype=torch.uint8)
    v_cache = torch.randint(0, 120, (nb, bt, hkv, d), dtype=torch.uint8)
    return k_cache, v_cache, torch.zeros(nb, hkv), torch.zeros(nb, hkv)


def test_append_fp8_matches_reference_over_prefill_then_decode():
    """A ragged prefill sets the scales of the blocks it starts; one-token decode steps reuse
    them (and start new blocks); codes and scales equal the reference's bit for bit."""
    nb, bt, hkv, d = 8, 16, 2, 64
    kc, vc, ks, vs = _fp8_state(nb, bt, hkv, d)
    rk, rv, rks, rvs = kc.clone(), vc.clone(), ks.clone(), vs.clone()
    table = _table(2, 3, nb, seed=9)
    lens = [13, 30]
    steps = [[range(0, 13), range(0, 30)]] + [[[13 + i], [30 + i]] for i in range(4)]
    for i, positions in enumerate(steps):
        slots = _slots(positions, table, bt)
        k = randn((slots.shape[0], hkv, d), torch.float16, seed=10 + i) * (1 + i)
        v = randn((slots.shape[0], hkv, d), torch.float16, seed=20 + i)
        kv_append(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
        kv_append_ref(k, v, rk, rv, slots, k_scale=rks, v_scale=rvs, inplace=True)
        assert torch.equal(ks, rks) and torch.equal(vs, rvs), f"scales differ at step {i}"
        assert torch.equal(kc, rk) and torch.equal(vc, rv), f"codes differ at step {i}"
    assert (ks[table[:, :2].flatten().long()] > 0).all()
    lens_t = torch.tensor([n + 4 for n in lens], dtype=torch.int32)
    q = randn((2, 4, d), torch.float16, seed=30)
    out = paged_decode(q, kc, vc, table, lens_t, k_scale=ks, v_scale=vs)
    ref = paged_decode_ref(q.double(), kc, vc, table, lens_t, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)


def test_append_fp8_quantisation_error_and_saturation():
    """Round trip within e4m3's half step (2^-4 relative) of values above the subnormals;
    a later token larger than headroom x the block's first saturates at 448 x scale."""
    nb, bt, hkv, d = 2, 16, 1, 64
    kc, vc, ks, vs = _fp8_state(nb, bt, hkv, d)
    k = randn((2, hkv, d), torch.float32, seed=40)
    k[1] = k[0] * (FP8_HEADROOM * 3)  # slot 1: far beyond the headroom
    v = randn((2, hkv, d), torch.float32, seed=41)
    kv_append(k[:1], v[:1], kc, vc, torch.tensor([0]), k_scale=ks, v_scale=vs)
    kv_append(k[1:], v[1:], kc, vc, torch.tensor([1]), k_scale=ks, v_scale=vs)
    deq = fp8_codes_to_float(kc[0, :2, 0]) * ks[0, 0].double()  # [2, D]
    big = k[0, 0].abs() > k[0, 0].abs().max() / 64
    rel = ((deq[0] - k[0, 0].double()).abs() / k[0, 0].double().abs())[big]
    assert rel.max() <= 2**-4 + 1e-6
    assert deq[1].abs().max() == pytest.approx(448 * ks[0, 0].item())
    expect = ks[0, 0] * 448 / FP8_HEADROOM  # the scale came from token 0's amax
    assert expect.item() == pytest.approx(k[0, 0].abs().max().item(), rel=1e-6)


@triton.jit
def _codes_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, _e4m3_code(x), mask=offs < n)


def test_e4m3_code_is_bit_exact_with_torch():
    """Every finite e4m3 value, every midpoint between neighbours (ties to even), values past the
    saturation point, subnormals and signed zeros: the kernel's integer encoding equals torch's
    float8_e4m3fn conversion of the clamped value, code for code."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    rand = randn((4096,), torch.float32, seed=50) * torch.logspace(-4, 3, 4096)
    x = torch.cat([grid, mids, -mids, rand, torch.tensor([-0.0, 0.0, 500.0, -1e9, 2.0**-10])])
    out = torch.empty(x.shape, dtype=torch.uint8)
    _codes_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    ref = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != ref).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} codes differ, e.g. x={x[bad[:3]].tolist()}"
