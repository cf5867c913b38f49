"""skinny_mm (x @ w.T for few rows) against a float64 matmul: every tile path (one split or
several summed in order, masked or even N and K, one M tile or more), on the CPU interpreter
(fp32 / fp16: its bf16 dots are wrong) and on a GPU (bf16 at a decode step's shapes)."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels.skinny_mm import SkinnyConfig, skinny_mm


def _check(m, n, k, dtype, cfg, device="cpu", tol=None):
    x = torch.randn(m, k, device=device).to(dtype)
    w = torch.randn(n, k, device=device).to(dtype) / k**0.5
    got = skinny_mm(x, w, cfg)
    ref = x.double() @ w.double().T
    assert got.shape == (m, n) and got.dtype == dtype
    scale = ref.abs().max().item() or 1.0
    err = (got.double() - ref).abs().max().item() / scale
    limit = tol or {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert err <= limit, (m, n, k, dtype, cfg, err)


@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        (1, 64, 128, SkinnyConfig(64, 32, 1, 4, 2)),  # even N and K, one split
        (3, 100, 200, SkinnyConfig(32, 32, 1, 4, 2)),  # masked N and K
        (5, 96, 256, SkinnyConfig(32, 32, 3, 4, 2)),  # three splits, the last shorter
        (17, 64, 96, SkinnyConfig(64, 32, 2, 4, 2)),  # two splits of 64 and 32
        (70, 48, 64, SkinnyConfig(16, 32, 2, 4, 2)),  # two M tiles (BLOCK_M 64)
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_mm_equals_a_float64_matmul(m, n, k, cfg, dtype):
    _check(m, n, k, dtype, cfg)


def test_skinny_mm_refuses_what_it_cannot_multiply():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"x \[2, 8\] and w \[4, 6\]"):
        skinny_mm(x, torch.randn(4, 6))
    with pytest.raises(ValueError, match="dtypes"):
        skinny_mm(x, torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit stride"):
        skinny_mm(x, torch.randn(8, 4).T)
    assert skinny_mm(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)
    assert torch.equal(skinny_mm(torch.randn(2, 0), torch.randn(3, 0)), torch.zeros(2, 3))


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 7, 64, 100])
@pytest.mark.parametrize("n,k", [(512, 2048), (5632, 2048), (2048, 5632), (1000, 1000)])
@pytest.mark.parametrize("split", [1, 4])
def test_skinny_mm_on_the_gpu(m, n, k, split):
    _check(m, n, k, torch.bfloat16, SkinnyConfig(64, 128, split, 4, 4), device="cuda")


@pytest.mark.cuda
def test_skinny_mm_in_fp32_on_the_gpu_is_not_tf32():
    _check(16, 1000, 1000, torch.float32, SkinnyConfig(64, 64, 2, 4, 3), device="cuda", tol=1e-5)
