"""Device dispatch of the paged-attention primitives: Triton kernels on CUDA, float64 references
on CPU. The HF integration calls only these two functions, so the custom ops of ops.py can take
their place in one spot.
"""

from __future__ import annotations

import torch

from .triton_kernels.precision import PrecisionMode


def kv_write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, kv_heads, D] -> cache slots slot_mapping[T] (negative = skip), in place."""
    if k.device.type == "cuda":
        from .triton_kernels.kv_append import kv_append

        kv_append(k, v, k_cache, v_cache, slot_mapping)
    else:
        from .triton_kernels.reference import kv_append_ref

        kv_append_ref(k, v, k_cache, v_cache, slot_mapping, inplace=True)


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
) -> torch.Tensor:
    """Decode (cu_seqlens_q None; q: [B, Hq, D]) or ragged prefill (q: [T, Hq, D]) over the
    paged cache. Returns q's shape and dtype."""
    cuda = q.device.type == "cuda"
    if cu_seqlens_q is None:
        if cuda:
            from .triton_kernels.paged_decode import paged_decode

            return paged_decode(
                q,
                k_cache,
                v_cache,
                block_table,
                seq_lens,
                scale=scale,
                sliding_window=sliding_window,
                precision=precision,
            )
        from .triton_kernels.reference import paged_decode_ref

        return paged_decode_ref(
            q, k_cache, v_cache, block_table, seq_lens, scale=scale, sliding_window=sliding_window
        )
    if cuda:
        from .triton_kernels.paged_prefill import paged_prefill

        return paged_prefill(
            q,
            k_cache,
            v_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            causal=True,
            scale=scale,
            sliding_window=sliding_window,
            precision=precision,
        )
    from .triton_kernels.reference import paged_prefill_ref

    return paged_prefill_ref(
        q,
        k_cache,
        v_cache,
        block_table,
        cu_seqlens_q,
        seq_lens,
        causal=True,
        scale=scale,
        sliding_window=sliding_window,
    )
