"""oxygen_torch: a VMM-backed memory pool, a paged KV cache and Triton attention for PyTorch LLM
inference. ``oxygen_torch.enable()`` before the first CUDA allocation; ``generate()`` unchanged.
"""

from . import (
    compile,  # noqa: F401  (registers the torch.compile backend "oxygen")
    pool,  # the package; calling it is the MemPool route (pool/__init__.py)
)
from .api import (
    active_config,
    apply,
    clear_prefix_cache,
    decode_graph_stats,
    disable,
    empty_cache,
    enable,
    engine_stats,
    is_enabled,
    kv_stats,
    memory_stats,
    warm_up,
)
from .config import KernelConfig, KVConfig, OxygenConfig, PoolConfig, SchedulerConfig, load_config
from .engine.task import Cancelled, task
from .pool import Arena, VirtualPool
from .triton_kernels.precision import PrecisionMode

__version__ = "0.1.0"


def __getattr__(name):
    # PagedKVCache needs transformers (the optional `hf` extra): imported on first use
    if name == "PagedKVCache":
        from .integrations.hf.cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "enable",
    "apply",
    "task",
    "Cancelled",
    "memory_stats",
    "kv_stats",
    "clear_prefix_cache",
    "decode_graph_stats",
    "engine_stats",
    "warm_up",
    "empty_cache",
    "pool",
    "VirtualPool",
    "Arena",
    "PagedKVCache",
    "compile",
    "disable",
    "is_enabled",
    "active_config",
    "load_config",
    "OxygenConfig",
    "PoolConfig",
    "KVConfig",
    "KernelConfig",
    "SchedulerConfig",
    "PrecisionMode",
    "__version__",
]
