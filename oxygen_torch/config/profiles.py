"""Model profiles: per-model-family tuning as plain data, looked up by ``config.model_type``.

The built-in ``llama`` profile is the original design's (prefetch_distance 4, retention priority =
layer depth × 0.8) without its block_size [96, 96]: those tiles (rounded to 64 x 64) ran the H200's
Llama-1.1B generate() at 8,137 tok/s against 8,408 for the adaptive tiles (B=16 P=512 N=256, one
device call, docs/h200-notes.md), so the tiling rule keeps choosing. A YAML config file may add or
override profiles under ``optimizations:`` (a block_size there is applied to the paged kernels).
Values a kernel cannot use are rounded, with one logged warning.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from .fields import describe

log = logging.getLogger("oxygen_torch")

BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "llama": {"prefetch_distance": 4, "retention_priority_factor": 0.8},
}

PROFILE_KEYS = ("block_size", "prefetch_distance", "retention_priority_factor")

_warned: set[tuple[str, int]] = set()


@dataclass(frozen=True)
class ModelProfile:
    model_type: str
    block_m: int | None = None
    block_n: int | None = None
    prefetch_distance: int | None = None
    retention_priority_factor: float = 0.8

    def retention_priority(self, layer_depth: int) -> float:
        """Priority for keeping a layer's blocks on the GPU: deeper layers are kept longer."""
        return layer_depth * self.retention_priority_factor


def nearest_pow2(n: int) -> int:
    """Nearest power of two; ties go down (smaller tiles keep register pressure lower)."""
    lo = 1 << (n.bit_length() - 1)
    hi = lo << 1
    return lo if n - lo <= hi - n else hi


def _kernel_side(model_type: str, value: int, given: bool = True) -> int:
    """A tile side Triton can use: a power of two in [16, 256]. `given`: the value came from the
    user's file (the built-in profile's 96 is the seed's, rounded without a word each run)."""
    side = min(256, max(16, nearest_pow2(value)))
    if given and side != value and (model_type, value) not in _warned:
        _warned.add((model_type, value))
        log.warning(
            "oxygen_torch: profile %r asks for tile side %d, but Triton block sides must be powers "
            "of two in [16, 256]; using %d",
            model_type,
            value,
            side,
        )
    return side


def validate_profile(model_type: str, prof: Any) -> None:
    where = f"optimizations.{model_type}"
    if not isinstance(prof, dict):
        raise ValueError(f"{where}: must be a mapping of {', '.join(PROFILE_KEYS)}")
    for key in prof:
        if key not in PROFILE_KEYS:
            raise ValueError(
                f"{where}: unknown key {describe(key)}; allowed: {', '.join(PROFILE_KEYS)}"
            )
    bs = prof.get("block_size")
    if bs is not None and not (
        isinstance(bs, (list, tuple))
        and len(bs) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 4096 for v in bs)
    ):
        raise ValueError(f"{where}.block_size: {describe(bs)} must be two integers in [1, 4096]")
    pd = prof.get("prefetch_distance")
    if pd is not None and not (
        isinstance(pd, int) and not isinstance(pd, bool) and 0 <= pd <= 1024
    ):
        raise ValueError(
            f"{where}.prefetch_distance: {describe(pd)} is out of range; allowed: 0 to 1024"
        )
    rp = prof.get("retention_priority_factor")
    if rp is not None and not (
        isinstance(rp, (int, float)) and not isinstance(rp, bool) and 0 <= rp < math.inf
    ):
        raise ValueError(
            f"{where}.retention_priority_factor: {describe(rp)} must be a finite number ≥ 0"
        )


def get_profile(model_type: str, extra: dict[str, dict[str, Any]] | None = None) -> ModelProfile:
    """The profile for a model family (file-given profiles over built-ins); empty if none."""
    prof = {**BUILTIN_PROFILES.get(model_type, {}), **(extra or {}).get(model_type, {})}
    validate_profile(model_type, prof)
    bm = bn = None
    if prof.get("block_size") is not None:
        given = "block_size" in (extra or {}).get(model_type, {})
        bm, bn = (_kernel_side(model_type, v, given) for v in prof["block_size"])
    return ModelProfile(
        model_type=model_type,
        block_m=bm,
        block_n=bn,
        prefetch_distance=prof.get("prefetch_distance"),
        retention_priority_factor=float(prof.get("retention_priority_factor", 0.8)),
    )
