"""Dense attention on [batch, heads, seq, head_dim] (the layout of torch SDPA): causal or masked,
GQA, any scale. The kernel behind `oxygen::attention` on CUDA.

Grid: (row tiles, batch x kv_heads). A program's rows pack every query head of one KV head
(row r = g x Sq + i: head kvh x group + g, query i), so K/V are read once per KV head, not
once per query head (GQA packing), and a decode step (Sq = 1) fills a tile with the group
instead of padding one query to BLOCK_M rows.

Causality follows torch SDPA's `is_causal` (top-left): query i sees keys j <= i + causal_offset,
with causal_offset = 0 for SDPA (Sk - Sq would be the bottom-right alignment of prefill over a
cached prefix). attn_mask: bool (True = attend) or additive float, broadcastable to
[B, Hq, Sq, Sk]; broadcast dims get stride 0, nothing is expanded in memory. A row that sees no
key gives zeros (SDPA gives NaN there).

The launcher is written to be traced: no host synchronisation, shapes only, so a torch.library
`triton_op` can run it under fake tensors with `use_wrap_triton=True` and Inductor sees the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from ._flash import scores, softmax_step
from .paged_decode import LOG2E, _half_acc
from .precision import PrecisionMode
from .tiling import next_pow2

MASK_NONE = 0
MASK_BOOL = 1
MASK_ADD = 2


@triton.jit
def _dense_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    out_ptr,
    qk_scale,
    sq,
    sk,
    num_kv_heads,
    group,
    causal_offset,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_mb,
    stride_mh,
    stride_mm,
    stride_mn,
    stride_ob,
    stride_oh,
    stride_om,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASK_KIND: tl.constexpr,
    PRECISION: tl.constexpr,
    HALF_ACC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1) // num_kv_heads
    kvh = tl.program_id(1) % num_kv_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (head in group, query) rows
    n_rows = group * sq
    row_ok = rows < n_rows
    g = rows // sq
    i = rows % sq
    head = kvh * group + g
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = q_ptr + b * stride_qb + head[:, None] * stride_qh + i[:, None] * stride_qm
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0)

    hi = sk
    if CAUSAL:
        # the largest query index in this tile bounds the keys any row can see
        r0 = pid_m * BLOCK_M
        r1 = tl.minimum(r0 + BLOCK_M, n_rows) - 1
        max_i = tl.where(r0 // sq != r1 // sq, sq - 1, r1 % sq)
        hi = tl.maximum(tl.minimum(sk, max_i + causal_offset + 1), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    m_base = mask_ptr + b * stride_mb + head[:, None] * stride_mh + i[:, None] * stride_mm
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        k_ok = pos < sk
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + pos[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0)
        v = tl.load(v_base + pos[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0)
        s = scores(q, k, 1.0, qk_scale, False, PRECISION, HALF_ACC)  # [M, N], log2 domain
        ok = k_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            ok = ok & (pos[None, :] <= i[:, None] + causal_offset)
        if MASK_KIND == 1:
            mv = tl.load(m_base + pos[None, :] * stride_mn, mask=ok, other=0)
            ok = ok & (mv != 0)
        if MASK_KIND == 2:
            mv = tl.load(m_base + pos[None, :] * stride_mn, mask=ok, other=0.0)
            s = s + mv.to(tl.float32) * 1.4426950408889634  # the mask joins the log2 domain
        s = tl.where(ok, s, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, 1.0, q, False, PRECISION, HALF_ACC)

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows with no visible key -> zeros
    o_ptrs = out_ptr + b * stride_ob + head[:, None] * stride_oh + i[:, None] * stride_om
    tl.store(
        o_ptrs + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def check_dense(q, k, v, attn_mask) -> None:
    """q: [B, Hq, Sq, D], k/v: [B, Hkv, Sk, D], Hq a multiple of Hkv; shapes only."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected [batch, heads, seq, head_dim], got {list(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} differs from q's {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: on {t.device}, q on {q.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim (head_dim) must be contiguous")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k/v: shapes {list(k.shape)}/{list(v.shape)} do not fit q {list(q.shape)} "
            "(same batch and head_dim, k and v alike)"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q: {q.shape[1]} heads is not a multiple of k's {k.shape[1]} (GQA)")
    if attn_mask is not None:
        if attn_mask.dim() > 4 or attn_mask.device != q.device:
            raise ValueError(f"attn_mask: shape {list(attn_mask.shape)} on {attn_mask.device}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"attn_mask: dtype {attn_mask.dtype}; allowed: bool or float")


def _mask_strides(attn_mask, shape) -> tuple:
    """Strides of the mask broadcast to shape [B, Hq, Sq, Sk]: 0 where the mask has size 1."""
    if attn_mask is None:
        return (0, 0, 0, 0)
    pad = 4 - attn_mask.dim()
    sizes = (1,) * pad + tuple(attn_mask.shape)
    strides = (0,) * pad + tuple(attn_mask.stride())
    out = []
    for size, stride, want in zip(sizes, strides, shape):
        if size != 1 and size != want:
            raise ValueError(
                f"attn_mask: shape {list(attn_mask.shape)} does not broadcast to {list(shape)}"
            )
        out.append(0 if size == 1 else stride)
    return tuple(out)


def default_blocks(group: int, sq, sk, head_dim: int, dtype: torch.dtype) -> tuple[int, int]:
    """Tiles when the caller fixes none. Shapes may be symbolic: no guard is taken on them."""
    rows = group * sq if isinstance(sq, int) else 2048
    keys = sk if isinstance(sk, int) else 2048
    block_m = 64 if rows > 16 else 16
    block_n = 64 if keys >= 64 else max(16, next_pow2(keys))
    if next_pow2(head_dim) >= 256 or dtype == torch.float32:
        block_n = min(block_n, 32)  # K and V tiles of 256-wide rows (or fp32) fill shared memory
    return block_m, block_n


def dense_attention(
    q,
    k,
    v,
    *,
    attn_mask=None,
    causal=False,
    scale=None,
    precision=PrecisionMode.AUTO_MIXED,
    block_m=None,
    block_n=None,
    causal_offset=0,
    out=None,
    use_wrap_triton=False,
):
    """q: [B, Hq, Sq, D], k/v: [B, Hkv, Sk, D] -> [B, Hq, Sq, D] in q's dtype.

    See the module docstring for causal alignment and masks. block_m / block_n: powers of two
    >= 16 (None: `default_blocks`). use_wrap_triton: launch through torch.library.wrap_triton
    (inside a triton_op, so Inductor sees the kernel)."""
    precision = PrecisionMode.parse(precision)
    check_dense(q, k, v, attn_mask)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    if block_m is None or block_n is None:
        auto_m, auto_n = default_blocks(group, sq, sk, d, q.dtype)
        block_m, block_n = block_m or auto_m, block_n or auto_n
    if out is None:
        out = torch.empty_like(q)
    ms = _mask_strides(attn_mask, (b, hq, sq, sk))
    kind = (
        MASK_NONE
        if attn_mask is None
        else (MASK_BOOL if attn_mask.dtype == torch.bool else MASK_ADD)
    )
    scale = d**-0.5 if scale is None else float(scale)
    big = block_m * block_n >= 128 * 64
    grid = (triton.cdiv(group * sq, block_m), b * hkv)
    kernel = wrap_triton(_dense_kernel) if use_wrap_triton else _dense_kernel
    kernel[grid](
        q,
        k,
        v,
        q if attn_mask is None else attn_mask,
        out,
        scale * LOG2E,
        sq,
        sk,
        hkv,
        group,
        causal_offset,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        ms[0],
        ms[1],
        ms[2],
        ms[3],
        out.stride(0),
        out.stride(1),
        out.stride(2),
        HEAD_DIM=d,
        D_PAD=max(16, next_pow2(d)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        CAUSAL=bool(causal),
        MASK_KIND=kind,
        PRECISION=int(precision),
        HALF_ACC=_half_acc(precision, q.dtype),
        num_warps=8 if big else 4,
        num_stages=2 if d > 128 or q.dtype == torch.float32 else 3,
    )
    return out
