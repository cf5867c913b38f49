"""Paged prefill attention: ragged new tokens over their cached prefix and causally over
themselves (dense prefill is the case seq_lens == new tokens).

Grid: (num_q_heads, query tiles). Query tiles of all sequences are numbered one after another;
a program finds its sequence from cu_seqlens_q in-kernel (a cumsum over the batch), so the grid
is an upper bound known on the host (cdiv(T, BLOCK_M) + batch) and nothing is read back. The
head axis varies fastest so the query heads sharing a KV head run together and share K/V in L2;
within a sequence the last (longest, causal) tiles start first to shorten the tail.

Key loop in two phases: tiles every row of the query tile sees entirely (no causal or length
mask: below the diagonal) and the masked tiles along the diagonal and the sequence end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _checks as C
from ._flash import decode_kv, dot_query, fp8_kind, load_tile, scores, softmax_step, tile_dims
from .paged_decode import LOG2E, NO_WINDOW, _half_acc
from .precision import PrecisionMode
from .tiling import LaunchConfig, TileQuery, check_overrides, launch_config, next_pow2


@triton.jit
def _find_tile(cu_ptr, batch, tile, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """(sequence, query tile within it) of flat tile `tile`; sequence == batch: past the end.
    The sequences are scanned CHUNK at a time (a runtime loop: one build for any batch)."""
    idx = tl.arange(0, CHUNK)
    seq = 0
    first = 0  # tiles of the sequences before `seq`
    count = 0  # tiles of `seq`
    seen = 0  # tiles of the chunks scanned
    for c0 in range(0, batch, CHUNK):
        i = c0 + idx
        m = i < batch
        starts = tl.load(cu_ptr + i, mask=m, other=0)
        ends = tl.load(cu_ptr + i + 1, mask=m, other=0)
        ntiles = tl.cdiv(ends - starts, BLOCK_M)
        cum = seen + tl.cumsum(ntiles, 0)  # inclusive
        before = m & (cum <= tile)
        seq += tl.sum(before.to(tl.int32), 0)
        first += tl.sum(tl.where(before, ntiles, 0), 0)
        count += tl.sum(tl.where(m & (cum > tile) & (cum - ntiles <= tile), ntiles, 0), 0)
        seen += tl.sum(ntiles, 0)
    return seq, count - 1 - (tile - first)  # last tiles first


@triton.jit
def _key_phase(
    acc,
    l_i,
    m_i,
    q,
    pos_q,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_row,
    kvh,
    lo,
    lo_true,
    hi,
    seq_len,
    window,
    s_mul,
    num_kv_heads,
    stride_kb,
    stride_kt,
    stride_kh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    HALF_ACC: tl.constexpr,
):
    offs_d = tl.arange(0, D_PAD)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        # loads stay inside [lo_true, seq_len): blocks outside may be unmapped or freed
        load_ok = (pos < seq_len) & (pos >= lo_true)
        k, v, k_sc, v_sc = load_tile(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, load_ok, kvh, offs_d, num_kv_heads,
            stride_kb, stride_kt, stride_kh, HEAD_DIM, D_PAD, BLOCK_TOKENS, FP8,
        )  # fmt: skip
        k = decode_kv(k, D_PAD, FP8)
        v = decode_kv(v, D_PAD, FP8)
        s = scores(q, k, k_sc, s_mul, FP8, PRECISION, HALF_ACC)
        if MASKED or HAS_WINDOW:
            ok = load_ok[None, :]
            if CAUSAL:
                ok = ok & (pos[None, :] <= pos_q[:, None])
            if HAS_WINDOW:
                ok = ok & (pos[None, :] > pos_q[:, None] - window)
            s = tl.where(ok, s, float("-inf"))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, s, v, v_sc, q, FP8, PRECISION, HALF_ACC)
    return acc, l_i, m_i


# Integers that change from step to step (rows, the table's width) are not specialised on: Triton
# compiles a variant for each value that is 1 or a multiple of 16, and on the H200 the engine's
# steps met a new one every few steps, each a ~1 s compile inside someone's generate()
@triton.jit(do_not_specialize=["max_len", "batch", "stride_btb"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    lens_ptr,
    cu_ptr,
    out_ptr,
    qk_scale,
    window,
    max_len,
    batch,
    num_kv_heads,
    group,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    CHUNK: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    HALF_ACC: tl.constexpr,
):
    head = tl.program_id(0)
    seq, m_tile = _find_tile(cu_ptr, batch, tl.program_id(1), BLOCK_M, CHUNK)
    if seq >= batch:
        return
    q_start = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_start
    seq_len = tl.minimum(tl.load(lens_ptr + seq), max_len)
    ctx = seq_len - q_len  # cached prefix before the new tokens
    kvh = head // group
    m0 = m_tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tile_dims(tl.arange(0, D_PAD), FP8)  # fp8: decode_fp8_words' column order
    row_ok = offs_m < q_len
    pos_q = ctx + offs_m  # absolute positions of the queries
    q_ptrs = q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    io_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0)
    q, s_mul = dot_query(q, qk_scale, FP8, PRECISION)

    lo_true = tl.maximum(ctx + m0 - window + 1, 0)  # no window: the host passes a huge one
    lo = (lo_true // BLOCK_N) * BLOCK_N
    if CAUSAL:
        hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
        full = ((ctx + m0 + 1) // BLOCK_N) * BLOCK_N  # keys every row sees (j <= ctx + m0)
    else:
        hi = seq_len
        full = (seq_len // BLOCK_N) * BLOCK_N
    full = tl.maximum(full, lo)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    bt_row = bt_ptr + seq * stride_btb
    acc, l_i, m_i = _key_phase(
        acc,
        l_i,
        m_i,
        q,
        pos_q,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_row,
        kvh,
        lo,
        lo_true,
        full,
        seq_len,
        window,
        s_mul,
        num_kv_heads,
        stride_kb,
        stride_kt,
        stride_kh,
        HEAD_DIM,
        D_PAD,
        BLOCK_N,
        BLOCK_TOKENS,
        False,
        CAUSAL,
        HAS_WINDOW,
        FP8,
        PRECISION,
        HALF_ACC,
    )
    acc, l_i, m_i = _key_phase(
        acc,
        l_i,
        m_i,
        q,
        pos_q,
        k_ptr,
        v_ptr,
        ks_ptr,
        vs_ptr,
        bt_row,
        kvh,
        full,
        lo_true,
        hi,
        seq_len,
        window,
        s_mul,
        num_kv_heads,
        stride_kb,
        stride_kt,
        stride_kh,
        HEAD_DIM,
        D_PAD,
        BLOCK_N,
        BLOCK_TOKENS,
        True,
        CAUSAL,
        HAS_WINDOW,
        FP8,
        PRECISION,
        HALF_ACC,
    )
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_ptrs = out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


def _validate(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    k_scale,
    v_scale,
    sliding_window,
    causal,
):
    C.check_runnable("q", q)
    C.check_kv_cache(k_cache, v_cache, q.device)
    C.check_query(q, k_cache, "[total_new_tokens, num_q_heads, head_dim]")
    C.check_device("cu_seqlens_q", cu_seqlens_q, q.device)
    if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] < 1:
        raise ValueError(f"cu_seqlens_q: shape {list(cu_seqlens_q.shape)}, expected [batch + 1]")
    C.check_dtype("cu_seqlens_q", cu_seqlens_q, (torch.int32,))
    if not cu_seqlens_q.is_contiguous():
        raise ValueError("cu_seqlens_q: must be contiguous")
    C.check_tables(block_table, seq_lens, cu_seqlens_q.shape[0] - 1, q.device)
    C.check_scales(k_cache, k_scale, v_scale, q.device)
    if not isinstance(causal, bool):
        raise ValueError(f"causal: {causal!r} must be a bool")
    return C.check_window(sliding_window)


def prefill_launch(q, k_cache, window, precision, launch, tiles=None) -> LaunchConfig:
    tiles = check_overrides(launch, tiles)
    if launch is not None:
        return launch
    total, hq, d = q.shape
    tq = TileQuery(
        hq * d,
        d,
        hq,
        k_cache.shape[2],
        k_cache.dtype,
        "prefill",
        max(total, 1),
        tiles.kind(window),
        block_m=tiles.block_m,
        block_n=tiles.block_n,
        precision=precision,
    )
    return launch_config(tq)


def paged_prefill(
    q,
    k_cache,
    v_cache,
    block_table,
    cu_seqlens_q,
    seq_lens,
    *,
    causal=True,
    scale=None,
    sliding_window=None,
    precision=PrecisionMode.AUTO_MIXED,
    k_scale=None,
    v_scale=None,
    out=None,
    launch=None,
    tiles=None,
):
    """q: [total_new_tokens, num_q_heads, head_dim], ragged by cu_seqlens_q ([batch + 1] int32).
    Sequence b's new tokens are the last cu[b+1] - cu[b] of its seq_lens[b] cached tokens (append
    them with kv_append first). launch overrides the tiling choice; tiles (a Tiles: query and key
    tiles, attention type) steers it. Returns out: [total_new_tokens, num_q_heads, head_dim]."""
    precision = PrecisionMode.parse(precision)
    window = _validate(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        k_scale,
        v_scale,
        sliding_window,
        causal,
    )
    out = C.check_out(out, q)
    total, hq, d = q.shape
    batch = cu_seqlens_q.shape[0] - 1
    if total == 0 or batch == 0:
        return out
    hkv, bt = k_cache.shape[2], k_cache.shape[1]
    cfg = prefill_launch(q, k_cache, window, precision, launch, tiles)
    fp8 = C.is_fp8(k_cache.dtype)
    ks = k_scale if fp8 else q  # unused pointer when not fp8
    vs = v_scale if fp8 else q
    grid = (hq, triton.cdiv(total, cfg.block_m) + batch)
    _prefill_kernel[grid](
        q,
        C.as_codes(k_cache),
        C.as_codes(v_cache),
        ks,
        vs,
        block_table,
        seq_lens,
        cu_seqlens_q,
        out,
        C.softmax_scale(scale, d) * LOG2E,
        window or NO_WINDOW,
        block_table.shape[1] * bt,
        batch,
        hkv,
        hq // hkv,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        D_PAD=next_pow2(d),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_TOKENS=bt,
        CHUNK=64,
        CAUSAL=causal,
        HAS_WINDOW=window > 0,
        FP8=fp8_kind(fp8, cfg.fp8_words),
        PRECISION=int(precision),
        HALF_ACC=_half_acc(precision, q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
