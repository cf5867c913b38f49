"""Scatter new tokens' K/V into the paged cache, quantising to fp8 e4m3 when the cache is fp8.

One program per token moves all its KV heads ([kv_heads, head_dim], contiguous in the cache).
A negative slot skips the token (padding), so a padded batch needs no compaction on the host.

fp8 scale policy (per block and KV head, k_scale/v_scale: [num_blocks, kv_heads] fp32, allocate
them with zeros): a call that writes a block's slot 0 — or writes into a block whose scale is
still <= 0 — sets the block's scale to max(amax of the call's tokens in that block, 1e-6) x 4 /
448; later calls quantise with the stored scale and saturate at +-448 x scale. The x4 headroom
costs no precision (e4m3 is floating point: only values under amax / 7000 lose mantissa bits)
and lets later tokens grow to 4x the first ones before they clip. Three launches, in stream
order: (1) slot-0 writers mark their block (scale = 0); (2) every token of a marked block
(scale <= 0) lowers it with atomic_min(-candidate), so the sign tells "being set" apart from
"set" without any ordering between programs; (3) every token takes |scale| and quantises.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import _checks as C
from .reference import FP8_AMAX_FLOOR, FP8_HEADROOM
from .tiling import next_pow2

_AMAX_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)


@triton.jit
def _e4m3_code(x):
    """fp32 -> e4m3 code (uint8), saturating, round-to-nearest-even: bit-exact with
    torch's .to(torch.float8_e4m3fn) after clamping.

    The rounding is done in fp32 (x + c - c with c = 1.5 x 2^23 x the e4m3 step of x's binade
    rounds to a multiple of the step, ties to even), and the code is then assembled from the
    exact value's exponent and top 3 mantissa bits with integer operations. No fp8 conversion
    instruction is involved: Triton 3.6's interpreter rounds fp32 -> fp8 wrongly (no mantissa
    carry, ties away, -0 lost), and on the H200 the converted codes of one head_dim-64 launch
    held scattered NaN codes (0x7F) in one run of four with identical inputs (2026-11-29)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.int32, bitcast=True)
    exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3: 2^-6 is the smallest normal
    step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    c = step * 12582912.0  # 1.5 * 2**23
    mag = tl.abs((x + c) - c)  # an exact e4m3 value, 0 ... 448
    mb = mag.to(tl.int32, bitcast=True)
    e = ((mb >> 23) & 0xFF) - 127  # may be one binade up from exp after rounding
    normal = ((e + 7) << 3) | ((mb >> 20) & 0x7)  # biased exponent (bias 7), 3 mantissa bits
    sub = (mag * 512.0).to(tl.int32)  # subnormals and 0: multiples of 2^-9
    code = tl.where(e >= -6, normal, sub)
    return tl.where(bits < 0, code | 0x80, code).to(tl.uint8)


@triton.jit
def _token_coords(slot_ptr, t, num_heads, BLOCK_TOKENS: tl.constexpr):
    """(heads token t writes: num_heads, or 0 for a skipped slot; its block; its offset).

    The skip is folded into a head count, so every mask is `offs_h < count`, a block compared
    with a scalar, never a block combined with a scalar bool: Triton 3.9's interpreter splats a
    scalar comparison with its operands' element type (int64 here), and its loads then reject
    the non-bool mask ("mask has unsupported dtype"). Compiled code is the same select."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    heads = tl.where(slot >= 0, num_heads, 0)
    slot = tl.maximum(slot, 0)
    return heads, slot // BLOCK_TOKENS, slot % BLOCK_TOKENS


@triton.jit
def _reset_scales_kernel(
    slot_ptr, ks_ptr, vs_ptr, num_heads, BLOCK_TOKENS: tl.constexpr, H_PAD: tl.constexpr
):
    heads, blk, off = _token_coords(slot_ptr, tl.program_id(0), num_heads, BLOCK_TOKENS)
    offs_h = tl.arange(0, H_PAD)
    m = offs_h < tl.where(off == 0, heads, 0)
    tl.store(ks_ptr + blk * num_heads + offs_h, tl.zeros([H_PAD], tl.float32), mask=m)
    tl.store(vs_ptr + blk * num_heads + offs_h, tl.zeros([H_PAD], tl.float32), mask=m)


@triton.jit
def _amax_one(
    x_ptr,
    sc_ptr,
    t,
    blk,
    heads,
    stride_t,
    stride_h,
    num_heads,
    factor,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    h_mask = offs_h < heads
    m = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(
        x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :], mask=m, other=0.0
    )
    cand = tl.maximum(tl.max(tl.abs(x.to(tl.float32)), 1), _AMAX_FLOOR) * factor  # [H_PAD]
    sc_ptrs = sc_ptr + blk * num_heads + offs_h
    old = tl.load(sc_ptrs, mask=h_mask, other=1.0)
    # only blocks being (re)set: their scale is <= 0 and only ever goes down during this launch
    tl.atomic_min(sc_ptrs, -cand, mask=h_mask & (old <= 0.0))


@triton.jit
def _amax_kernel(
    k_ptr,
    v_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    num_heads,
    factor,
    HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    heads, blk, off = _token_coords(slot_ptr, t, num_heads, BLOCK_TOKENS)
    _amax_one(
        k_ptr,
        ks_ptr,
        t,
        blk,
        heads,
        stride_kt,
        stride_kh,
        num_heads,
        factor,
        HEAD_DIM,
        H_PAD,
        D_PAD,
    )
    _amax_one(
        v_ptr,
        vs_ptr,
        t,
        blk,
        heads,
        stride_vt,
        stride_vh,
        num_heads,
        factor,
        HEAD_DIM,
        H_PAD,
        D_PAD,
    )


@triton.jit
def _store_one(
    x_ptr,
    c_ptr,
    sc_ptr,
    t,
    blk,
    off,
    heads,
    stride_t,
    stride_h,
    stride_cb,
    stride_ct,
    stride_ch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
):
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    h_mask = offs_h < heads
    m = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(
        x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_d[None, :], mask=m, other=0.0
    )
    dst = c_ptr + blk * stride_cb + off * stride_ct + offs_h[:, None] * stride_ch + offs_d[None, :]
    if FP8:
        sc = tl.abs(tl.load(sc_ptr + blk * num_heads + offs_h, mask=h_mask, other=1.0))
        # every token of a freshly set block writes the same positive value: a benign race
        tl.store(sc_ptr + blk * num_heads + offs_h, sc, mask=h_mask)
        code = _e4m3_code(x.to(tl.float32) / sc[:, None])
        tl.store(dst, code, mask=m)  # fp8 caches arrive as uint8 views
    else:
        tl.store(dst, x.to(c_ptr.dtype.element_ty), mask=m)


@triton.jit
def _append_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0)
    heads, blk, off = _token_coords(slot_ptr, t, num_heads, BLOCK_TOKENS)
    _store_one(
        k_ptr,
        kc_ptr,
        ks_ptr,
        t,
        blk,
        off,
        heads,
        stride_kt,
        stride_kh,
        stride_cb,
        stride_ct,
        stride_ch,
        num_heads,
        HEAD_DIM,
        H_PAD,
        D_PAD,
        FP8,
    )
    _store_one(
        v_ptr,
        vc_ptr,
        vs_ptr,
        t,
        blk,
        off,
        heads,
        stride_vt,
        stride_vh,
        stride_cb,
        stride_ct,
        stride_ch,
        num_heads,
        HEAD_DIM,
        H_PAD,
        D_PAD,
        FP8,
    )


def _validate(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    C.check_runnable("k", k)
    C.check_kv_cache(k_cache, v_cache, k.device)
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    for name, x in (("k", k), ("v", v)):
        C.check_device(name, x, k.device)
        C.check_shape(name, x, (None, hkv, d))
        C.check_dtype(name, x, C.FLOAT_DTYPES)
        if x.stride(-1) != 1:
            raise ValueError(f"{name}: last dim (head_dim) must be contiguous")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: {v.shape[0]} tokens, k has {k.shape[0]}")
    if not C.is_fp8(k_cache.dtype) and k.dtype != k_cache.dtype:
        raise ValueError(f"k: dtype {k.dtype} differs from k_cache's {k_cache.dtype}")
    C.check_device("slot_mapping", slot_mapping, k.device)
    C.check_shape("slot_mapping", slot_mapping, (k.shape[0],))
    C.check_dtype("slot_mapping", slot_mapping, C.INDEX_DTYPES)
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping: must be contiguous")
    C.check_scales(k_cache, k_scale, v_scale, k.device)


def kv_append(k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None) -> None:
    """Write k, v ([num_tokens, kv_heads, head_dim]) into k_cache, v_cache ([num_blocks,
    block_tokens, kv_heads, head_dim]) at slot_mapping ([num_tokens], block x block_tokens +
    offset; negative = skip). fp8 caches also update k_scale, v_scale (module docstring)."""
    _validate(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    n = k.shape[0]
    if n == 0:
        return
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    bt = k_cache.shape[1]
    fp8 = C.is_fp8(k_cache.dtype)
    h_pad, d_pad = next_pow2(hkv), next_pow2(d)
    # one token's heads: 8 warps only when the tile is large (32 KiB+ of fp32 in registers)
    warps = 8 if h_pad * d_pad >= 8192 else 4
    if fp8:
        factor = FP8_HEADROOM / C.FP8_MAX
        _reset_scales_kernel[(n,)](
            slot_mapping, k_scale, v_scale, hkv, BLOCK_TOKENS=bt, H_PAD=h_pad
        )
        _amax_kernel[(n,)](
            k,
            v,
            slot_mapping,
            k_scale,
            v_scale,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            hkv,
            factor,
            HEAD_DIM=d,
            BLOCK_TOKENS=bt,
            H_PAD=h_pad,
            D_PAD=d_pad,
            num_warps=warps,
        )
    ks = k_scale if fp8 else k  # unused pointer when not fp8
    vs = v_scale if fp8 else k
    _append_kernel[(n,)](
        k,
        v,
        C.as_codes(k_cache),
        C.as_codes(v_cache),
        slot_mapping,
        ks,
        vs,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        hkv,
        HEAD_DIM=d,
        BLOCK_TOKENS=bt,
        H_PAD=h_pad,
        D_PAD=d_pad,
        FP8=fp8,
        num_warps=warps,
    )
