"""The VMM page pool from Python: the native library, pool and arena objects, the two routes onto
PyTorch's allocator, and the pool's statistics. Knows nothing of the KV cache or transformers."""

import sys
import types

from . import route
from .objects import DEFAULT_PAGE, Arena, VirtualPool, held_arenas, live_arenas
from .route import disable_allocator, enable_allocator, is_enabled, pool
from .stats import (
    empty_cache,
    map_latency_histogram,
    memory_stats,
    raw_counters,
    reset_peak_memory_stats,
)

__all__ = [
    "DEFAULT_PAGE",
    "Arena",
    "VirtualPool",
    "live_arenas",
    "held_arenas",
    "enable_allocator",
    "disable_allocator",
    "is_enabled",
    "pool",
    "memory_stats",
    "empty_cache",
    "reset_peak_memory_stats",
    "raw_counters",
    "map_latency_histogram",
]


class _Callable(types.ModuleType):
    """``oxygen_torch.pool`` is this package and also the MemPool route, documented as
    ``with oxygen_torch.pool(): ...``: calling the package enters ``route.pool``."""

    def __call__(self, device: int | None = None):
        return route.pool(device)


sys.modules[__name__].__class__ = _Callable
