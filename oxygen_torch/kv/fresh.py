"""Fresh prefill: a prefill step of sequences that hold no cached token runs its attention on the
forward's own contiguous K/V through torch SDPA instead of reading them back through the block
table. kv_append still writes them to the blocks (the decode steps after it read them there).

Which path a call takes is decided per call (`choose`), from the cache's `kv.fresh_prefill`
setting and, for ``auto``, the first entry of `AUTO` the call matches; nothing is stored but the
counts of what ran (`stats`, shown as ``oxygen_torch.compile.stats()["prefill_attention"]``).
Only a step with no stored token for any of its sequences is fresh: a chunked prefill's later
chunks, a continued generation and an engine step with a cached prefix or a decode row in it
read the cache, so they stay paged (an engine step of fresh prompts only: kv/merged.py).

Semantics are the paged kernels' exactly: causal, window (p - W, p], padding never attended and
its rows 0. Padding is skipped in storage, so the paged kernels count window distances between
real tokens; the dense path counts columns: they agree for left padding, and a sliding layer
with padding anywhere else is refused before attention (PagedKVCache._check_left_padding).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config.fields import FRESH_PREFILL
from ..triton_kernels.precision import PrecisionMode

log = logging.getLogger("oxygen_torch")

__all__ = ["AUTO", "FRESH_PREFILL", "Rule", "choose", "dense_attention", "reset", "stats"]


@dataclass(frozen=True)
class Rule:
    """One entry of the auto table: a fresh prefill that matches every field runs dense."""

    device: str
    dtypes: tuple[torch.dtype, ...] | None  # None: any
    head_dims: tuple[int, ...] | None  # None: any
    min_tokens: int  # the step's columns (new tokens per sequence, padding included) at least
    padding: bool  # whether a step with padding (an SDPA mask instead of is_causal) matches
    window: bool  # whether a sliding-window layer (likewise a mask) matches
    precisions: tuple[PrecisionMode, ...]
    source: str  # the measurement behind the entry
    # at most this many SDPA calls a layer (an engine step of fresh prompts runs one per run of
    # rows of one length, each with its own launches: its host time grows with the lengths'
    # variety); None: any
    max_runs: int | None = None


_HALF_MODES = (PrecisionMode.FP16_ONLY, PrecisionMode.AUTO_MIXED)

AUTO: tuple[Rule, ...] = (
    # benchmarks/bench_attention.py (do_bench over CUDA-graph replays, L2 flushed, median, one
    # run each), Hq=32 Hkv=8 D=128 bf16 causal. H200: SDPA cuDNN 566 TFLOP/s against the paged
    # Triton prefill's 295 at B=4 S=4096, 567 against 302 at B=1 S=16384 (issue 17). H100,
    # 2026-12-07 (--prefix-prefill): cuDNN / flash / ours 263 / 132 / 91 at B=128 S=256, 353 /
    # 198 / 159 at B=64 S=512, 433 / 259 / 222 at B=32 S=1024, 518 / 297 / 271 at B=8 S=2048, so
    # either SDPA backend wins from 256 tokens. Only is_causal without a mask was measured,
    # only those shapes: shorter prompts, other head dims, padding and windows stay paged.
    # Every case measured was one batch of equal prompts (one SDPA call a layer): from 256
    # tokens a row that is all the rule takes; an engine step whose rows make several runs of
    # lengths (one call each) keeps the 4,096 of before (a step's host time not measured).
    Rule(
        "cuda",
        (torch.bfloat16,),
        (128,),
        256,
        padding=False,
        window=False,
        precisions=_HALF_MODES,
        source="H200 / H100: SDPA cuDNN and flash ahead of paged at 256-16384 tokens",
        max_runs=1,
    ),
    Rule(
        "cuda",
        (torch.bfloat16,),
        (128,),
        4096,
        padding=False,
        window=False,
        precisions=_HALF_MODES,
        source="H200: cuDNN 566-567 vs paged 295-302 TFLOP/s",
    ),  # fmt: skip
    # CPU: the paged path is this same SDPA over K/V gathered back from the blocks just
    # written (kv/attention.py); the dense one skips the gather. There is no kernel to choose.
    Rule(
        "cpu",
        None,
        None,
        2,
        padding=True,
        window=True,
        precisions=tuple(PrecisionMode),
        source="CPU: the paged path is SDPA after a gather",
    ),  # fmt: skip
)


def check_setting(where: str, value: str) -> str:
    if value not in FRESH_PREFILL:
        raise ValueError(
            f"{where}: fresh_prefill {value!r} is not allowed; allowed: {', '.join(FRESH_PREFILL)}"
        )
    return value


def choose(
    setting: str,
    *,
    fresh: bool,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    columns: int,
    padded: bool,
    window: int | None,
    kv_dtype: str,
    precision: PrecisionMode,
    runs: int = 1,
) -> tuple[str, str]:
    """(path, why) for one layer's prefill attention: "dense" or "paged". All host values.
    runs: the SDPA calls the dense path would make (an engine step: its runs of rows of one
    length; a generate() batch: 1)."""
    if not fresh:
        return "paged", "cached prefix"
    if setting == "paged":
        return "paged", "kv.fresh_prefill=paged"
    if setting == "dense":
        return "dense", "kv.fresh_prefill=dense"
    if kv_dtype != "auto":
        # the dense path attends the unquantised K/V; the paged one reads the e4m3 codes back,
        # as every later step does: unmeasured, so auto keeps the paged path
        return "paged", f"auto: kv_dtype {kv_dtype}"
    for r in AUTO:
        if (
            r.device == device.type
            and (r.dtypes is None or dtype in r.dtypes)
            and (r.head_dims is None or head_dim in r.head_dims)
            and columns >= r.min_tokens
            and (r.padding or not padded)
            and (r.window or not window)
            and precision in r.precisions
            and (r.max_runs is None or runs <= r.max_runs)
        ):
            return "dense", f"auto: {r.source}"
    return "paged", "auto: no measured entry"


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    real: torch.Tensor | None,
    scale: float | None,
    sliding_window: int | None,
    precision: PrecisionMode,
    masks: dict | None = None,
) -> torch.Tensor:
    """q: [B, Hq, S, D], k/v: [B, Hkv, S, D] (the step's own keys: query i sits at position i)
    -> [B, S, Hq, D]. real: device bool [B, S] (None: no padding). masks: a per-step cache of the
    built masks, keyed by window (every layer of a step shares its padding)."""
    s = q.shape[2]
    window = sliding_window if sliding_window and sliding_window < s else None
    mask = None
    if real is not None or window:
        key = window or 0
        mask = masks.get(key) if masks is not None else None
        if mask is None:
            mask = _mask(s, real, window, q.device)
            if masks is not None:
                masks[key] = mask
    dtype = q.dtype
    if precision == PrecisionMode.FP32_SAFE and dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()  # fp32 everywhere, as the mode promises
    # torch's own backend choice: sdpa_kernel() would pin cuDNN, but it sets process-wide flags
    # that other threads' attention reads. Whether torch 2.11 picks cuDNN or flash on the H200
    # by default is not measured; both took enable_gqa in bench_attention and both beat the
    # paged prefill there (flash 324-342 TFLOP/s against 293-298)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    out = out.transpose(1, 2).to(dtype)  # [B, S, Hq, D]
    if real is not None:
        out = out.masked_fill(~real[:, :, None, None], 0.0)  # padding rows are 0, as paged
    return out.contiguous()


def _mask(s: int, real: torch.Tensor | None, window: int | None, device) -> torch.Tensor:
    """Bool [B or 1, 1, S, S]: causal, the window, real keys only. A padding query row keeps its
    causal keys (so no row is empty and SDPA stays finite); its output is zeroed afterwards."""
    i = torch.arange(s, device=device)
    allowed = i[None, :] <= i[:, None]  # [S, S]: key j <= query i
    if window:
        allowed = allowed & (i[None, :] > i[:, None] - window)
    allowed = allowed[None, None]
    if real is not None:
        allowed = allowed & (real[:, None, None, :] | ~real[:, None, :, None])
    return allowed


# --- which path ran ----------------------------------------------------------------------------

_lock = threading.Lock()
_paths: Counter = Counter()
_why: Counter = Counter()


def count(path: str, why: str, layer: int) -> None:
    """One layer's prefill attention took `path` (host work only: no device sync)."""
    with _lock:
        _paths[path] += 1
        _why[why] += 1
    if layer == 0:
        log.debug("oxygen_torch: prefill attention %s (%s)", path, why)


def stats() -> dict:
    """{"dense": n, "paged": n, "why": {reason: n}}: prefill attention calls (one per layer and
    forward) on the paged cache since the last reset."""
    with _lock:
        return {"dense": _paths["dense"], "paged": _paths["paged"], "why": dict(_why)}


def reset() -> None:
    with _lock:
        _paths.clear()
        _why.clear()
