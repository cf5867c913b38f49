"""Configuration: one dataclass per concern, validated where it is built.

Precedence, highest first: keyword overrides (``enable(**overrides)`` / ``load_config``), the
``OXYGEN_CONF`` environment variable (``key:value,key:value``, the shape of
``PYTORCH_CUDA_ALLOC_CONF``; keys may be dotted, ``pool.hot_zone_ratio:0.5``), the YAML file named
by ``OXYGEN_CONFIG_FILE``, then the documented defaults. Every field is checked: a bad value raises
``ValueError`` naming the field, the value and what is allowed. Unknown keys are errors. The YAML is
read with ``yaml.safe_load``; nothing is evaluated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from .triton_kernels.precision import PrecisionMode

log = logging.getLogger("oxygen_torch")

MiB = 1 << 20
# 2 MiB: the VMM allocation granularity the driver reports on H100/H200 (and every NVIDIA GPU with
# VMM support so far). The native pool re-checks page_size against the live device at creation.
DEVICE_GRANULARITY = 2 * MiB

ENV_CONF = "OXYGEN_CONF"
ENV_FILE = "OXYGEN_CONFIG_FILE"


def _check_ratio(section: str, name: str, value: float) -> None:
    if not (0.0 < value <= 1.0) or math.isnan(value):
        raise ValueError(f"{section}.{name}: {value!r} is out of range; allowed: (0, 1]")


def _check_choice(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(
            f"{section}.{name}: {value!r} is not allowed; allowed: {', '.join(allowed)}"
        )


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_types(obj: Any, section: str) -> None:
    """Direct construction (PoolConfig(page_size="2MiB")) gets the same clear error as parsing."""
    for name, hint in typing.get_type_hints(type(obj)).items():
        value = getattr(obj, name)
        allowed = tuple(t for t in (typing.get_args(hint) or (hint,)))
        if float in allowed and isinstance(value, int) and not isinstance(value, bool):
            continue
        if isinstance(value, bool) and bool not in allowed:
            ok = False
        else:
            ok = isinstance(value, allowed)
        if not ok:
            names = " or ".join("none" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{section}.{name}: {value!r} has the wrong type; allowed: {names}")


@dataclass(frozen=True)
class PoolConfig:
    """The VMM pool (csrc/page_pool)."""

    page_size: int = 2 * MiB
    hot_zone_ratio: float = 0.6  # share of the GPU budget kept as hot zone (seed design)
    migration_threshold: float = 0.8  # GPU use above which cold blocks move to the CPU tier
    reserve_fraction: float = 0.9  # share of device memory reserved as one virtual range
    cpu_tier_bytes: int = 0  # pinned host bytes for the CPU tier; 0 = no CPU tier
    backend: str = "auto"  # auto: cuda when a driver and device exist, else host
    # How long a page with nothing live stays mapped before it is unmapped (global pool). 20 ms
    # spans a decode step, so the step's transients (logits, sampling buffers) find their pages
    # still mapped: the H200 generate() trace replayed at its real pace maps 38 pages a step at
    # 20 ms against 70 at 2 ms, with the same fragmentation and nothing held 100 ms after
    # (benchmarks/replay_hysteresis.py); a map + unmap costs ~96 us on the H200.
    hysteresis_ms: float = 20.0

    def __post_init__(self):
        _check_types(self, "pool")
        if not 0.01 <= self.hysteresis_ms <= 60000:
            raise ValueError(
                f"pool.hysteresis_ms: {self.hysteresis_ms!r} is out of range; allowed: 0.01 to "
                "60000 (milliseconds)"
            )
        if self.page_size <= 0 or self.page_size % DEVICE_GRANULARITY:
            raise ValueError(
                f"pool.page_size: {self.page_size!r} is not a positive multiple of the device "
                f"granularity ({DEVICE_GRANULARITY} bytes = 2 MiB)"
            )
        _check_ratio("pool", "hot_zone_ratio", self.hot_zone_ratio)
        _check_ratio("pool", "migration_threshold", self.migration_threshold)
        _check_ratio("pool", "reserve_fraction", self.reserve_fraction)
        if self.cpu_tier_bytes < 0:
            raise ValueError(
                f"pool.cpu_tier_bytes: {self.cpu_tier_bytes!r} is negative; allowed: ≥ 0"
            )
        _check_choice("pool", "backend", self.backend, ("auto", "cuda", "host"))


@dataclass(frozen=True)
class KVConfig:
    """The paged KV cache (oxygen_torch/kv)."""

    block_tokens: int = 16  # tokens per KV block; a power of two in [16, 256] (kernel tiles)
    kv_dtype: str = "auto"  # auto: the model's dtype
    prefetch_distance: int = 4  # blocks fetched back from the CPU tier ahead of use
    arena_bytes: int = 0  # virtual size of the KV arena; 0 = sized from device memory
    debug_checks: bool = False  # check block ids against mapped pages before every launch
    # generate() on the paged cache runs a prompt of batch x length > this many tokens in chunks
    # along the sequence (transformers' prefill_chunk_size), so prefill activations stay at this
    # size instead of growing with the prompt; 0 = never chunk
    prefill_chunk_tokens: int = 16384
    # generate() on the paged cache (CUDA) replays its one-token decode steps from CUDA graphs
    decode_graphs: bool = True
    # ... captured from compiled code (fused kernels) rather than the eager forward
    decode_graph_fusion: bool = True
    # ... the whole forward compiled by backend "oxygen" (False: RMSNorm / MLP / rotary only)
    decode_graph_compile: bool = True

    def __post_init__(self):
        _check_types(self, "kv")
        if not (_is_pow2(self.block_tokens) and 16 <= self.block_tokens <= 256):
            raise ValueError(
                f"kv.block_tokens: {self.block_tokens!r} is not allowed; "
                "allowed: a power of two from 16 to 256"
            )
        _check_choice("kv", "kv_dtype", self.kv_dtype, ("auto", "fp16", "bf16", "fp8_e4m3"))
        if not 0 <= self.prefetch_distance <= 1024:
            raise ValueError(
                f"kv.prefetch_distance: {self.prefetch_distance!r} is out of range; "
                "allowed: 0 to 1024"
            )
        if self.arena_bytes < 0:
            raise ValueError(f"kv.arena_bytes: {self.arena_bytes!r} is negative; allowed: ≥ 0")
        if self.prefill_chunk_tokens < 0:
            raise ValueError(
                f"kv.prefill_chunk_tokens: {self.prefill_chunk_tokens!r} is negative; "
                "allowed: 0 (never chunk) or a token count"
            )


@dataclass(frozen=True)
class KernelConfig:
    """Attention kernels (triton_kernels)."""

    precision: PrecisionMode = PrecisionMode.AUTO_MIXED
    attention_type: str = "dense"
    block_m: int | None = None  # tile overrides; powers of two (Triton block sides)
    block_n: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "precision", PrecisionMode.parse(self.precision))
        _check_types(self, "kernel")
        _check_choice("kernel", "attention_type", self.attention_type, ("dense", "moe", "sliding"))
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v is not None and not (_is_pow2(v) and 16 <= v <= 256):
                raise ValueError(
                    f"kernel.{name}: {v!r} is not allowed; allowed: a power of two from 16 to "
                    "256 (Triton block sides), or none"
                )


@dataclass(frozen=True)
class SchedulerConfig:
    """The multi-task engine (oxygen_torch/engine): concurrent generate() calls on one model
    merged step by step. Weights of W_i = alpha * QoS_i / Latency_i + beta * Tokens_i /
    CacheSize_i (policy "wfq")."""

    alpha: float = 0.7
    beta: float = 0.3
    merge: bool = True  # merge concurrent generate() calls' forwards on the paged cache
    policy: str = "wfq"  # wfq (weighted fair queuing, the seed's weights) or fcfs
    # tokens one merged step computes at most (decode tokens + prefill chunks); a longer
    # prefill is cut into chunks that fit beside the others' decode tokens
    max_step_tokens: int = 8192
    max_step_seqs: int = 256  # sequences one merged step serves at most
    # how long a step waits for a call that has not submitted yet before it goes without it
    gather_ms: float = 5.0

    def __post_init__(self):
        _check_types(self, "scheduler")
        for name in ("alpha", "beta"):
            v = getattr(self, name)
            if not (0.0 <= v <= 1.0) or math.isnan(v):
                raise ValueError(f"scheduler.{name}: {v!r} is out of range; allowed: [0, 1]")
        _check_choice("scheduler", "policy", self.policy, ("wfq", "fcfs"))
        for name, top in (("max_step_tokens", 1 << 20), ("max_step_seqs", 1 << 16)):
            v = getattr(self, name)
            if not 1 <= v <= top:
                raise ValueError(f"scheduler.{name}: {v!r} is out of range; allowed: 1 to {top}")
        if not 0.01 <= self.gather_ms <= 10000 or math.isnan(self.gather_ms):
            raise ValueError(
                f"scheduler.gather_ms: {self.gather_ms!r} is out of range; allowed: 0.01 to "
                "10000 (milliseconds)"
            )


SECTIONS: dict[str, type] = {
    "pool": PoolConfig,
    "kv": KVConfig,
    "kernel": KernelConfig,
    "scheduler": SchedulerConfig,
}


@dataclass(frozen=True)
class OxygenConfig:
    pool: PoolConfig = field(default_factory=PoolConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # dotted key -> where its non-default value came from ("enable()", "OXYGEN_CONF", "file:...")
    sources: dict[str, str] = field(default_factory=dict, compare=False)
    # model profiles given in the YAML file's `optimizations:` block, merged over the built-ins
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """Flat {dotted key: value} of every field."""
        out = {}
        for sec in SECTIONS:
            for f in dataclasses.fields(getattr(self, sec)):
                out[f"{sec}.{f.name}"] = getattr(getattr(self, sec), f.name)
        return out

    def diff(self, other: OxygenConfig) -> dict[str, tuple[Any, Any]]:
        """{dotted key: (self value, other value)} for every field that differs."""
        a, b = self.as_dict(), other.as_dict()
        return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


# --- parsing -------------------------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _field_types(section: str) -> dict[str, Any]:
    return typing.get_type_hints(SECTIONS[section])


def _resolve_key(key: str) -> tuple[str, str]:
    """'pool.hot_zone_ratio' or a bare unique field name -> (section, field)."""
    key = key.strip()
    if "." in key:
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ValueError(
                f"unknown configuration section {section!r} in key {key!r}; "
                f"allowed sections: {', '.join(SECTIONS)}"
            )
        if name not in _field_types(section):
            raise ValueError(
                f"unknown configuration key {key!r}; allowed in {section}: "
                f"{', '.join(_field_types(section))}"
            )
        return section, name
    owners = [s for s in SECTIONS if key in _field_types(s)]
    if len(owners) == 1:
        return owners[0], key
    if not owners:
        allowed = ", ".join(f"{s}.{n}" for s in SECTIONS for n in _field_types(s))
        raise ValueError(f"unknown configuration key {key!r}; allowed: {allowed}")
    raise ValueError(
        f"configuration key {key!r} is ambiguous; write one of "
        f"{', '.join(f'{s}.{key}' for s in owners)}"
    )


def _convert(section: str, name: str, value: Any) -> Any:
    """Turns a value (str from the environment, or a YAML/python value) into the field's type."""
    hint = _field_types(section)[name]
    where = f"{section}.{name}"
    optional = type(None) in typing.get_args(hint)
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)
    if optional and (
        value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))
    ):
        return None
    if base is PrecisionMode:
        return PrecisionMode.parse(value)
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{where}: {value!r} is not a boolean; allowed: true/false")
    if base is int:
        if isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} is not an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            m = _SIZE.match(value)
            if m:
                unit = (m.group(2) or "")[:1].lower()
                return int(m.group(1)) * _SIZE_UNITS.get(unit, 1)
        raise ValueError(f"{where}: {value!r} is not an integer (sizes may use KiB/MiB/GiB)")
    if base is float:
        if isinstance(value, bool):
            raise ValueError(f"{where}: {value!r} is not a number")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {value!r} is not a number") from None
    if base is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: {value!r} is not a string")
        return value.strip().lower()
    raise TypeError(f"{where}: no converter for {hint}")  # a programming error, not user input


def parse_conf_string(text: str) -> dict[str, Any]:
    """'pool.hot_zone_ratio:0.5,block_tokens:32' -> {'pool.hot_zone_ratio': 0.5, ...}, typed."""
    out: dict[str, Any] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        if ":" not in item:
            raise ValueError(f"{ENV_CONF}: entry {item.strip()!r} is not of the form key:value")
        key, value = item.split(":", 1)
        section, name = _resolve_key(key)
        dotted = f"{section}.{name}"
        if dotted in out:
            raise ValueError(f"{ENV_CONF}: key {dotted!r} is given twice")
        out[dotted] = _convert(section, name, value)
    return out


def _flatten_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """enable(pool={...}, block_tokens=32, kernel=KernelConfig(...)) -> {dotted key: value}."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        if key in SECTIONS and (isinstance(value, dict) or dataclasses.is_dataclass(value)):
            items = (
                value.items()
                if isinstance(value, dict)
                else ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
            )
            for name, v in items:
                section, name = _resolve_key(f"{key}.{name}")
                out[f"{section}.{name}"] = _convert(section, name, v)
        else:
            section, name = _resolve_key(key.replace("__", "."))
            out[f"{section}.{name}"] = _convert(section, name, value)
    return out


def _read_file(path: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """YAML file -> ({dotted key: value}, {model_type: profile dict})."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ValueError(f"{ENV_FILE}: cannot read {path!r}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{ENV_FILE}: {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{ENV_FILE}: {path!r} must hold a mapping at the top level")
    profiles = data.pop("optimizations", None) or {}
    if not isinstance(profiles, dict):
        raise ValueError(f"{ENV_FILE}: 'optimizations' must map model types to profiles")
    values = _flatten_overrides(data)
    from .profiles import validate_profile

    for model_type, prof in profiles.items():
        validate_profile(str(model_type), prof)
    return values, {str(k): dict(v) for k, v in profiles.items()}


def load_config(**overrides: Any) -> OxygenConfig:
    """The effective configuration: overrides > OXYGEN_CONF > OXYGEN_CONFIG_FILE > defaults."""
    layers: list[tuple[str, dict[str, Any]]] = []
    profiles: dict[str, dict[str, Any]] = {}
    path = os.environ.get(ENV_FILE)
    if path:
        file_values, profiles = _read_file(path)
        layers.append((f"file:{path}", file_values))
    env = os.environ.get(ENV_CONF)
    if env:
        layers.append((ENV_CONF, parse_conf_string(env)))
    if overrides:
        layers.append(("enable()", _flatten_overrides(overrides)))

    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, values in layers:
        for key, value in values.items():
            merged[key] = value
            sources[key] = source
    sections = {}
    for sec, cls in SECTIONS.items():
        kwargs = {k.split(".", 1)[1]: v for k, v in merged.items() if k.startswith(sec + ".")}
        sections[sec] = cls(**kwargs)
    return OxygenConfig(**sections, sources=sources, profiles=profiles)
