"""Configuration: one dataclass per concern, validated where it is built.

Precedence, highest first: keyword overrides (``enable(**overrides)`` / ``load_config``), the
``OXYGEN_CONF`` environment variable (``key:value,key:value``, the shape of
``PYTORCH_CUDA_ALLOC_CONF``; keys may be dotted, ``pool.hot_zone_ratio:0.5``), the YAML file named
by ``OXYGEN_CONFIG_FILE``, then the documented defaults. Every field is checked: a bad value raises
``ValueError`` naming the field, the value and what is allowed. Unknown keys are errors. The YAML is
read with ``yaml.safe_load``; nothing is evaluated.
"""

from .fields import (
    DEVICE_GRANULARITY,
    ENV_CONF,
    ENV_FILE,
    FRESH_PREFILL,
    MAX_CONFIG_FILE_BYTES,
    MAX_PAGE_SIZE,
    MAX_TOKENS,
    MAX_VIRTUAL_BYTES,
    SECTIONS,
    KernelConfig,
    KVConfig,
    OxygenConfig,
    PoolConfig,
    SchedulerConfig,
    check_page_size,
    describe,
    host_memory_bytes,
)  # fmt: skip
from .sources import NOT_WIRED, load_config, parse_conf_string

__all__ = [
    "DEVICE_GRANULARITY", "ENV_CONF", "ENV_FILE", "FRESH_PREFILL", "SECTIONS", "KernelConfig",
    "KVConfig",
    "OxygenConfig", "PoolConfig", "SchedulerConfig", "describe", "load_config",
    "parse_conf_string", "NOT_WIRED", "host_memory_bytes", "check_page_size",
    "MAX_CONFIG_FILE_BYTES", "MAX_PAGE_SIZE", "MAX_TOKENS", "MAX_VIRTUAL_BYTES",
]  # fmt: skip
