"""Options of the ``oxygen`` torch.compile backend, validated like the rest of the configuration:
a bad value raises ValueError naming the option, the value and what is allowed.

``torch.compile(model, backend="oxygen", options={...})`` or ``mode="reduce-overhead"``
(torch.compile refuses both at once, so ``mode`` may also be given inside options).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import KernelConfig, KVConfig
from ..triton_kernels.precision import PrecisionMode

MODES = ("default", "reduce-overhead")
FALLBACKS = ("warn", "error")
DEFAULTS: dict[str, Any] = {
    "precision": "auto_mixed",
    "attention_type": "dense",
    "block_m": None,
    "block_n": None,
    "kv_dtype": "auto",
    "fallback": "warn",
    "inductor": None,
    "mode": "default",
}


def _option_error(name: str, err: Exception) -> ValueError:
    # KernelConfig/KVConfig name their field as "kernel.block_m: ..."; say which option it was
    msg = str(err).split(": ", 1)[-1]
    return ValueError(f"oxygen backend option {name!r}: {msg}")


def _check_inductor(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(
            f"oxygen backend option 'inductor': {value!r} is not allowed; allowed: a dict of "
            "torch._inductor.config names (e.g. {'max_autotune': True}) to values"
        )
    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    unknown = sorted(k for k in value if k not in known)
    if unknown:
        raise ValueError(
            f"oxygen backend option 'inductor': unknown Inductor config {', '.join(unknown)}; "
            "allowed: names in torch._inductor.config (dotted for sub-configs, "
            "e.g. 'triton.cudagraphs')"
        )
    return dict(value)


@dataclass(frozen=True)
class CompileOptions:
    precision: PrecisionMode = PrecisionMode.AUTO_MIXED
    attention_type: str = "dense"
    block_m: int | None = None
    block_n: int | None = None
    # the PagedKVCache of a generate() whose compile_config names backend "oxygen" with it (the
    # HF integration); a graph compiled by itself holds no KV cache and does not read it
    kv_dtype: str = "auto"
    fallback: str = "warn"  # attention left as is: warn, or raise (error)
    inductor: dict[str, Any] = field(default_factory=dict)  # config_patches for compile_fx
    mode: str = "default"

    @classmethod
    def from_user(cls, options: dict[str, Any] | None = None, mode: str | None = None):
        """Validates torch.compile's `options` dict and `mode` argument."""
        if options is None:
            options = {}
        if not isinstance(options, dict):
            raise ValueError(f"oxygen backend options: {options!r} is not a dict")
        unknown = sorted(set(options) - set(DEFAULTS))
        if unknown:
            raise ValueError(
                f"oxygen backend option {unknown[0]!r}: unknown option; allowed: "
                f"{', '.join(DEFAULTS)}"
            )
        merged = {**DEFAULTS, **options}
        if mode is not None and mode != "default":
            if "mode" in options and options["mode"] != mode:
                raise ValueError(
                    f"oxygen backend option 'mode': {options['mode']!r} in options conflicts "
                    f"with mode={mode!r}"
                )
            merged["mode"] = mode
        return cls._validated(merged)

    @classmethod
    def _validated(cls, o: dict[str, Any]):
        for name, allowed in (("mode", MODES), ("fallback", FALLBACKS)):
            if o[name] not in allowed:
                raise ValueError(
                    f"oxygen backend option {name!r}: {o[name]!r} is not allowed; allowed: "
                    f"{', '.join(allowed)}"
                )
        kernel = {k: o[k] for k in ("precision", "attention_type", "block_m", "block_n")}
        for name, value in kernel.items():
            try:
                KernelConfig(**{name: value})
            except (ValueError, TypeError) as err:
                raise _option_error(name, err) from None
        try:
            KVConfig(kv_dtype=o["kv_dtype"])
        except (ValueError, TypeError) as err:
            raise _option_error("kv_dtype", err) from None
        k = KernelConfig(**kernel)
        return cls(
            precision=k.precision,
            attention_type=k.attention_type,
            block_m=k.block_m,
            block_n=k.block_n,
            kv_dtype=o["kv_dtype"],
            fallback=o["fallback"],
            inductor=_check_inductor(o["inductor"]),
            mode=o["mode"],
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "precision": self.precision.name.lower(),
            "attention_type": self.attention_type,
            "block_m": self.block_m,
            "block_n": self.block_n,
            "kv_dtype": self.kv_dtype,
            "fallback": self.fallback,
            "inductor": dict(self.inductor),
            "mode": self.mode,
        }
