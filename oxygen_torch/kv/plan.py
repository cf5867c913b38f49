"""StepPlan: where one forward pass's new tokens go, shared by all layers of the step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepPlan:
    """Where one forward pass's new tokens go; shared by all layers."""

    q_len: int
    slot_mapping: torch.Tensor  # [B * q_len] int32 on the device; -1 = padding, not stored
    cu_seqlens_q: torch.Tensor | None  # [B + 1] int32; None = decode (one real token per row)
    q_index: torch.Tensor | None  # [T_real] int64: real rows of the flattened [B * q_len]
    # a prefill over sequences that held no token before it (kv/fresh.py: no paged read needed)
    fresh: bool = False
    real: torch.Tensor | None = None  # [B, q_len] bool on the device, fresh padded steps only
    masks: dict = field(default_factory=dict)  # the dense path's masks of this step, by window
