"""torch.library custom ops of oxygen_torch, what compiled graphs call. The paged ops wrap the
launchers that the HF integration's eager path calls directly (oxygen_torch.attention: an op
dispatch per layer would only add host time there), and the compiled decode step's
oxygen::paged_step runs that same eager code, so every path runs the same kernels.

- ``oxygen::attention(q, k, v, attn_mask, is_causal, scale, precision, block_m, block_n)``:
  dense attention on [B, H, S, D] with torch SDPA's semantics (top-left causal, bool or additive
  mask, GQA when Hq is a multiple of Hkv). precision / block_m / block_n are ints in the schema so
  a compiled graph fixes them at compile time (0 = choose from the shapes).
  CUDA: a ``triton_op``: under torch.compile AOTAutograd decomposes it into the Triton kernel
  (``wrap_triton``), which Inductor then sees and schedules like its own kernels.
  CPU: ``oxygen::attention_ref``, the float64 reference as an opaque op (a triton_op's body is
  traced for every device, so the CPU branch must be an op of its own).
- ``oxygen::paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, k_scale,
  v_scale, scale, sliding_window, precision)``: decode (cu_seqlens_q None, q [B, Hq, D]) or ragged
  prefill (q [T, Hq, D]) over block tables.
- ``oxygen::kv_append(k, v, k_cache!, v_cache!, slot_mapping, k_scale!, v_scale!)``: in place.
- ``oxygen::paged_step(q, k, v, layer, scale, sliding_window)``: one layer of a decode step of
  the PagedKVCache whose decode-graph step runs on this thread (generate()'s decode graphs
  compile the model's forward with it). The cache is the op's state, not an argument, as in
  vLLM's attention ops: a compiled graph holds no cache tensor and no guard on the cache's
  host state, and the block table, lengths and slots it reads are the decode graph's buffers.

The paged ops are ``custom_op`` (opaque to Inductor), not triton_op: their launchers (owned by
triton_kernels) validate inputs, pick tiles and split counts from concrete shapes per call
(memoised per shape bucket) and allocate split scratch; traced under symbolic shapes they would
have to be duplicated here. Opaque ops cost one Python dispatch per call, which CUDA graphs
(mode="reduce-overhead") remove. Neither op synchronises with the host, so a decode step over
the paged cache is capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_kernels import reference as _ref
from .triton_kernels.dense_attention import dense_attention
from .triton_kernels.precision import PrecisionMode

# --- oxygen::attention ---------------------------------------------------------------------------


@torch.library.custom_op("oxygen::attention_ref", mutates_args=())
def attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """float64 reference with SDPA semantics; the CPU path of oxygen::attention."""
    sq, sk = q.shape[2], k.shape[2]
    causal = is_causal
    if is_causal and sq != sk:
        # the reference aligns causality bottom-right; SDPA's is_causal is top-left
        attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        causal = False
    out = _ref.dense_attention_ref(q, k, v, causal=causal, scale=scale, attn_mask=attn_mask)
    return torch.empty_like(q).copy_(out)  # q's layout, as the fake kernel promises


@attention_ref.register_fake
def _attention_ref_fake(q, k, v, attn_mask=None, is_causal=False, scale=None):
    return torch.empty_like(q)


@torch.library.triton_op("oxygen::attention", mutates_args=())
def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    precision: int = int(PrecisionMode.AUTO_MIXED),
    block_m: int = 0,
    block_n: int = 0,
) -> Tensor:
    """q: [B, Hq, Sq, D], k/v: [B, Hkv, Sk, D] -> [B, Hq, Sq, D] (SDPA semantics, no dropout)."""
    if q.device.type != "cuda":
        return torch.ops.oxygen.attention_ref(q, k, v, attn_mask, is_causal, scale)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return dense_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        causal=is_causal,
        scale=scale,
        precision=precision,
        block_m=block_m or None,
        block_n=block_n or None,
        use_wrap_triton=True,
    )


# --- oxygen::paged_attention ---------------------------------------------------------------------


@torch.library.custom_op("oxygen::paged_attention", mutates_args=())
def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    seq_lens: Tensor,
    cu_seqlens_q: Tensor | None = None,
    k_scale: Tensor | None = None,
    v_scale: Tensor | None = None,
    scale: float | None = None,
    sliding_window: int = 0,
    precision: int = int(PrecisionMode.AUTO_MIXED),
) -> Tensor:
    """Decode (cu_seqlens_q None; q: [B, Hq, D]) or ragged causal prefill (q: [T, Hq, D]) over
    k_cache/v_cache [num_blocks, block_tokens, Hkv, D], block_table [B, max_blocks] int32,
    seq_lens [B] int32. sliding_window 0 = none. Returns q's shape and dtype."""
    window = sliding_window or None
    common = dict(scale=scale, sliding_window=window, k_scale=k_scale, v_scale=v_scale)
    if q.device.type == "cuda":
        from .triton_kernels.paged_decode import paged_decode
        from .triton_kernels.paged_prefill import paged_prefill

        if cu_seqlens_q is None:
            return paged_decode(
                q, k_cache, v_cache, block_table, seq_lens, precision=precision, **common
            )
        return paged_prefill(
            q,
            k_cache,
            v_cache,
            block_table,
            cu_seqlens_q,
            seq_lens,
            causal=True,
            precision=precision,
            **common,
        )
    if cu_seqlens_q is None:
        out = _ref.paged_decode_ref(q, k_cache, v_cache, block_table, seq_lens, **common)
    else:
        out = _ref.paged_prefill_ref(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens, causal=True, **common
        )
    return torch.empty_like(q).copy_(out)  # q's layout, like the kernels and the fake


@paged_attention.register_fake
def _paged_attention_fake(
    q,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    cu_seqlens_q=None,
    k_scale=None,
    v_scale=None,
    scale=None,
    sliding_window=0,
    precision=int(PrecisionMode.AUTO_MIXED),
):
    return torch.empty_like(q)


# --- oxygen::kv_append ---------------------------------------------------------------------------


@torch.library.custom_op(
    "oxygen::kv_append", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale")
)
def _kv_append_op(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> None:
    """k, v: [T, Hkv, D] -> k_cache/v_cache slots slot_mapping [T] (negative = skip), in place;
    fp8 caches also update k_scale/v_scale [num_blocks, Hkv]."""
    if k.device.type == "cuda":
        from .triton_kernels.kv_append import kv_append as _kv_append

        _kv_append(k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    else:
        _ref.kv_append_ref(
            k, v, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale, inplace=True
        )


@_kv_append_op.register_fake
def _kv_append_fake(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    return None


# --- oxygen::paged_step --------------------------------------------------------------------------


@torch.library.custom_op("oxygen::paged_step", mutates_args=())
def paged_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer: int,
    scale: float | None = None,
    sliding_window: int = 0,
) -> Tensor:
    """q: [B, Hq, 1, D], k/v: [B, Hkv, 1, D] -> [B, 1, Hq, D]: stores k/v at this step's slots
    of the running decode-graph step's cache (kv.paged_cache.lent_core) and attends over it.
    sliding_window 0 = none."""
    from .kv.paged_cache import lent_core

    core = lent_core()
    return core.step(layer, q, k, v, scale=scale, sliding_window=sliding_window or None)


@paged_step.register_fake
def _paged_step_fake(q, k, v, layer, scale=None, sliding_window=0):
    return q.new_empty(q.shape[0], 1, q.shape[1], q.shape[3])


class _DefaultsFilled:
    """Calls the op with every argument given. torch 2.11's ADInplaceOrView kernel for custom ops
    indexes mutated arguments by position, and the dispatcher drops trailing arguments equal to
    their defaults, so optional k_scale/v_scale raised IndexError on the H200: the schema has no
    defaults, and this wrapper supplies them."""

    def __init__(self, op):
        self._op = op

    def __call__(self, k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
        return self._op(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def __getattr__(self, name):
        return getattr(self._op, name)


kv_append = _DefaultsFilled(_kv_append_op)

__all__ = ["attention", "attention_ref", "paged_attention", "paged_step", "kv_append"]
