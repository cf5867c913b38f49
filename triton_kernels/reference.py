"""Plain-PyTorch float64 references of the kernels (also the CPU path of the integration).

Same signatures as the kernels minus precision/out; they compute in float64 and return q's dtype.
They gather K/V through the block table per sequence and attend with masked dense matmuls, in
query chunks so that the score matrix stays under ~16M elements.

Conventions shared with the kernels:
- a query at absolute position p sees keys at positions j <= p (causal) and, with
  sliding_window=W, j > p - W (the last W tokens including itself, as transformers/Mistral).
  Without causality the window still bounds keys from below only.
- paged prefill: sequence b's new tokens are the last cu_seqlens_q[b+1] - cu_seqlens_q[b] of its
  seq_lens[b] cached tokens; decode: the query is the token at position seq_lens[b] - 1.
- a query that sees no key (seq_lens[b] == 0) gives zeros.
- fp8 caches hold e4m3 codes (torch.float8_e4m3fn, or uint8 codes); value = code x scale of
  (block, kv head). See kv_append_ref for how scales are set.
"""

from __future__ import annotations

import torch

from ._checks import FP8_MAX, is_fp8

FP8_HEADROOM = 4.0  # block scale = amax x 4 / 448: later tokens may be up to 4x the first ones
FP8_AMAX_FLOOR = 1e-6  # an all-zero head row still gets a usable (positive) scale
_CHUNK_ELEMS = 1 << 24


def fp8_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (float8_e4m3fn or uint8) -> float64 values (before scaling)."""
    if codes.dtype == torch.uint8:
        codes = codes.view(torch.float8_e4m3fn)
    return codes.to(torch.float64)


def float_to_fp8(x: torch.Tensor, like_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values already divided by their scale -> e4m3 codes in like_dtype (saturating)."""
    codes = x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8) if like_dtype == torch.uint8 else codes


def _fp8_block_scales(x, blocks, offsets, valid, scale_table) -> None:
    """The kv_append scale policy, for one of K/V. x: [T, H, D]; updates scale_table in place,
    reading and writing only the rows of the blocks this call writes (a paged pool's other rows
    may lie on unmapped pages).

    A (block, head) scale is (re)set by a call that writes the block's slot 0, or whose stored
    scale is <= 0 (never set): it becomes max(amax over the call's tokens in that block, floor)
    x headroom / 448. Other blocks keep their scale; values beyond 448 x scale saturate.
    """
    h = scale_table.shape[1]
    vb = blocks[valid]
    if vb.numel() == 0:
        return
    rows, inv = torch.unique(vb, return_inverse=True)  # the blocks written, and each token's
    factor = torch.tensor(FP8_HEADROOM / FP8_MAX, dtype=torch.float32)
    amax = x.abs().amax(-1).to(torch.float32).clamp_min(FP8_AMAX_FLOOR)  # [T, H]
    cand = (amax * factor)[valid]  # [T_valid, H]
    new = torch.zeros((rows.numel(), h), dtype=torch.float32, device=x.device)
    new.scatter_reduce_(0, inv[:, None].expand(-1, h), cand, reduce="amax", include_self=True)
    leader = torch.zeros(rows.numel(), dtype=torch.bool, device=x.device)
    leader[inv[offsets[valid] == 0]] = True
    old = scale_table[rows]
    fresh = leader[:, None] | (old <= 0)  # [rows, H]
    scale_table[rows] = torch.where(fresh, new, old)


def kv_append_ref(
    k, v, k_cache, v_cache, slot_mapping, *, k_scale=None, v_scale=None, inplace=False
):
    """Scatter k, v ([T, kv_heads, D]) into the caches at slot_mapping ([T]; negative = skip).

    Returns (k_cache, v_cache, k_scale, v_scale): copies, or the given tensors mutated when
    inplace=True (the CPU path of kv_append). Scales are None unless the cache is fp8.
    """
    nb, bt = k_cache.shape[:2]
    if not inplace:
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
        k_scale = None if k_scale is None else k_scale.clone()
        v_scale = None if v_scale is None else v_scale.clone()
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    blocks, offsets = slots.clamp_min(0) // bt, slots.clamp_min(0) % bt
    for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_fp8(cache.dtype):
            _fp8_block_scales(x, blocks, offsets, valid, sc)
            q = x.to(torch.float32) / sc[blocks][:, :, None]  # [T, H, D]
            vals = float_to_fp8(q, cache.dtype)
        else:
            vals = x.to(cache.dtype)
        cache[blocks[valid], offsets[valid]] = vals[valid]
    return k_cache, v_cache, k_scale, v_scale


def _gather(cache, scale, table_row, n):
    """The first n tokens of one sequence: [n, kv_heads, D] float64."""
    bt = cache.shape[1]
    pos = torch.arange(n, device=cache.device)
    blocks = table_row[pos // bt].to(torch.int64)
    x = cache[blocks, pos % bt]
    if is_fp8(cache.dtype):
        return fp8_codes_to_float(x) * scale[blocks].to(torch.float64)[:, :, None]
    return x.to(torch.float64)


def _attend(q, k, v, q_pos, k_pos, scale, causal, window, extra=None):
    """q: [Hq, M, D], k/v: [Hkv, N, D] float64; q_pos: [M], k_pos: [N] -> [Hq, M, D].

    Query chunks keep the [Hq, chunk, N] score matrix bounded; rows with no visible key -> 0.
    extra: optional [Hq or 1, M, N] additive float64 mask."""
    hq, m, d = q.shape
    hkv, n = k.shape[0], k.shape[1]
    k = k.repeat_interleave(hq // hkv, 0)  # [Hq, N, D]
    v = v.repeat_interleave(hq // hkv, 0)
    out = torch.zeros_like(q)
    step = max(1, _CHUNK_ELEMS // max(1, hq * n))
    for c in range(0, m, step):
        qp = q_pos[c : c + step, None]  # [mc, 1]
        allowed = torch.ones(qp.shape[0], n, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= k_pos[None, :] <= qp
        if window:
            allowed &= k_pos[None, :] > qp - window
        s = torch.matmul(q[:, c : c + step], k.transpose(1, 2)) * scale  # [Hq, mc, N]
        if extra is not None:
            s = s + extra[:, c : c + step]
        s = s.masked_fill(~allowed, float("-inf"))
        row_max = s.amax(-1, keepdim=True)
        p = torch.exp(s - torch.where(torch.isinf(row_max), 0.0, row_max))  # -inf rows -> 0
        den = p.sum(-1, keepdim=True)
        out[:, c : c + step] = torch.matmul(p, v) / torch.where(den == 0, 1.0, den)
    return out


def paged_decode_ref(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    *,
    scale=None,
    sliding_window=None,
    k_scale=None,
    v_scale=None,
):
    """q: [B, Hq, D] -> [B, Hq, D]; see the module docstring for the conventions."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_prefill_ref(
        q,
        k_cache,
        v_cache,
        block_table,
        cu,
        seq_lens,
        causal=True,
        scale=scale,
        sliding_window=sliding_window,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def paged_prefill_ref(
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
    k_scale=None,
    v_scale=None,
):
    """q: [T, Hq, D] ragged by cu_seqlens_q ([B+1]) -> [T, Hq, D]."""
    d = q.shape[-1]
    scale = d**-0.5 if scale is None else float(scale)
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b in range(len(lens)):
        n_q, n_k = cu[b + 1] - cu[b], lens[b]
        if n_q == 0 or n_k == 0:
            continue
        k = _gather(k_cache, k_scale, block_table[b], n_k).transpose(0, 1)  # [Hkv, n_k, D]
        v = _gather(v_cache, v_scale, block_table[b], n_k).transpose(0, 1)
        qb = q[cu[b] : cu[b + 1]].to(torch.float64).transpose(0, 1)  # [Hq, n_q, D]
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)
        k_pos = torch.arange(n_k, device=q.device)
        o = _attend(qb, k, v, q_pos, k_pos, scale, causal, sliding_window)
        out[cu[b] : cu[b + 1]] = o.transpose(0, 1)
    return out.to(q.dtype)


def dense_attention_ref(q, k, v, *, causal=False, scale=None, attn_mask=None, sliding_window=None):
    """q: [B, Hq, Sq, D], k/v: [B, Hkv, Sk, D] (GQA: Hq a multiple of Hkv) -> [B, Hq, Sq, D].

    causal aligns the queries with the LAST Sq keys (query i sits at position Sk - Sq + i, as in
    prefill with a cached prefix; torch SDPA's is_causal aligns top-left instead: they agree when
    Sq == Sk). attn_mask: bool (True = attend) or additive float, broadcastable to
    [B, Hq, Sq, Sk]."""
    b, hq, sq, d = q.shape
    sk = k.shape[2]
    scale = d**-0.5 if scale is None else float(scale)
    q_pos = torch.arange(sk - sq, sk, device=q.device)
    k_pos = torch.arange(sk, device=q.device)
    mask = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = torch.zeros(attn_mask.shape, dtype=torch.float64, device=q.device)
            mask = mask.masked_fill(~attn_mask, float("-inf"))
        else:
            mask = attn_mask.to(torch.float64)
        mask = mask.expand(b, hq, sq, sk)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for i in range(b):
        extra = None if mask is None else mask[i]
        out[i] = _attend(
            q[i].to(torch.float64),
            k[i].to(torch.float64),
            v[i].to(torch.float64),
            q_pos,
            k_pos,
            scale,
            causal,
            sliding_window,
            extra,
        )
    return out.to(q.dtype)


__all__ = [
    "kv_append_ref",
    "paged_decode_ref",
    "paged_prefill_ref",
    "dense_attention_ref",
    "fp8_codes_to_float",
    "FP8_HEADROOM",
]
