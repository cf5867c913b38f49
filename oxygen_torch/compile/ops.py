"""oxygen::attention, the op the compile backend's passes put in place of SDPA.

``oxygen::attention(q, k, v, attn_mask, is_causal, scale, precision, block_m, block_n)``: dense
attention on [B, H, S, D] with torch SDPA's semantics (top-left causal, bool or additive mask, GQA
when Hq is a multiple of Hkv). precision / block_m / block_n are ints in the schema so a compiled
graph fixes them at compile time (0 = choose from the shapes).

CUDA: a ``triton_op``: under torch.compile AOTAutograd decomposes it into the Triton kernel
(``wrap_triton``), which Inductor then sees and schedules like its own kernels. CPU:
``oxygen::attention_ref``, the float64 reference as an opaque op (a triton_op's body is traced for
every device, so the CPU branch must be an op of its own).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..triton_kernels import reference as _ref
from ..triton_kernels.dense_attention import dense_attention
from ..triton_kernels.precision import PrecisionMode


@torch.library.custom_op("oxygen::attention_ref", mutates_args=())
def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """float64 reference with SDPA semantics; the CPU path of oxygen::attention."""
    sq, sk = q.shape[2], k.shape[2]
    causal = is_causal
    if is_causal and sq != sk:
        # the reference aligns causality bottom-right; SDPA's is_causal is top-left
        attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        causal = False
    out = _ref.dense_attention_ref(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask)
    return torch.empty_like(q).copy_(out)  # q's layout, as the fake kernel promises


@attention_ref.register_fake
def _attention_ref_fake(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return torch.empty_like(q)


@torch.library.triton_op("oxygen::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    precision: int = int(PrecisionMode.AUTO_MIXED),
    block_m: int = 0,
    block_n: int = 0,
) -> Tensor:
    """q: [B, Hq, Sq, D], k/v: [B, Hkv, Sk, D] -> [B, Hq, Sq, D] (SDPA semantics, no dropout)."""
    if q.device.type != "cuda":
        return torch.ops.oxygen.attention_ref(q, k, v, attn_mask, is_causal, scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return dense_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        causal=is_causal,
        scale=scale,
        precision=precision,
        block_m=block_m or None,
        block_n=block_n or None,
        use_wrap_triton=True,
    )


__all__ = ["attention", "attention_ref"]
