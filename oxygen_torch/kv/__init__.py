"""Paged KV cache: block manager, pool storage, and the framework-agnostic core. Knows nothing
of transformers (its Cache adaptor is `oxygen_torch.integrations.hf.PagedKVCache`)."""

from .block_manager import BlockManager, KVCacheFull, SequenceBlocks
from .core import PagedKVCore, StepPlan
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
]
