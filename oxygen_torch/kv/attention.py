"""The one device dispatch of the paged-attention primitives: every path (the paged core's eager
steps, oxygen::paged_step in decode graphs) writes and attends through these functions.

CUDA: the Triton kernels. CPU: kv_append's reference, and attention as one batched SDPA over K/V
gathered through the block table, with the kernels' semantics (causal, last tokens are the new
ones, window (p - W, p]). The float64 references of triton_kernels.reference loop per sequence,
which makes generate() on CPU about ten times slower; they remain the kernels' test oracle.

`tiles_for(kernel, profile)` turns kernel.block_m / block_n / attention_type and a model
profile's block_size into the `Tiles` that paged_attention hands to the CUDA kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..triton_kernels.precision import PrecisionMode
from ..triton_kernels.tiling import Tiles
from .storage import GUARD_BLOCK

if TYPE_CHECKING:
    from ..config import KernelConfig
    from ..config.profiles import ModelProfile

__all__ = ["Tiles", "gather_blocks", "kv_write", "paged_attention", "tiles_for"]


def tiles_for(kernel: KernelConfig, profile: ModelProfile | None = None) -> Tiles:
    """The paged kernels' tiles for a model: each side from kernel.block_m / block_n when set,
    else from the model profile's block_size (already rounded to a power of two), else None
    (the tiling rule chooses); attention_type from kernel.attention_type; balance (decode's
    balanced mode) from kernel.decode_balance."""

    def side(name: str) -> int | None:
        given = getattr(kernel, name)
        if given is not None or profile is None:
            return given
        return getattr(profile, name)

    return Tiles(side("block_m"), side("block_n"), kernel.attention_type, kernel.decode_balance)


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, kv_heads, D] -> cache slots slot_mapping[T] (negative = skip), in place; fp8
    caches also set their (block, head) scales."""
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    if k.device.type == "cuda":
        from ..triton_kernels.kv_append import kv_append

        kv_append(k, v, k_cache, v_cache, slot_mapping, **scales)
    else:
        from ..triton_kernels.reference import kv_append_ref

        kv_append_ref(k, v, k_cache, v_cache, slot_mapping, inplace=True, **scales)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    precision: PrecisionMode = PrecisionMode.AUTO_MIXED,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Decode (cu_seqlens_q None; q: [B, Hq, D]) or ragged prefill (q: [T, Hq, D]) over the
    paged cache (fp8 caches with their k_scale / v_scale). Returns q's shape and dtype.
    tiles (None: the tiling rule alone) steers the CUDA kernels' launch (decode: the key tile;
    prefill: query and key tiles); the CPU path computes the same attention without tiles."""
    if tiles is not None and not isinstance(tiles, Tiles):
        raise ValueError(f"tiles: expected a Tiles (see tiles_for), got {type(tiles).__name__}")
    kw = dict(scale=scale, sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale)
    if q.device.type != "cuda":
        return _gathered_sdpa(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, **kw)
    kw.update(precision=precision, tiles=tiles)
    if cu_seqlens_q is None:
        from ..triton_kernels.paged_decode import paged_decode

        return paged_decode(q, k_cache, v_cache, block_table, seq_lens, **kw)
    from ..triton_kernels.paged_prefill import paged_prefill

    return paged_prefill(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, **kw)


def gather_blocks(cache, scale, idx, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first n tokens of each row's blocks idx [B, nblk] of cache [num_blocks, bt, Hkv, D]
    -> [B, Hkv, n, D] in dtype (fp8 codes times their (block, head) scale)."""
    x = cache[idx]  # [B, nblk, bt, Hkv, D]
    if scale is not None:
        x = (x.to(torch.float32) * scale[idx][:, :, None, :, None]).to(dtype)
    return x.flatten(1, 2)[:, :n].transpose(1, 2)


def _gathered_sdpa(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    cu_seqlens_q,
    *,
    scale,
    sliding_window,
    k_scale=None,
    v_scale=None,
):
    """CPU paged attention: gather each sequence's K/V through its table row (fp8 codes times
    their block scales), then one SDPA."""
    batch, bt = seq_lens.shape[0], k_cache.shape[1]
    lens = seq_lens.to(torch.int64)
    n_k = max(int(lens.max()), 1) if batch else 1
    idx = block_table[:, : -(-n_k // bt)].to(torch.int64)  # [B, nblk]
    if cu_seqlens_q is None:
        counts = torch.ones(batch, dtype=torch.int64)
    else:
        counts = cu_seqlens_q.to(torch.int64).diff()
    if sliding_window:
        # as the kernels: no block before a row's first window is read (a hybrid model's
        # narrowed blocks have no sliding-layer pages: kv/window.py); the guard block stands in
        first = (lens - counts - sliding_window + 1).clamp(min=0) // bt  # [B]
        idx = idx.masked_fill(torch.arange(idx.shape[1])[None, :] < first[:, None], GUARD_BLOCK)
    k = gather_blocks(k_cache, k_scale, idx, n_k, q.dtype)
    v = gather_blocks(v_cache, v_scale, idx, n_k, q.dtype)
    m = max(int(counts.max()), 1) if batch else 1
    j = torch.arange(m)
    rows = j[None, :] < counts[:, None]  # [B, m]: the real query slots of a padded layout
    qp = q.new_zeros(batch, m, q.shape[1], q.shape[2])
    qp[rows] = q
    q_pos = (lens - counts)[:, None] + j[None, :]  # [B, m]
    k_pos = torch.arange(n_k)[None, None, :]
    allowed = (k_pos <= q_pos[:, :, None]) & (k_pos < lens[:, None, None])  # [B, m, n_k]
    if sliding_window:
        allowed &= k_pos > q_pos[:, :, None] - sliding_window
    empty = ~allowed.any(-1, keepdim=True)  # padding slots or empty sequences: nothing to see
    allowed |= empty & (k_pos == 0)  # keeps SDPA's softmax finite; zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(
        qp.transpose(1, 2), k, v, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
    ).transpose(1, 2)  # [B, m, Hq, D]
    return out.masked_fill(empty[..., None], 0.0)[rows]
