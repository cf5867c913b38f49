"""Triton building blocks shared by paged decode and paged prefill.

One key tile is BLOCK_N consecutive token positions of one sequence; each position is gathered
through the block table (block = table[pos // BLOCK_TOKENS], row = pos % BLOCK_TOKENS), so any
power-of-two block_tokens works with any BLOCK_N, and a shuffled table costs nothing extra. A
token's head row is head_dim contiguous elements, so loads along D are 16-byte vectors.

Scores live in the log2 domain (qk_scale = softmax scale x log2 e) so the softmax uses exp2.
fp8 KV: codes are converted exactly to half (every e4m3 value is a half value) and the
per-block-per-head scales are folded into the scores (K) and the probabilities (V), which costs
one multiply per score instead of one per K/V element.
"""

import triton
import triton.language as tl

# PrecisionMode values, as constexprs for the kernels.
FP16_ONLY = tl.constexpr(0)
AUTO_MIXED = tl.constexpr(1)
FP32_SAFE = tl.constexpr(2)


@triton.jit
def kv_rows(
    bt_row_ptr, pos, mask, kvh, stride_kb, stride_kt, stride_kh, BLOCK_TOKENS: tl.constexpr
):
    """Element offsets of the (token, kv head) rows at `pos` ([BLOCK_N]) and their block ids."""
    blk = tl.load(bt_row_ptr + pos // BLOCK_TOKENS, mask=mask, other=0)
    # int64: num_blocks x block_tokens x heads x dim passes 2**31 on large caches
    rows = blk.to(tl.int64) * stride_kb + (pos % BLOCK_TOKENS) * stride_kt + kvh * stride_kh
    return rows, blk


@triton.jit
def load_kv(
    ptr, rows, offs_d, mask, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr
):
    """[BLOCK_N, D_PAD] tile. fp8 caches arrive as uint8 views (the host reinterprets
    float8_e4m3fn storage), so one code path serves the GPU and the CPU interpreter."""
    if HEAD_DIM == D_PAD:
        m = mask[:, None]  # a row mask is constant along D: the loads stay 16-byte vectors
    else:
        m = mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=m, other=0)
    if FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x


@triton.jit
def to_dot_dtype(x, dtype, FP8: tl.constexpr):
    if FP8:
        # e4m3 -> fp16 is exact and the cheapest conversion; fp16 -> bf16 is exact for these values
        return x.to(tl.float16).to(dtype)
    return x.to(dtype)


@triton.jit
def scores(
    q, k, k_sc, qk_scale, FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr
):
    """q: [M, D_PAD], k: [N, D_PAD] -> fp32 [M, N] logits in the log2 domain."""
    if PRECISION == FP32_SAFE:
        kf = to_dot_dtype(k, tl.float32, FP8)
        s = tl.dot(q.to(tl.float32), tl.trans(kf), input_precision="ieee")
    elif HALF_ACC:
        s = tl.dot(q, tl.trans(to_dot_dtype(k, q.dtype, FP8)), out_dtype=tl.float16)
        s = s.to(tl.float32)
    else:
        s = tl.dot(q, tl.trans(to_dot_dtype(k, q.dtype, FP8)))
    if FP8:
        s = s * k_sc[None, :]
    return (s * qk_scale).to(tl.float32)  # Inductor may pass the scale as fp64


@triton.jit
def softmax_step(
    acc, l_i, m_i, s, v, v_sc, q, FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr
):
    """One online-softmax step over a key tile. s: [M, N] fp32 with -inf where masked; q is
    passed for its dtype (the dtype of the P.V dot in the half modes)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with every key masked so far keeps m = -inf; exponentiate against 0 instead so it
    # gives p = 0, alpha = 0 rather than NaN (seq_len 0, window edges, padded rows)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP8:
        p = p * v_sc[None, :]
    if PRECISION == FP32_SAFE:
        pv = tl.dot(p, to_dot_dtype(v, tl.float32, FP8), input_precision="ieee")
    elif HALF_ACC:
        pv = tl.dot(p.to(tl.float16), to_dot_dtype(v, tl.float16, FP8), out_dtype=tl.float16)
        pv = pv.to(tl.float32)
    else:
        pv = tl.dot(p.to(q.dtype), to_dot_dtype(v, q.dtype, FP8))
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new
