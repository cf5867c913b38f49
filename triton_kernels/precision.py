"""Precision modes of the attention kernels.

FP16_ONLY:  half storage and half dot products; softmax statistics (max, sum) in fp32.
AUTO_MIXED: half storage, tensor-core dots with fp32 accumulation, fp32 wherever a reduction
            needs it (the default).
FP32_SAFE:  fp32 everywhere, dots with input_precision="ieee" (no tf32).
fp8 e4m3 KV storage is a separate switch (KVConfig.kv_dtype, names in KV_DTYPES) that works
with all three.
"""

from __future__ import annotations

import enum

import torch

# kv.kv_dtype: how K/V are stored. auto = the model's dtype; fp16 / bf16 must be the model's
# dtype (no conversion); fp8_e4m3 = e4m3 codes with one fp32 scale per (block, kv head).
# The one list: config validates kv.kv_dtype against its keys, the KV cache stores the value.
KV_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
}


class PrecisionMode(enum.IntEnum):
    FP16_ONLY = 0
    AUTO_MIXED = 1
    FP32_SAFE = 2

    @classmethod
    def parse(cls, value: PrecisionMode | int | str) -> PrecisionMode:
        """Accepts a member, its int value, or its name in any case ("auto_mixed")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool):
            raise ValueError(f"precision: {value!r} is not a precision mode")
        if isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                pass
        elif isinstance(value, str):
            key = value.strip().upper()
            if key in cls.__members__:
                return cls[key]
            if key.isdigit() and int(key) in {m.value for m in cls}:
                return cls(int(key))
        allowed = ", ".join(f"{m.name.lower()} ({m.value})" for m in cls)
        raise ValueError(f"precision: {value!r} is not a precision mode; allowed: {allowed}")
