"""Paged KV cache: block manager, pool storage, and the framework-agnostic core.

`PagedKVCache` (the transformers Cache adaptor) is imported lazily from here so that this package
does not need transformers unless it is asked for.
"""

from .block_manager import BlockManager, KVCacheFull, SequenceBlocks
from .paged_cache import PagedKVCore, StepPlan
from .pool import KVPool, get_pool, pool_stats, release_pools

__all__ = [
    "BlockManager",
    "KVCacheFull",
    "SequenceBlocks",
    "PagedKVCore",
    "StepPlan",
    "KVPool",
    "get_pool",
    "pool_stats",
    "release_pools",
    "PagedKVCache",
]


def __getattr__(name):
    if name == "PagedKVCache":
        from ..integrations.hf_cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
