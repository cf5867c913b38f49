"""Triton building blocks shared by paged decode and paged prefill.

One key tile is BLOCK_N consecutive token positions of one sequence; each position is gathered
through the block table (block = table[pos // BLOCK_TOKENS], row = pos % BLOCK_TOKENS), so any
power-of-two block_tokens works with any BLOCK_N, and a shuffled table costs nothing extra. A
token's head row is head_dim contiguous elements, so loads along D are 16-byte vectors.

Scores live in the log2 domain (qk_scale = softmax scale x log2 e) so the softmax uses exp2.
fp8 KV: the codes are loaded as int32 words and decoded with integer operations to halves of
the codes' values times 2^-8 (exact: every e4m3 value is a half value), two to a register; the
dots run in fp16 against them (the query scaled into fp16 once), and the per-block-per-head
scales, times 2^8, are folded into the scores (K) and the probabilities (V), which costs one
multiply per score instead of one per K/V element.
"""

import os

import triton
import triton.language as tl

# PrecisionMode values, as constexprs for the kernels.
FP16_ONLY = tl.constexpr(0)
AUTO_MIXED = tl.constexpr(1)
FP32_SAFE = tl.constexpr(2)
# the FP8 constexpr of the kernels: the KV storage
NO_FP8 = tl.constexpr(0)
FP8_WORDS = tl.constexpr(1)  # fp8 codes loaded as int32 words, decoded with integer operations
FP8_BYTES = tl.constexpr(2)  # fp8 codes loaded as bytes, converted by Triton (the earlier path)


def fp8_kind(fp8: bool, words: bool) -> int:
    """The kernels' FP8 constexpr for a cache (fp8 or not) and a launch's fp8_words."""
    return (FP8_WORDS.value if words else FP8_BYTES.value) if fp8 else NO_FP8.value


_SIGNS = tl.constexpr(-2147450880)  # 0x80008000 as an int32: the sign bits of two halves
# compiled to PTX (not Triton's interpreter, which reads the same variable when kernels are made)
_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))


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
def load_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, mask, kvh, offs_d, num_kv_heads,
              stride_kb, stride_kt, stride_kh, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
              BLOCK_TOKENS: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """The key tile at positions `pos` ([BLOCK_N], read where `mask`) as loaded, not decoded
    (so a loop can load the next tile before it computes on this one: paged decode's fp8
    prefetch): load_kv_raw's K and V, which decode_kv makes tiles for the dots, and, fp8, the
    keys' scales (1.0 otherwise: they are only read when FP8)."""
    rows, blk = kv_rows(bt_row, pos, mask, kvh, stride_kb, stride_kt, stride_kh, BLOCK_TOKENS)
    k = load_kv_raw(k_ptr, rows, offs_d, mask, HEAD_DIM, D_PAD, FP8)
    v = load_kv_raw(v_ptr, rows, offs_d, mask, HEAD_DIM, D_PAD, FP8)
    k_sc = 1.0
    v_sc = 1.0
    if FP8:
        k_sc = tl.load(ks_ptr + blk * num_kv_heads + kvh, mask=mask, other=0.0)
        v_sc = tl.load(vs_ptr + blk * num_kv_heads + kvh, mask=mask, other=0.0)
    return k, v, k_sc, v_sc


@triton.jit
def load_kv_raw(
    ptr, rows, offs_d, mask, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, FP8: tl.constexpr
):
    """One K or V tile's loads: FP8_WORDS, the [BLOCK_N, D_PAD / 4] int32 words
    (load_fp8_raw_words); otherwise the [BLOCK_N, D_PAD] tile as stored. fp8 caches arrive as
    uint8 views (the host reinterprets float8_e4m3fn storage), so one code path serves the GPU
    and the CPU interpreter."""
    if FP8 == FP8_WORDS:
        x = load_fp8_raw_words(ptr, rows, mask, HEAD_DIM, D_PAD)
    else:
        if HEAD_DIM == D_PAD:
            m = mask[:, None]  # a row mask is constant along D: the loads stay 16-byte vectors
        else:
            m = mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        x = tl.load(ptr + rows[:, None] + offs_d[None, :], mask=m, other=0)
    return x


@triton.jit
def decode_kv(x, D_PAD: tl.constexpr, FP8: tl.constexpr):
    """load_kv_raw's tile -> [BLOCK_N, D_PAD] in the cache's dtype; fp8: fp16, FP8_WORDS'
    tile from decode_fp8_words (the values x 2^-8, columns in tile_dims' order) or FP8_BYTES'
    (the values, Triton's conversion of a byte tile: kept to measure the two in one run)."""
    if FP8 == FP8_WORDS:
        x = decode_fp8_words(x, D_PAD)
    elif FP8 == FP8_BYTES:
        x = x.to(tl.float8e4nv, bitcast=True).to(tl.float16)  # the values themselves
    return x


@triton.jit
def _halves(x):
    """The two halves packed in int32 x, as fp16 (low, high). Compiled, a register move: with
    shifts and truncations LLVM derives each half again from the operations that built x and
    packs them back with one PRMT a pair. The interpreter (no PTX) takes the shifts."""
    if _PTX:
        lo, hi = tl.inline_asm_elementwise(
            "mov.b32 {$0, $1}, $2;",
            "=h,=h,r",
            [x],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        lo = x.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    return lo, hi


@triton.jit
def tile_dims(offs_d, FP8: tl.constexpr):
    """The head dimension each column of a K/V tile holds. An FP8_WORDS tile (decode_fp8_words)
    swaps the middle two of every four columns; the query is loaded and the output stored in
    the same order, so the dots need no shuffle. (head_dim is a multiple of 4, so `< HEAD_DIM`
    masks are the same either way.)"""
    if FP8 == FP8_WORDS:
        dims = (offs_d & -4) | ((offs_d & 1) << 1) | ((offs_d >> 1) & 1)
    else:
        dims = offs_d
    return dims


@triton.jit
def load_fp8_raw_words(ptr, rows, mask, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """An fp8 e4m3 tile's codes as [BLOCK_N, D_PAD / 4] int32 words (four codes each: 16-byte
    loads; the caller checked that rows are 4-byte aligned), for decode_fp8_words."""
    W: tl.constexpr = D_PAD // 4
    offs_w = tl.arange(0, W)
    wptr = ptr.to(tl.pointer_type(tl.int32))
    if HEAD_DIM == D_PAD:
        m = mask[:, None]
    else:
        m = mask[:, None] & (offs_w * 4 < HEAD_DIM)[None, :]
    return tl.load(wptr + (rows // 4)[:, None] + offs_w[None, :], mask=m, other=0)


@triton.jit
def decode_fp8_words(w, D_PAD: tl.constexpr):
    """load_fp8_raw_words' words -> [BLOCK_N, D_PAD] fp16, each value times 2^-8, its columns
    in tile_dims' order: decoded in registers with integer operations, a pair of halves at a
    time (codes 0 and 2 of a word in one 32-bit register, 1 and 3 in the next), so the tile that
    goes through shared memory to the dot's layout is already 16-bit (Triton re-lays out a
    tile of bytes one byte at a time)."""
    # A half whose value is an e4m3 code's times 2^-8 has the code's sign at bit 15 and its
    # seven other bits (exponent, mantissa) at bits 7-13: exact for every finite code,
    # subnormals included. Codes 1 and 3 sit at bits 8-15 and 24-31: their magnitudes move
    # down one place, their signs stay; codes 0 and 2 move up 7 and 8.
    odd = ((w >> 1) & 0x3F803F80) | (w & _SIGNS)  # codes 1 (low half) and 3 (high)
    even = ((w << 7) & 0x3F803F80) | ((w << 8) & _SIGNS)  # codes 0 and 2
    c0, c2 = _halves(even)
    c1, c3 = _halves(odd)
    # columns 4w + (0, 1, 2, 3) hold codes (0, 2, 1, 3): each register's pair side by side
    return tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), [w.shape[0], D_PAD])


@triton.jit
def _code_mul(FP8: tl.constexpr):
    """What a decoded fp8 tile's elements are multiplied by to be the codes' values."""
    if FP8 == FP8_WORDS:
        mul = 256.0
    else:
        mul = 1.0
    return mul


@triton.jit
def dot_query(q, qk_scale, FP8: tl.constexpr, PRECISION: tl.constexpr):
    """(the query as `scores` takes it, the factor its dot products are multiplied by), made
    once per program. fp8 KV (but fp32_safe): the dots run in fp16, the decoded tiles' dtype, so
    the query is scaled into fp16 with the softmax scale and a power of two that brings the
    tile's largest entry to (1, 2] (exact, and undone on the dot products), so neither a huge
    nor a tiny query leaves fp16's range, and fp16_only's fp16 sums of D products stay far
    below its overflow (a decoded code is at most 1.75)."""
    if FP8 and PRECISION != FP32_SAFE:
        qs = q.to(tl.float32) * qk_scale
        big = tl.maximum(tl.max(tl.max(tl.abs(qs), 1), 0), 1e-30)  # an all-zero tile: e = -99
        e = tl.ceil(tl.log2(big / 2.0))
        out = (qs * tl.exp2(-e)).to(tl.float16)
        mul = tl.exp2(e)
    else:
        out = q
        mul = qk_scale
    return out, mul


@triton.jit
def scores(q, k, k_sc, s_mul, FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr):
    """q: [M, D_PAD] and s_mul from `dot_query`, k: [N, D_PAD] -> fp32 [M, N] logits in the
    log2 domain. fp8 KV: k is decode_kv's fp16 tile, k_sc the keys' scales."""
    if PRECISION == FP32_SAFE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif HALF_ACC:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), out_dtype=tl.float16).to(tl.float32)
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    if FP8:
        s = s * (k_sc * _code_mul(FP8))[None, :]
    return (s * s_mul).to(tl.float32)  # Inductor may pass the scale as fp64


@triton.jit
def softmax_step(
    acc, l_i, m_i, s, v, v_sc, q, FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr
):
    """One online-softmax step over a key tile. s: [M, N] fp32 with -inf where masked; q is
    passed for its dtype (the dtype of the P.V dot in the half modes). fp8 KV: v is decode_kv's
    fp16 tile and v_sc the keys' scales; the probabilities are weighted by each key's scale
    over the tile's largest, so they stay in [0, 1] in fp16, and the dot's result is
    multiplied back."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with every key masked so far keeps m = -inf; exponentiate against 0 instead so it
    # gives p = 0, alpha = 0 rather than NaN (seq_len 0, window edges, padded rows)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if PRECISION == FP32_SAFE:
        if FP8:
            p = p * (v_sc * _code_mul(FP8))[None, :]
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    elif FP8:
        top = tl.max(v_sc, 0)  # masked keys load scale 0
        top = tl.where(top == 0.0, 1.0, top)
        pw = (p * (v_sc / top)[None, :]).to(tl.float16)
        if HALF_ACC:
            pv = tl.dot(pw, v, out_dtype=tl.float16).to(tl.float32)
        else:
            pv = tl.dot(pw, v)
        pv = pv * (top * _code_mul(FP8))
    elif HALF_ACC:
        pv = tl.dot(p.to(tl.float16), v.to(tl.float16), out_dtype=tl.float16)
        pv = pv.to(tl.float32)
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    acc = acc * alpha[:, None] + pv
    return acc, l_i, m_new
