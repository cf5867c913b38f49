"""The dense Triton attention kernel (triton_kernels/dense_attention.py) against the float64
reference: in Triton's CPU interpreter on CI (fp32/fp16, tiny shapes), on the GPU where there is
one. Covers GQA packing across tile edges, SDPA's top-left causality with Sq != Sk, bool and
additive masks with broadcast dims, decode (Sq = 1), a padded head dim and every precision mode."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels import PrecisionMode
from oxygen_torch.triton_kernels.dense_attention import dense_attention
from oxygen_torch.triton_kernels.reference import dense_attention_ref

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _randn(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).to(device)


def _ref(q, k, v, mask, causal, scale):
    """float64 reference with SDPA's top-left causality (the reference aligns bottom-right)."""
    sq, sk = q.shape[2], k.shape[2]
    if causal and sq != sk:
        mask, causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(), False
    return dense_attention_ref(
        q.double(), k.double(), v.double(), causal=causal, scale=scale, attn_mask=mask
    )


CASES = [
    # (b, hq, hkv, sq, sk, d, causal, mask, block_m, block_n)
    pytest.param(2, 4, 2, 5, 5, 32, True, None, 16, 16, id="causal-gqa2"),
    pytest.param(1, 8, 2, 20, 20, 64, True, None, 16, 16, id="causal-rows-span-heads"),
    pytest.param(2, 4, 4, 3, 9, 80, True, None, 16, 32, id="causal-top-left-d80"),
    pytest.param(1, 4, 1, 1, 37, 64, False, "bool", 16, 16, id="decode-mqa-bool"),
    pytest.param(2, 2, 2, 7, 19, 16, False, "add", 32, 16, id="additive-2d"),
    pytest.param(2, 6, 3, 4, 12, 32, False, "add4", 16, 16, id="additive-per-head"),
]


def _mask(kind, b, hq, sq, sk, device):
    if kind == "bool":
        m = _randn((b, 1, sq, sk), torch.float32, device, 5) > -0.3
        m[..., 0] = True
        return m
    if kind == "add":
        return _randn((sq, sk), torch.float32, device, 6)
    if kind == "add4":
        return _randn((b, hq, sq, sk), torch.float32, device, 7)
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,causal,kind,bm,bn", CASES)
def test_dense_kernel_matches_reference(b, hq, hkv, sq, sk, d, causal, kind, bm, bn, dtype, device):
    q = _randn((b, hq, sq, d), dtype, device, 1)
    k = _randn((b, hkv, sk, d), dtype, device, 2)
    v = _randn((b, hkv, sk, d), dtype, device, 3)
    mask = _mask(kind, b, hq, sq, sk, device)
    precision = PrecisionMode.FP32_SAFE if dtype == torch.float32 else PrecisionMode.AUTO_MIXED
    out = dense_attention(
        q,
        k,
        v,
        attn_mask=mask,
        causal=causal,
        scale=0.3,
        precision=precision,
        block_m=bm,
        block_n=bn,
    )
    ref = _ref(q, k, v, mask, causal, 0.3)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("precision", list(PrecisionMode))
def test_dense_kernel_precision_modes(precision, device):
    q = _randn((1, 4, 9, 64), torch.float16, device, 1)
    k = _randn((1, 2, 9, 64), torch.float16, device, 2)
    v = _randn((1, 2, 9, 64), torch.float16, device, 3)
    out = dense_attention(q, k, v, causal=True, precision=precision, block_m=16, block_n=16)
    ref = _ref(q, k, v, None, True, None)
    tol = 2e-2 if precision == PrecisionMode.FP16_ONLY else 2e-3
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


def test_dense_kernel_rejects_bad_inputs(device):
    q = _randn((1, 3, 4, 16), torch.float32, device, 1)
    k = _randn((1, 2, 4, 16), torch.float32, device, 2)
    with pytest.raises(ValueError, match="multiple"):
        dense_attention(q, k, k)
    with pytest.raises(ValueError, match="attn_mask"):
        q4 = _randn((1, 2, 4, 16), torch.float32, device, 1)
        dense_attention(q4, k, k, attn_mask=torch.ones(3, 4, dtype=torch.bool, device=device))
