"""Triton building blocks shared by paged decode and paged prefill.

One key tile is BLOCK_N consecutive token positions of one sequence; each position is gathered
through the block table (block = table[pos // BLOCK_TOKENS], row = pos % BLOCK_TOKENS), so any
power-of-two block_tokens works with any BLOCK_N, and a shuffled table costs nothing extra. A
token's head row is head_dim contiguous elements, so loads along D are 16-byte vectors.

Scores live in the log2 domain (qk_scale = softmax scale x log2 e) so the softmax uses exp2.
fp8 KV: codes are converted exactly to fp16 (every e4m3 value is an fp16 value) and the
per-block-per-head scales are folded into the scores (K) and the probabilities (V), which costs
one multiply per score instead of one per K/V element. Outside FP32_SAFE both dots run in fp16
whatever the query dtype: e4m3 -> fp16 is one packed conversion per two elements, while
e4m3 -> bf16 goes through fp16 and fp32 (about four times the conversions; on the H200 that made
fp8 decode slower than bf16). The query is scaled by a power of two into fp16's range
(`half_query`) and the probabilities by the tile's largest V scale, so neither overflows nor
loses more than bf16 would.
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
def fp16_dots(FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr):
    """True where the fp8 path does its dots in fp16 (every mode but FP32_SAFE and FP16_ONLY)."""
    return FP8 and PRECISION != FP32_SAFE and not HALF_ACC


@triton.jit
def half_query(q, qk_scale, FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr):
    """For the fp16 dots of the fp8 path: q scaled by 2^e into fp16 (its largest element lands in
    [2^13, 2^14)) and qk_scale divided by 2^e. Exact for bf16 queries: fp16 keeps 10 mantissa
    bits where bf16 has 7, and the power of two only moves the exponent. Other paths: unchanged."""
    if fp16_dots(FP8, PRECISION, HALF_ACC):
        qf = q.to(tl.float32)
        qmax = tl.max(tl.max(tl.abs(qf), 1), 0)
        e = tl.where(qmax > 0.0, 13.0 - tl.floor(tl.log2(tl.maximum(qmax, 1e-30))), 0.0)
        e = tl.minimum(tl.maximum(e, -100.0), 100.0)
        return (qf * tl.exp2(e)).to(tl.float16), qk_scale * tl.exp2(-e)
    return q, qk_scale


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
    elif fp16_dots(FP8, PRECISION, HALF_ACC):  # q is already fp16 (half_query)
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
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
    if fp16_dots(FP8, PRECISION, HALF_ACC):
        # p <= 1; scaled by v_sc / (the tile's largest v_sc) it stays in [0, 1] in fp16
        v_top = tl.max(v_sc, 0)
        v_top = tl.where(v_top > 0.0, v_top, 1.0)
        p16 = (p * (v_sc / v_top)[None, :]).to(tl.float16)
        pv = tl.dot(p16, v.to(tl.float16)) * v_top
        return acc * alpha[:, None] + pv, l_i, m_new
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
