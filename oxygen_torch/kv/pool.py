"""KV pools: one storage + block manager per (device, model geometry), shared by every cache.

A pool is created on first use and kept: generate() calls on the same model reuse its arena, and
a cache returned to the user shares blocks with the next one it is forked into. Blocks come back
when caches end or are garbage-collected; pages with no live block are unmapped at once.
release_pools() lets idle pools go; a pool goes (its arena unmapped) only once nothing refers to
it, so a cache bound to it never finds it gone.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from dataclasses import dataclass

import torch

from .._patching import warn_once
from ..triton_kernels._checks import is_fp8
from .block_manager import BlockManager
from .heat import Heat
from .prefix import PrefixCache
from .storage import GUARD_BLOCK, KVStorage, make_backing
from .tier import CPUTier

MiB = 1 << 20
GiB = 1 << 30
# the blocks' heat (kv/heat.py) counts a step's reads every this many steps, halved every 64 steps
HEAT_EVERY = 4
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
    # a hybrid model's sliding layers: their pages keep only blocks some row still reads
    # through its window (kv/window.py); () for every other model
    window_layers: tuple[int, ...] = ()


class KVPool:
    """Storage for one geometry plus the BlockManager that hands out its blocks."""

    def __init__(self, key: PoolKey):
        self.key = key
        nbytes = key.arena_bytes or default_arena_bytes(key.device)
        backing = make_backing(key.backing, nbytes, key.device, key.page_size)
        # Re-entrant: a cache's finalizer may run (GC) while this thread holds the lock.
        self.lock = threading.RLock()
        self.storage = KVStorage(
            backing, key.num_layers, key.num_kv_heads, key.head_dim, key.dtype, key.block_tokens,
            key.window_layers, lock=self.lock,
        )  # fmt: skip
        # fp8 K/V: one fp32 scale per (block, kv head) and layer, in a storage of their own whose
        # pages are mapped with the blocks they serve (k_scale(layer) / v_scale(layer))
        self.scales: KVStorage | None = None
        self._k_scales: list[torch.Tensor] = []  # per layer, as the kernels take them:
        self._v_scales: list[torch.Tensor] = []  # [num_blocks, kv_heads] views of self.scales
        if is_fp8(key.dtype):
            n = self.storage.num_blocks
            per_region = -(-n * key.num_kv_heads * 4 // key.page_size)
            nbytes = 2 * key.num_layers * per_region * key.page_size
            self.scales = KVStorage(
                make_backing(key.backing, nbytes, key.device, key.page_size),
                key.num_layers, key.num_kv_heads, 1, torch.float32, 1, key.window_layers,
            )  # fmt: skip
            self._k_scales = [t.view(t.shape[0], t.shape[2])[:n] for t in self.scales.k]
            self._v_scales = [t.view(t.shape[0], t.shape[2])[:n] for t in self.scales.v]
        self.manager = BlockManager(
            self.storage.num_blocks,
            first_id=GUARD_BLOCK + 1,
            on_alloc=self._on_alloc,
            on_free=self._on_free,
            on_narrow=self._on_narrow if key.window_layers else None,
        )
        self.prefix: PrefixCache | None = None  # made by the first call that asks for one
        self.tier: CPUTier | None = None  # likewise (pool.cpu_tier_bytes)
        # one tier maker at a time, pinning outside self.lock where its caller does not hold it
        # (~0.3 s a GiB: the pool's other users go on meanwhile); others wait on the condition
        # (which lets the lock go, however deep it is held); the thread of cpu_tier(wait=False)
        self._tier_cond = threading.Condition(self.lock)
        self._tier_making = False
        self._tier_ahead: threading.Thread | None = None
        self.heat: Heat | None = None  # block heat: with a tier and a prefix cache (_new_heat)
        # generate() calls too large for this pool run as row groups (kv.oversubscribe)
        self.oversubscribed = {"calls_split": 0, "groups_run": 0}
        self.window_freed_blocks = 0  # freed behind sliding windows (kv/window.py)
        self.window_narrowed_blocks = 0  # narrowed behind a hybrid model's windows (likewise)
        self.pid = os.getpid()  # a forked child's calls make pools of their own
        self.closed = False
        if key.device.type == "cuda":  # collected, not closed (release_pools): its arena is
            # unmapped by the arena's own finalizer; no queued kernel may still read it
            weakref.finalize(self, torch.cuda.synchronize, key.device).atexit = False

    def cpu_tier(
        self,
        nbytes: int,
        disk_path: str = "",
        disk_bytes: int = 0,
        fp8_lowering: bool = False,
        moves: str = "auto",
        wait: bool = True,
    ) -> CPUTier | None:
        """The pool's CPU tier, made on first use with `nbytes` of host memory, a disk tier of
        `disk_bytes` in directory `disk_path` behind it ("": none), fp8 lowering or not (later
        arguments are ignored: the slots are allocated once) and its moves' way (pool.tier_moves:
        the last caller's stands); None when that holds no block.

        Making it pins `nbytes` of host memory on a GPU: ~0.3 s a GiB (4 GiB by default: on an
        H100 a 1.3 s stall of every running call when the engine's first preemption made it).
        `wait` False (the engine's steps): a tier not made yet is made by a thread of its own
        and None is returned meanwhile (the caller recomputes instead of swapping); on a CPU,
        where nothing is pinned, it is made at once either way. The pool's lock is not held
        while the host memory is pinned (unless the caller holds it already)."""
        with self.lock:
            if self.tier is not None:
                self.tier.moves = moves
                return self.tier
            if nbytes <= 0:
                return None
        args = (nbytes, disk_path, disk_bytes, fp8_lowering, moves)
        if wait or not self._pins():
            return self._make_tier(*args)
        with self.lock:
            if self._tier_ahead is None and not self._tier_making:
                # the making is the thread's from here: a caller that waits meanwhile waits
                # for its tier, even before the thread has run a line
                self._tier_making = True
                self._tier_ahead = threading.Thread(
                    target=self._make_tier_ahead, args=args, name="oxygen-cpu-tier", daemon=True
                )
                try:
                    self._tier_ahead.start()
                except BaseException:
                    self._tier_ahead = None
                    self._end_making()
                    raise
        return None

    def _pins(self) -> bool:
        """Whether making the tier pins its host memory (a GPU pool): then wait=False makes it
        on a thread of its own."""
        return self.key.device.type == "cuda"

    def _make_tier(
        self, nbytes, disk_path, disk_bytes, fp8_lowering, moves, claimed: bool = False
    ) -> CPUTier | None:
        """Makes the tier, one maker at a time; `claimed`: the caller set _tier_making already
        (cpu_tier(wait=False) for its thread)."""
        if not claimed:
            with self._tier_cond:
                while self._tier_making:  # (another thread pins it: its tier is ours)
                    self._tier_cond.wait()
                self._tier_making = True
        try:
            with self.lock:  # (made meanwhile, or the pool closed: nothing to make)
                if self.tier is not None or self.closed:
                    return self.tier
            storages = [self.storage] + ([self.scales] if self.scales is not None else [])
            tier = CPUTier(storages, nbytes, self.key.device, disk_path, disk_bytes,
                           fp8_lowering, moves)  # fmt: skip
            with self.lock:
                if tier.num_slots > 0 and not self.closed:
                    self.tier = tier
                    if self.prefix is not None:  # its blocks given back go cold from now on
                        self.prefix.attach(self.tier, self._new_heat())
                    return self.tier
            tier.close()
            return None
        finally:
            self._end_making()

    def _end_making(self) -> None:
        with self._tier_cond:
            self._tier_making = False
            self._tier_cond.notify_all()

    def _make_tier_ahead(self, *args) -> None:
        """cpu_tier(wait=False)'s thread: a tier that fails to be made is said once (the rows
        the engine preempts are recomputed); the next cpu_tier(wait=False) tries again."""
        try:
            try:
                if self.key.device.type == "cuda":
                    torch.cuda.set_device(self.key.device)
            except BaseException:
                self._end_making()  # (the making was claimed for this thread)
                raise
            self._make_tier(*args, claimed=True)
        except Exception as err:  # noqa: BLE001 - said, and swaps become recomputes
            warn_once(f"oxygen_torch: the KV pool's CPU tier could not be made: {err!r}; "
                      "preempted rows are recomputed instead of swapped")  # fmt: skip
        finally:
            with self.lock:
                self._tier_ahead = None

    def wait_tier_ahead(self, timeout: float | None = None) -> None:
        """Waits for a tier being made by cpu_tier(wait=False)'s thread (tests, tools)."""
        t = self._tier_ahead
        if t is not None:
            t.join(timeout)

    def cpu_tier_of(self, cfg, wait: bool = True) -> CPUTier | None:
        """cpu_tier() set by a PoolConfig (pool.cpu_tier_bytes, the disk tier, lowering, the
        moves' way)."""
        return self.cpu_tier(
            cfg.cpu_tier_bytes,
            cfg.disk_tier_path,
            cfg.disk_tier_bytes,
            cfg.tier_fp8_lowering,
            cfg.tier_moves,
            wait,
        )

    def prefix_cache(self, budget_bytes: int) -> PrefixCache | None:
        """The pool's prefix cache, its budget set from `budget_bytes` of KV (all layers); None
        when that holds no block. The last caller's budget stands (one pool, one budget)."""
        budget = budget_bytes // self.block_bytes()
        with self.lock:
            if budget <= 0:
                return self.prefix  # an existing cache is left to the calls that use it
            if self.prefix is None:
                self.prefix = PrefixCache(self.manager, self.key.block_tokens, budget)
                self.manager.reclaimer = self.prefix
                if self.tier is not None:
                    self.prefix.attach(self.tier, self._new_heat())
            elif budget < self.prefix.budget and self.prefix.num_hot > budget:
                self.prefix.evict(self.prefix.num_hot - budget)
            self.prefix.budget = budget
            return self.prefix

    def _new_heat(self) -> Heat:
        """The blocks' heat, made once the pool has both a CPU tier and a prefix cache (its one
        reader: which hot blocks move down first). Before, no step counts its reads: a count
        costs the engine thread ~15 torch calls every HEAT_EVERY steps, and under streaming
        load each call may wait for the interpreter lock. Under self.lock."""
        if self.heat is None:
            self.heat = Heat(self.storage.num_blocks, 64 // HEAT_EVERY, HEAT_EVERY)
        return self.heat

    def block_bytes(self) -> int:
        """Bytes of one block id across every layer's K and V (fp8 scales included)."""
        s = self.storage
        extra = self.scales.block_bytes * 2 * s.num_layers if self.scales is not None else 0
        return s.block_bytes * 2 * s.num_layers + extra

    def drop_prefix_cache(self) -> int:
        """Gives back every block the prefix cache holds; returns how many it held."""
        with self.lock:
            return self.prefix.clear() if self.prefix is not None else 0

    def _on_alloc(self, blocks: list[int]) -> None:
        if self.pid != os.getpid():
            raise RuntimeError(
                "oxygen KV cache: this cache was made before fork(), in the parent process, "
                "whose KV pool it uses; a forked child cannot add to it. A generate() started in "
                "the child gets KV of its own (or start workers with the 'spawn' method)"
            )
        self.storage.on_alloc(blocks)
        if self.scales is not None:
            try:
                self.scales.on_alloc(blocks)
            except BaseException:
                self.storage.on_free(blocks)
                raise

    def _on_free(self, blocks: list[int]) -> None:
        if self.pid != os.getpid():
            return  # a cache made before fork() let go in the child: the pages are the parent's
        self.storage.on_free(blocks)
        if self.scales is not None:
            self.scales.on_free(blocks)

    def _on_narrow(self, blocks: list[int]) -> None:
        if self.pid != os.getpid():
            return
        self.storage.on_narrow(blocks)
        if self.scales is not None:
            self.scales.on_narrow(blocks)

    def k_scale(self, layer: int) -> torch.Tensor | None:
        """fp8 pools: layer's K scales [num_blocks, kv_heads] fp32; None otherwise."""
        return self._k_scales[layer] if self._k_scales else None

    def v_scale(self, layer: int) -> torch.Tensor | None:
        return self._v_scales[layer] if self._v_scales else None

    def mapped_bytes(self, peak: bool = False) -> int:
        extra = self.scales.mapped_bytes(peak) if self.scales is not None else 0
        return self.storage.mapped_bytes(peak) + extra

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
            "dtype": str(self.key.dtype).removeprefix("torch."),
            "mapped_bytes": self.mapped_bytes(),
            "peak_mapped_bytes": self.mapped_bytes(peak=True),
            "reserved_bytes": s.backing.capacity
            + (self.scales.backing.capacity if self.scales is not None else 0),
            "prefix_cache": self.prefix.stats() if self.prefix is not None else None,
            "cpu_tier": self.tier.stats() if self.tier is not None else None,
            "oversubscribed": dict(self.oversubscribed),
            "window_freed_blocks": self.window_freed_blocks,
            "window_narrowed_blocks": self.window_narrowed_blocks,
            "window_layers": len(self.key.window_layers),
            "map_ahead": s.ahead_stats(),
            "window_mapped_bytes": s.window_mapped_bytes()
            + (self.scales.window_mapped_bytes() if self.scales is not None else 0),
        }

    def close(self) -> None:
        """Unmaps the pool now: every block of it must be unused (release_pools lets pools go
        by reachability instead). A second close does nothing."""
        if self.closed:
            return
        self.closed = True
        if self.key.device.type == "cuda":
            torch.cuda.synchronize(self.key.device)  # no queued kernel may read what we unmap
        self.storage.close_ahead()
        self.storage.backing.close()
        if self.scales is not None:
            self.scales.backing.close()
        if self.tier is not None:
            self.tier.close()  # the disk tier's file goes


def default_arena_bytes(device: torch.device) -> int:
    """Virtual size of a KV arena when kv.arena_bytes is 0: the device's memory (cuda) or 4 GiB."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _HOST_DEFAULT_BYTES


# Pools kept for reuse (generate() calls on one model share an arena); release_pools() lets the
# idle ones go. `_open` also holds, weakly, a pool let go that something still refers to (a cache
# bound to it): get_pool gives it again, so one geometry never has two pools while it lives.
_pools: dict[PoolKey, KVPool] = {}
_open: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_pools_lock = threading.Lock()


_inherited: list[KVPool] = []  # in a forked child, the parent's pools (_after_fork_in_child)


def _after_fork_in_child() -> None:
    """A forked child starts with no pools: the parent's belong to the parent. Their arenas
    refuse every call here (csrc/fork.h), their locks may be held by threads this process does
    not have, their block managers would hand out the very blocks the parent goes on handing
    out, and their prefix caches would read pages the parent goes on writing. The child's calls
    make pools of their own. The parent's are kept, unused: collected here, their finalizers
    would close what the parent still uses (a disk tier's file)."""
    global _pools_lock
    _pools_lock = threading.Lock()  # a fork while another thread was in get_pool left it held
    _inherited.extend([*_pools.values(), *_open.values()])
    _pools.clear()
    _open.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def get_pool(key: PoolKey) -> KVPool:
    with _pools_lock:
        pool = _pools.get(key)
        if pool is not None:
            return pool
        let_go = _open.get(key) is not None
    if let_go:  # collected now unless something still refers to it (a cache bound to it)
        gc.collect()
    with _pools_lock:
        pool = _pools.get(key) or _open.get(key)
        if pool is None or pool.closed:
            pool = KVPool(key)
        _pools[key] = _open[key] = pool
        return pool


def pool_stats() -> list[dict]:
    """One dict per live pool: blocks used/total, mapped and reserved bytes, prefix cache. (A
    pool let go by release_pools that a call still holds blocks in counts.)"""
    with _pools_lock:
        pools = list(_pools.values())
        pools += [
            p for p in _open.values()
            if p not in pools and not p.closed and p.manager.num_used > 0
        ]  # fmt: skip
    out = []
    for p in pools:
        with p.lock:
            out.append(p.stats())
    return out


def release_pools() -> None:
    """Lets go of every pool that has no live block (tests, disable()): the prefix cache's
    blocks are given back first. A pool let go is unmapped when it is collected, here, unless
    something still refers to it: a cache bound to it (a call running through this whose
    blocks come and go: preempted, swapped to the CPU tier, or binding just now) keeps it open,
    and get_pool gives it again. Busy pools stay (with their prefix cache). Caches no longer
    reachable but left in reference cycles are collected first: their blocks come back, so their
    pools go too (else such a pool stayed, with its CPU tier, for the next get_pool), frozen
    ones included (scheduler.gc_freeze froze the heap while they were live: engine/gc_watch.py)."""
    frozen = gc.get_freeze_count() > 0  # (thawed for the collections, frozen again after)
    if frozen:
        gc.unfreeze()
    try:
        gc.collect()
        _let_go_idle()
        gc.collect()  # (pools refer to themselves through their block manager's callbacks)
    finally:
        if frozen:
            gc.freeze()


def _let_go_idle() -> None:
    with _pools_lock:
        for key, pool in list(_pools.items()):
            with pool.lock:
                held = pool.prefix.num_hot if pool.prefix is not None else 0
                if held and pool.manager.num_used == held and pool.prefix.reclaimable() == held:
                    pool.drop_prefix_cache()
                if pool.manager.num_used == 0:
                    del _pools[key]
