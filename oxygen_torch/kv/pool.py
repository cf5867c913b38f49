"""KV pools: one storage + block manager per (device, model geometry), shared by every cache.

A pool is created on first use and kept: generate() calls on the same model reuse its arena, and
a cache returned to the user shares blocks with the next one it is forked into. Blocks come back
when caches end or are garbage-collected; pages with no live block are unmapped at once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .storage import GUARD_BLOCK, KVStorage, make_backing

MiB = 1 << 20
GiB = 1 << 30
_HOST_DEFAULT_BYTES = 4 * GiB  # virtual only: host pages are mapped as blocks are used


@dataclass(frozen=True)
class PoolKey:
    device: torch.device
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_tokens: int
    backing: str
    arena_bytes: int
    page_size: int


class KVPool:
    """Storage for one geometry plus the BlockManager that hands out its blocks."""

    def __init__(self, key: PoolKey):
        self.key = key
        nbytes = key.arena_bytes or default_arena_bytes(key.device)
        backing = make_backing(key.backing, nbytes, key.device, key.page_size)
        self.storage = KVStorage(
            backing, key.num_layers, key.num_kv_heads, key.head_dim, key.dtype, key.block_tokens
        )
        self.manager = BlockManager(
            self.storage.num_blocks,
            first_id=GUARD_BLOCK + 1,
            on_alloc=self.storage.on_alloc,
            on_free=self.storage.on_free,
        )
        # Re-entrant: a cache's finalizer may run (GC) while this thread holds the lock.
        self.lock = threading.RLock()

    def stats(self) -> dict:
        s = self.storage
        return {
            "device": str(self.key.device),
            "backing": s.backing.name,
            "block_tokens": self.key.block_tokens,
            "block_bytes_all_layers": s.block_bytes * 2 * s.num_layers,
            "blocks_total": self.manager.num_blocks - self.manager.first_id,
            "blocks_used": self.manager.num_used,
            "peak_blocks_used": self.manager.peak_used,
            "mapped_bytes": s.mapped_bytes(),
            "peak_mapped_bytes": s.mapped_bytes(peak=True),
            "reserved_bytes": s.backing.capacity,
        }

    def close(self) -> None:
        if self.key.device.type == "cuda":
            torch.cuda.synchronize(self.key.device)  # no queued kernel may read what we unmap
        self.storage.backing.close()


def default_arena_bytes(device: torch.device) -> int:
    """Virtual size of a KV arena when kv.arena_bytes is 0: the device's memory (cuda) or 4 GiB."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _HOST_DEFAULT_BYTES


_pools: dict[PoolKey, KVPool] = {}
_pools_lock = threading.Lock()


def get_pool(key: PoolKey) -> KVPool:
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = KVPool(key)
        return pool


def pool_stats() -> list[dict]:
    """One dict per live pool: blocks used/total, mapped and reserved bytes."""
    with _pools_lock:
        return [p.stats() for p in _pools.values()]


def release_pools() -> None:
    """Closes every pool that has no live block (tests, disable()). Busy pools are kept."""
    with _pools_lock:
        for key, pool in list(_pools.items()):
            if pool.manager.num_used == 0:
                pool.close()
                del _pools[key]
