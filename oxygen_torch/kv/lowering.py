"""fp8 lowering of KV blocks on their way to the CPU tier (pool.tier_fp8_lowering): e4m3 codes
with one fp32 scale per (block, layer, K/V, kv head), computed on the blocks' device before the
copy, so the transfer and the slot are half of a 16-bit block's (plus the scales).

The scale is the head's absolute max over the block's tokens and head_dim / 448 (e4m3's largest
finite value), so the max maps to ±448 and every value is within e4m3's rounding (2^-4 of its
magnitude, half a step of 3 mantissa bits) of the original; an all-zero head gets scale 1 (its
codes are zeros). Dequantization multiplies in fp32 and rounds into the pool's dtype.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
LOWERABLE = (torch.float16, torch.bfloat16)  # fp8 pools are fp8 already; fp32 ones stay exact


def scale_bytes(caches: list[torch.Tensor]) -> int:
    """Bytes of one block's scales: fp32 per region (layer, K/V) and kv head."""
    return 4 * sum(c.shape[2] for c in caches)


def lower(caches: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Blocks `idx` of every cache [num_blocks, T, H, D] as uint8 [n, sum(T*H*D) + scales]:
    each cache's e4m3 codes in turn, then the scales [n, regions, H] fp32, on the caches' device."""
    codes, scales = [], []
    for c in caches:
        x = c.index_select(0, idx).float()  # [n, T, H, D]
        s = x.abs().amax(dim=(1, 3)) / FP8_MAX  # [n, H]
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (x / s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        codes.append(q.view(torch.uint8).view(len(idx), -1))
        scales.append(s)
    sc = torch.stack(scales, dim=1).view(len(idx), -1).view(torch.uint8)  # [n, regions * H * 4]
    return torch.cat(codes + [sc], dim=1)


def raise_(caches: list[torch.Tensor], idx: torch.Tensor, staged: torch.Tensor) -> None:
    """Writes lowered blocks `staged` (uint8 [n, codes + scales], as `lower` made them, on the
    caches' device) into blocks `idx` of every cache, in the cache's dtype."""
    n = staged.shape[0]
    sc = staged[:, -scale_bytes(caches) :].contiguous().view(torch.float32)  # [n, regions * H]
    off = head = 0
    for c in caches:
        _, t, h, d = c.shape
        q = staged[:, off : off + t * h * d].view(FP8).view(n, t, h, d)
        s = sc[:, head : head + h]  # [n, H]
        c.index_copy_(0, idx, (q.float() * s[:, None, :, None]).to(c.dtype))
        off += t * h * d
        head += h
