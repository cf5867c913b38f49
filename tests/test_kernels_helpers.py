"""Builders shared by the kernel tests (imported by the other test_kernels_* files), and tests
of the builders themselves: a test input that is not what it claims makes every test moot."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Relative tolerance (of max |ref|) per q dtype against the float64 reference. fp32 in the
# interpreter is exact fp32 arithmetic; half adds the P cast and output rounding (~5e-4).
TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}
POISON_TABLE = 1 << 28  # a block id far outside any cache: reading it would fault or crash


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks, block_tokens, kv_heads, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [batch, max_blocks] int32, shuffled physical blocks
    seq_lens: torch.Tensor  # [batch] int32
    k_scale: torch.Tensor | None = None  # [num_blocks, kv_heads] fp32 (fp8 only)
    v_scale: torch.Tensor | None = None


def random_fp8_codes(shape, gen, device) -> torch.Tensor:
    """uint8 e4m3 codes of finite values (0x7f / 0xff are NaN), magnitudes up to 448."""
    codes = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    return codes.to(device)


def make_paged(lens, kv_heads, head_dim, block_tokens, dtype, device="cpu", seed=0, spare=3):
    """A cache holding random K/V for sequences of `lens` tokens in shuffled physical blocks.

    Every cache element is random (never zero), spare blocks included; table entries past a
    sequence's last block hold POISON_TABLE so a kernel reading them fails loudly."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_tokens) for n in lens]
    num_blocks = sum(need) + spare
    max_blocks = max(max(need), 1) + 1
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), max_blocks), POISON_TABLE, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_tokens, kv_heads, head_dim)
    if dtype == torch.uint8:
        k = random_fp8_codes(shape, gen, device)
        v = random_fp8_codes(shape, gen, device)
        # scales near 1/448: dequantised values of order 1, like real activations
        ks = (torch.rand(num_blocks, kv_heads, generator=gen) + 0.5) / 448
        vs = (torch.rand(num_blocks, kv_heads, generator=gen) + 0.5) / 448
        return Paged(k, v, table.to(device), _lens(lens, device), ks.to(device), vs.to(device))
    k = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return Paged(k, v, table.to(device), _lens(lens, device))


def _lens(lens, device):
    return torch.tensor(lens, dtype=torch.int32, device=device)


def randn(shape, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def poisoned_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def assert_close_rel(out, ref, dtype, factor=1.0):
    """Every element finite and within TOL[dtype] x factor x max|ref| of the float64 reference."""
    assert torch.isfinite(out).all(), "non-finite values in the kernel output"
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    scale = ref64.abs().max().clamp_min(1e-6)
    err = ((out64 - ref64).abs() / scale).max().item()
    assert err <= TOL[dtype] * factor, f"max relative error {err:.3g} > {TOL[dtype] * factor:.3g}"
    return err


def test_make_paged_tables_are_shuffled_disjoint_and_poisoned():
    p = make_paged([37, 70, 1], 2, 64, 16, torch.float16)
    blocks = [p.block_table[b, : -(-n // 16)].tolist() for b, n in enumerate([37, 70, 1])]
    flat = [x for row in blocks for x in row]
    assert len(flat) == len(set(flat)), "sequences must not share blocks"
    assert flat != sorted(flat), "block table should be shuffled"
    assert (p.block_table[0, 3:] == POISON_TABLE).all()
    assert (p.k_cache != 0).float().mean() > 0.99


def test_random_fp8_codes_are_finite():
    codes = random_fp8_codes((4096,), torch.Generator().manual_seed(1), "cpu")
    assert torch.isfinite(codes.view(torch.float8_e4m3fn).float()).all()
