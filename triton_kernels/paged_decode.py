"""Paged decode attention (flash-decoding): one new query token per sequence.

Grid: (batch x kv_heads x group_tiles, num_splits). A program holds every query head of one KV
head in one tile (GQA packing: block_m rows = the group padded to a power of two >= 16, the
minimum M of tl.dot), so each K/V byte is read once per KV head, not once per query head. When
batch x kv_heads programs cannot fill the GPU (2 x SMs), the sequence is split: each split
writes an unnormalised partial (acc, running max m, running sum l) and a second kernel combines
them: out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.

The split boundaries come from seq_lens on the device, so nothing is read back to the host and
the step is CUDA-graph capturable; num_splits itself is chosen from block_table's width.

Balanced mode (`balance=True`, kernel.decode_balance): one long sequence among short ones left
the classic grid waiting on the long row's few programs (one 32k row beside 31 of 512 keys:
0.42 ms on the H200 against cuDNN's 0.09, 2026-12-05), because its splits are the same for
every row and are chosen before the lengths are known. Here the grid is (kv_heads x
group_tiles, batch + T) and every program reads all the lengths: the key work (each row's keys
from its window start) is cut into chunks of C = max(4 key tiles, ceil(total / T)) keys, T =
ceil(2 x SMs / (kv_heads x group_tiles)), so a row of n keys takes ceil(n / C) programs (at
least one) and the rows' chunks, numbered in row order, are the programs' second index; the
bound sum(ceil(n_b / C)) < batch + T holds for any lengths, and programs past the last chunk do
nothing. A row of one chunk writes its output directly; the others write partials that the
combine kernel, recomputing the same chunks, merges. Uniform batches that fill the GPU keep one
program per row (C >= their length); the cost against the classic grid is the idle programs
and a combine launch (measured in bench_attention.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import _checks as C
from ._flash import decode_kv, dot_query, fp8_kind, load_tile, scores, softmax_step, tile_dims
from .precision import PrecisionMode
from .tiling import TileQuery, check_overrides, launch_config, next_pow2, select_num_splits

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # a window wider than any sequence: lo = max(seq_len - W, 0) = 0


@triton.jit
def _row_chunks(lens_ptr, batch, max_len, window, chunk_target, BLOCK_N: tl.constexpr,
                BLOCK_B: tl.constexpr):  # fmt: skip
    """Balanced mode: each row's chunk count n (at least one; 0 past the batch) and where its
    chunks end in the numbering of all rows' chunks (inclusive cumsum)."""
    offs_b = tl.arange(0, BLOCK_B)
    in_b = offs_b < batch
    lens = tl.minimum(tl.load(lens_ptr + offs_b, mask=in_b, other=0), max_len)
    work = lens - (tl.maximum(lens - window, 0) // BLOCK_N) * BLOCK_N
    # (the total in int64: rows sharing a long prefix can sum past 2^31 keys)
    size = tl.maximum(tl.cdiv(tl.sum(work.to(tl.int64), 0), chunk_target), 4 * BLOCK_N)
    n = tl.where(in_b, tl.maximum(tl.cdiv(work, size), 1), 0).to(tl.int32)
    return offs_b, n, tl.cumsum(n, 0)


@triton.jit
def _chunk_of(lens_ptr, batch, max_len, window, chunk_target, chunk, BLOCK_N: tl.constexpr,
              BLOCK_B: tl.constexpr):  # fmt: skip
    """Balanced mode: which row chunk `chunk` belongs to (batch or more: no such chunk), its
    index in the row and the row's chunk count (balanced_chunks() is the same on the host, for
    tests). Every row's key work is [its window start rounded down to a key tile, its length)."""
    offs_b, n, ends = _row_chunks(lens_ptr, batch, max_len, window, chunk_target, BLOCK_N, BLOCK_B)
    row = tl.sum((ends <= chunk).to(tl.int32), 0)
    mine = offs_b == row
    n_row = tl.sum(tl.where(mine, n, 0), 0)
    first = tl.sum(tl.where(mine, ends - n, 0), 0)
    return row, chunk - first, n_row


@triton.jit
def _tile(n0, lo, end, BLOCK_N: tl.constexpr):
    """The key tile at n0: its positions and which of them to read (never outside [lo, end):
    their blocks may be unmapped or freed; past the end, none)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    return pos, (pos < end) & (pos >= lo)


@triton.jit
def _attend(acc, l_i, m_i, q, s_mul, k, v, k_sc, v_sc, valid, D_PAD: tl.constexpr,
            FP8: tl.constexpr, PRECISION: tl.constexpr, HALF_ACC: tl.constexpr):  # fmt: skip
    """One key tile (load_tile's, not decoded) into the running softmax."""
    k = decode_kv(k, D_PAD, FP8)
    v = decode_kv(v, D_PAD, FP8)
    s = scores(q, k, k_sc, s_mul, FP8, PRECISION, HALF_ACC)
    s = tl.where(valid[None, :], s, float("-inf"))
    return softmax_step(acc, l_i, m_i, s, v, v_sc, q, FP8, PRECISION, HALF_ACC)


# (batch and chunk_target: runtime values of balanced mode; specialised, they would compile
# the classic kernel again for batches of 1, of multiples of 16 and of the rest)
@triton.jit(do_not_specialize=["batch", "chunk_target"])
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    po_ptr,
    pml_ptr,
    qk_scale,
    window,
    max_len,
    num_kv_heads,
    group,
    group_tiles,
    num_splits,
    batch,
    chunk_target,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_btb,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
    HALF_ACC: tl.constexpr,
    SPLIT: tl.constexpr,
    BALANCED: tl.constexpr = False,
    BLOCK_B: tl.constexpr = 1,
    PREFETCH: tl.constexpr = False,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    gt = pid % group_tiles
    if BALANCED:  # program (kv head x group tile, chunk): the chunk's row and its place in it
        kvh = pid // group_tiles
        b, split, n_chunks = _chunk_of(
            lens_ptr, batch, max_len, window, chunk_target, split, BLOCK_N, BLOCK_B
        )
        if b >= batch:  # past the last chunk (the grid's bound is loose by up to T)
            return
        num_splits = n_chunks
    else:
        kvh = (pid // group_tiles) % num_kv_heads
        b = pid // (group_tiles * num_kv_heads)

    seq_len = tl.minimum(tl.load(lens_ptr + b), max_len)
    lo = tl.maximum(seq_len - window, 0)  # no window: the host passes window > max_len
    # splits share [lo, seq_len) in whole key tiles; an empty split writes m = -inf, l = 0
    base = (lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
    start = base + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = gt * BLOCK_G + tl.arange(0, BLOCK_G)
    offs_d = tile_dims(tl.arange(0, D_PAD), FP8)  # fp8: decode_fp8_words' column order
    heads = kvh * group + offs_g  # [BLOCK_G] query heads of this KV head
    g_mask = offs_g < group
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :], other=0)
    q, s_mul = dot_query(q, qk_scale, FP8, PRECISION)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    if PREFETCH:
        # fp8 (LaunchConfig.fp8_prefetch): tile n + 1's codes and scales are loaded straight
        # into registers before tile n is decoded and computed, instead of the pipeline's
        # cp.async staging through shared memory that the loop below gets
        pos, valid = _tile(start, lo, end, BLOCK_N)
        k, v, k_sc, v_sc = load_tile(
            k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, valid, kvh, offs_d, num_kv_heads,
            stride_kb, stride_kt, stride_kh, HEAD_DIM, D_PAD, BLOCK_TOKENS, FP8,
        )  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            pos, nxt = _tile(n0 + BLOCK_N, lo, end, BLOCK_N)
            k_nxt, v_nxt, ks_nxt, vs_nxt = load_tile(
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, nxt, kvh, offs_d, num_kv_heads,
                stride_kb, stride_kt, stride_kh, HEAD_DIM, D_PAD, BLOCK_TOKENS, FP8,
            )  # fmt: skip
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, s_mul, k, v, k_sc, v_sc, valid, D_PAD,
                                    FP8, PRECISION, HALF_ACC)  # fmt: skip
            k, v, k_sc, v_sc, valid = k_nxt, v_nxt, ks_nxt, vs_nxt, nxt
    else:
        for n0 in range(start, end, BLOCK_N):
            pos, valid = _tile(n0, lo, end, BLOCK_N)
            k, v, k_sc, v_sc = load_tile(
                k_ptr, v_ptr, ks_ptr, vs_ptr, bt_row, pos, valid, kvh, offs_d, num_kv_heads,
                stride_kb, stride_kt, stride_kh, HEAD_DIM, D_PAD, BLOCK_TOKENS, FP8,
            )  # fmt: skip
            acc, l_i, m_i = _attend(acc, l_i, m_i, q, s_mul, k, v, k_sc, v_sc, valid, D_PAD,
                                    FP8, PRECISION, HALF_ACC)  # fmt: skip

    row = b * num_kv_heads * group + heads  # flat (batch, q head) index
    if BALANCED:
        # one chunk: the output itself; more: a partial in the chunk's slot (row order)
        slot = tl.program_id(1) * num_kv_heads * group + heads
        d_mask = (offs_d < HEAD_DIM)[None, :]
        chunks = heads * 0 + n_chunks  # (as a vector: a scalar's bool in a mask is refused)
        part = g_mask & (chunks > 1)
        po = po_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(po, acc, mask=part[:, None] & d_mask)
        tl.store(pml_ptr + slot * 2, m_i, mask=part)
        tl.store(pml_ptr + slot * 2 + 1, l_i, mask=part)
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        whole = g_mask & (chunks == 1)
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=whole[:, None] & d_mask)
    elif SPLIT:
        po = po_ptr + (row[:, None] * num_splits + split) * HEAD_DIM + offs_d[None, :]
        tl.store(po, acc, mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :])
        tl.store(pml_ptr + (row * num_splits + split) * 2, m_i, mask=g_mask)
        tl.store(pml_ptr + (row * num_splits + split) * 2 + 1, l_i, mask=g_mask)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0 -> acc = 0 -> zeros
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        o_mask = g_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit(do_not_specialize=["batch", "max_len", "window", "chunk_target"])
def _combine_kernel(
    po_ptr,
    pml_ptr,
    out_ptr,
    num_q_heads,
    num_splits,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
    BALANCED: tl.constexpr = False,
    BLOCK_B: tl.constexpr = 1,
    BLOCK_N: tl.constexpr = 16,
    lens_ptr=None,
    batch=0,
    max_len=0,
    window=0,
    chunk_target=1,
):
    row = tl.program_id(0)  # flat (batch, q head)
    b = row // num_q_heads
    h = row % num_q_heads
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    # partial s of this row: slot (row * num_splits + s); balanced: (first + s) * heads + h
    first = row * num_splits
    stride = 1
    count = num_splits
    if BALANCED:  # the row's chunks, as the decode kernel cut them (one: written there)
        offs_b, n, ends = _row_chunks(
            lens_ptr, batch, max_len, window, chunk_target, BLOCK_N, BLOCK_B
        )
        mine = offs_b == b
        count = tl.sum(tl.where(mine, n, 0), 0)
        first = tl.sum(tl.where(mine, ends - n, 0), 0) * num_q_heads + h
        stride = num_q_heads
        if count <= 1:  # one chunk: the decode kernel wrote the output
            return
    # pass 1: the global max over splits
    m_all = tl.full([SPLIT_TILE], float("-inf"), tl.float32)
    for s0 in range(0, count, SPLIT_TILE):
        offs_s = s0 + tl.arange(0, SPLIT_TILE)
        m = tl.load(
            pml_ptr + (first + offs_s * stride) * 2, mask=offs_s < count, other=float("-inf")
        )
        m_all = tl.maximum(m_all, m)
    m_max = tl.max(m_all, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    # pass 2: weighted sums
    num = tl.zeros([D_PAD], tl.float32)
    den = tl.zeros([SPLIT_TILE], tl.float32)
    for s0 in range(0, count, SPLIT_TILE):
        offs_s = s0 + tl.arange(0, SPLIT_TILE)
        s_mask = offs_s < count
        slot = first + offs_s * stride
        m = tl.load(pml_ptr + slot * 2, mask=s_mask, other=float("-inf"))
        lsum = tl.load(pml_ptr + slot * 2 + 1, mask=s_mask, other=0.0)
        w = tl.exp2(m - m_max)  # empty split: m = -inf -> w = 0
        po = po_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :]
        part = tl.load(po, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
        num += tl.sum(part * w[:, None], 0)
        den += w * lsum
    total = tl.sum(den, 0)
    o = num / tl.where(total == 0.0, 1.0, total)
    o_ptrs = out_ptr + b * stride_ob + h * stride_oh + offs_d
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H200 so split choices match the GPU
    return torch.cuda.get_device_properties(device).multi_processor_count


def _validate(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sliding_window):
    C.check_runnable("q", q)
    C.check_kv_cache(k_cache, v_cache, q.device)
    C.check_query(q, k_cache, "[batch, num_q_heads, head_dim]")
    C.check_tables(block_table, seq_lens, q.shape[0], q.device)
    C.check_scales(k_cache, k_scale, v_scale, q.device)
    return C.check_window(sliding_window)


MAX_BALANCED_BATCH = 4096  # every balanced program holds all the lengths in registers


def balance_target(num_kv_heads: int, group_tiles: int, num_sms: int) -> int:
    """Balanced mode's T: chunks a (kv head, group tile) so that all programs fill 2 x SMs."""
    return max(1, -(-2 * num_sms // (num_kv_heads * group_tiles)))


def balanced_chunks(lens, window: int, max_len: int, block_n: int, target: int) -> list[int]:
    """Balanced mode's chunk count of each row, as _row_chunks computes it on the device (for
    tests and benchmarks): the key work [window start rounded down to a key tile, length) cut
    into chunks of max(4 key tiles, ceil(total / target)) keys, at least one a row."""
    lens = [min(int(n), max_len) for n in lens]
    work = [n - (max(n - window, 0) // block_n) * block_n for n in lens]
    size = max(-(-sum(work) // target), 4 * block_n)
    return [max(-(-w // size), 1) for w in work]


def decode_launch(
    q, k_cache, block_table, window, precision, launch, num_splits, tiles=None, balance=None
):
    """The launch choice (memoised per shape bucket) and the number of splits (0: balanced
    mode, its grid from balance_target)."""
    tiles = check_overrides(launch, tiles)
    balance = tiles.balance if balance is None else balance
    if not isinstance(balance, bool):
        raise ValueError(f"balance: {balance!r} must be True, False or None")
    if balance and num_splits is not None:
        raise ValueError("num_splits: given with balance=True, which chooses the splits itself")
    if balance and q.shape[0] > MAX_BALANCED_BATCH:
        raise ValueError(
            f"balance: a batch of {q.shape[0]} rows is more than balanced decode's "
            f"{MAX_BALANCED_BATCH} (kernel.decode_balance false takes the classic splits)"
        )
    batch, hq, d = q.shape
    hkv, bt = k_cache.shape[2], k_cache.shape[1]
    max_len = block_table.shape[1] * bt
    span = min(max_len, window) if window else max_len
    if launch is None:
        tq = TileQuery(
            hq * d,
            d,
            hq,
            hkv,
            k_cache.dtype,
            "decode",
            max(span, 1),
            tiles.kind(window),
            block_n=tiles.block_n,  # block_m is the GQA group tile: see Tiles
            precision=precision,
        )
        launch = launch_config(tq)
    group_tiles = triton.cdiv(hq // hkv, launch.block_m)
    if balance:
        return launch, group_tiles, 0
    splits = num_splits if num_splits is not None else launch.num_splits
    if splits is None:
        programs = batch * hkv * group_tiles
        splits = select_num_splits(programs, span, launch.block_n, _num_sms(q.device))
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 1024:
        raise ValueError(f"num_splits: {splits!r} must be an int in [1, 1024]")
    return launch, group_tiles, splits


def paged_decode(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale=None,
    sliding_window=None,
    precision=PrecisionMode.AUTO_MIXED,
    k_scale=None,
    v_scale=None,
    out=None,
    num_splits=None,
    launch=None,
    tiles=None,
    balance=None,
):
    """Attention of one query token per sequence over its paged K/V.

    q: [batch, num_q_heads, head_dim]; k_cache, v_cache: [num_blocks, block_tokens, kv_heads,
    head_dim]; block_table: [batch, max_blocks] int32; seq_lens: [batch] int32 (the query is the
    token at position seq_lens[b] - 1; seq_lens[b] == 0 gives zeros). sliding_window=W: keys at
    positions > seq_len - 1 - W only. num_splits / launch override the tiling choice; tiles
    (a Tiles: key tile and attention type) steers it. balance (None: tiles.balance) cuts the
    key work into chunks of about equal size from the lengths on the device (the module's
    docstring), so one long row among short ones does not hold the whole batch.
    Returns out: [batch, num_q_heads, head_dim] in q's dtype.
    """
    precision = PrecisionMode.parse(precision)
    window = _validate(q, k_cache, v_cache, block_table, seq_lens, k_scale, v_scale, sliding_window)
    out = C.check_out(out, q)
    batch, hq, d = q.shape
    if batch == 0:
        return out
    hkv, bt = k_cache.shape[2], k_cache.shape[1]
    cfg, group_tiles, splits = decode_launch(
        q, k_cache, block_table, window, precision, launch, num_splits, tiles, balance
    )
    fp8 = C.is_fp8(k_cache.dtype)
    balanced = splits == 0
    target = balance_target(hkv, group_tiles, _num_sms(q.device)) if balanced else 1
    slots = batch + target if balanced else splits  # balanced: chunks < batch + target
    if balanced or splits > 1:  # balanced: slot (chunk, q head); else (batch, q head, split)
        rows = slots * hq if balanced else batch * hq * splits
        part_o = torch.empty((rows, d), device=q.device, dtype=torch.float32)
        part_ml = torch.empty((rows, 2), device=q.device, dtype=torch.float32)
    else:
        part_o = part_ml = out  # unused
    grid = (hkv * group_tiles, slots) if balanced else (batch * hkv * group_tiles, splits)
    block_b = next_pow2(batch) if balanced else 1
    win, max_len = window or NO_WINDOW, block_table.shape[1] * bt
    qk_scale = C.softmax_scale(scale, d) * LOG2E
    ks = k_scale if fp8 else q  # unused pointer when not fp8
    vs = v_scale if fp8 else q
    _decode_kernel[grid](
        q,
        C.as_codes(k_cache),
        C.as_codes(v_cache),
        ks,
        vs,
        block_table,
        seq_lens,
        out,
        part_o,
        part_ml,
        qk_scale,
        win,
        max_len,
        hkv,
        hq // hkv,
        group_tiles,
        max(splits, 1),
        batch,
        target,
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
        BLOCK_G=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_TOKENS=bt,
        FP8=fp8_kind(fp8, cfg.fp8_words),
        PRECISION=int(precision),
        HALF_ACC=_half_acc(precision, q.dtype),
        SPLIT=splits > 1,
        BALANCED=balanced,
        BLOCK_B=block_b,
        PREFETCH=fp8 and cfg.fp8_prefetch,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if balanced or splits > 1:
        # balanced: the combine recomputes the decode kernel's cut from the same lengths
        cut = {}
        if balanced:
            cut = dict(BALANCED=True, BLOCK_B=block_b, BLOCK_N=cfg.block_n, batch=batch,
                       max_len=max_len, window=win, chunk_target=target)  # fmt: skip
        _combine_kernel[(batch * hq,)](
            part_o,
            part_ml,
            out,
            hq,
            max(splits, 1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            D_PAD=next_pow2(d),
            SPLIT_TILE=16 if balanced else min(16, next_pow2(splits)),
            lens_ptr=seq_lens,  # (classic: unused; one signature for both modes)
            num_warps=4,
            **cut,
        )
    return out


def _half_acc(precision: PrecisionMode, dtype: torch.dtype) -> bool:
    """FP16_ONLY accumulates dots in half only for fp16: Triton's dot has no bf16 accumulator."""
    return precision == PrecisionMode.FP16_ONLY and dtype == torch.float16
