"""The two routes onto the pool: PyTorch's CUDA allocator replaced by it (``enable_allocator``,
the global route: one pool per device, created by the first oxygen_malloc on that device), and
``pool()`` (the MemPool route, usable after CUDA is initialised)."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _patching
from ..config import PoolConfig, load_config
from . import native as _native
from .state import _route
from .stats import _torch_like_stats, empty_cache, reset_peak_memory_stats


def is_enabled() -> bool:
    return _route.enabled


def installed() -> bool:
    """Whether the pool is PyTorch's CUDA allocator now (the global route)."""
    return _route.installed


def _configure(cfg: PoolConfig) -> None:
    """The C side needs page size, reserve fraction and hysteresis before the first
    oxygen_malloc."""
    hyst_us = max(1, round(cfg.hysteresis_ms * 1000))
    st = _native.lib().oxygen_configure(
        b"cuda", cfg.page_size, cfg.reserve_fraction, 0, 0, 0, hyst_us, 1
    )
    _native.check(st, "configuring the global pool")
    st = _native.lib().oxygen_configure_lending(int(cfg.lend_idle_pages))
    _native.check(st, "configuring the global pool's lending (pool.lend_idle_pages)")
    _route.configured = True


def _pluggable():
    if _route.pluggable is None:
        _route.pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            str(Path(_native.LIB_PATH)), "oxygen_malloc", "oxygen_free"
        )
    return _route.pluggable


def enable_allocator(cfg: PoolConfig) -> None:
    """Make the pool PyTorch's CUDA allocator. Must run before CUDA is initialised. On a machine
    without CUDA (or with ``cfg.backend == "host"``) nothing is swapped; stats report the host
    backend."""
    if _route.enabled:
        return
    if cfg.backend == "cuda" and not torch.cuda.is_available():  # only auto may choose host
        raise RuntimeError(
            "oxygen_torch: pool.backend is 'cuda', but torch sees no usable CUDA device on this "
            "machine; set pool.backend to 'auto' (the host backend here) or 'host'"
        )
    if cfg.backend == "host" or not torch.cuda.is_available():
        _route.enabled, _route.backend = True, "host"
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "oxygen_torch: CUDA is already initialised in this process, so PyTorch's allocator "
            "can no longer be replaced. Call oxygen_torch.enable() before the first CUDA "
            "allocation, or use the second route around the code you want on the pool: "
            "`with oxygen_torch.pool(): ...`"
        )
    _configure(cfg)
    _route.saved_allocator = torch.cuda.memory._get_current_allocator()
    torch.cuda.memory.change_current_allocator(_pluggable())
    _route.enabled, _route.installed, _route.backend = True, True, "cuda"
    _patch_torch()


def disable_allocator() -> None:
    """Undo enable_allocator. Once CUDA has allocated through the pool PyTorch cannot swap its
    allocator back: the pool then stays in place (with working stats) for the process."""
    if not _route.enabled:
        return
    if _route.installed and torch.cuda.is_initialized():
        warnings.warn(
            "oxygen_torch: the pool stays PyTorch's CUDA allocator for the rest of this process "
            "(PyTorch cannot swap an allocator that has already allocated)",
            RuntimeWarning,
            stacklevel=2,
        )
        return
    if _route.installed:
        torch.cuda.memory.change_current_allocator(_route.saved_allocator)
    _unpatch_torch()
    _route.enabled = _route.installed = False


@contextlib.contextmanager
def pool(device: int | None = None) -> Iterator[Any]:
    """The MemPool route: allocations inside the block come from the pool (through PyTorch's
    caching allocator, so its stats and snapshots keep working). Usable after CUDA init. On a
    machine without CUDA it does nothing and yields None."""
    if not torch.cuda.is_available():
        yield None
        return
    if not _route.configured:
        _configure(load_config().pool)  # OXYGEN_CONF and the file, as enable() reads them
    mp = torch.cuda.MemPool(_pluggable().allocator())
    _route.pools.append(mp)
    with torch.cuda.use_mem_pool(mp, device):
        yield mp


# ---------------------------------------------------------------------------------------------
# What enable_allocator patches in PyTorch while the pool is its allocator


GROUP = "allocator"


def _patch(owner: Any, name: str, value: Any, why: str) -> None:
    _patching.replace(owner, name, value, why=why, group=GROUP)


def _unpatch_torch() -> None:
    _patching.undo(GROUP)


def _patch_torch() -> None:
    # Under CUDAPluggableAllocator the device-stats family raises ("does not yet support
    # getDeviceStats"); memory_allocated & co. look memory_stats up in torch.cuda.memory.
    original_empty = torch.cuda.memory.empty_cache

    def empty(*_a: Any) -> None:
        original_empty()
        empty_cache()

    def reset_peak(device: Any = None) -> None:
        reset_peak_memory_stats(torch.cuda._utils._get_device_index(device, optional=True))

    stats = "CUDAPluggableAllocator has no device stats: answered from the pool's counters"
    for owner in (torch.cuda.memory, torch.cuda):
        _patch(owner, "memory_stats", _torch_like_stats, stats)
        _patch(owner, "reset_peak_memory_stats", reset_peak, stats)
        _patch(owner, "reset_accumulated_memory_stats", lambda device=None: None, stats)
        _patch(owner, "empty_cache", empty, "also unmaps the pool's empty pages")
    _patch_record_stream()
    _patch_graphs()


def _patch_record_stream() -> None:
    """torch.Tensor.record_stream also tells the pool: CUDAPluggableAllocator has a C++ hook for
    it but no Python way to set one, so without this a block used on a side stream and freed on
    its own would be reused while the side stream may still read it."""
    original = torch.Tensor.record_stream
    lib = _native.lib()

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        original(self, stream)
        if not self.is_cuda:
            return
        handle = lib.oxygen_global_pool(self.device.index or 0)
        if handle:  # a block of another allocator (a MemPool's, say) is not the pool's: ignored
            ptr = self.untyped_storage().data_ptr()
            lib.oxygen_pool_record_stream(handle, ptr, stream.cuda_stream)

    _patch(torch.Tensor, "record_stream", record_stream, "the pool honours record_stream too")


def _patch_graphs() -> None:
    """Announce captures to the pool (no event queries while one runs: H200 fact, 900 and an
    invalidated capture otherwise) and tell it when a graph's memory may be reused."""
    graph_cls = torch.cuda.CUDAGraph
    lib = _native.lib()
    begin, end, reset = graph_cls.capture_begin, graph_cls.capture_end, graph_cls.reset

    def capture_begin(self, *args: Any, **kwargs: Any) -> None:
        token = lib.oxygen_capture_begin()
        try:
            begin(self, *args, **kwargs)
        except BaseException:
            lib.oxygen_capture_end(token)
            raise
        self._oxygen_token = token

    def capture_end(self) -> None:
        try:
            end(self)
        finally:
            token = self.__dict__.get("_oxygen_token", 0)
            if token:
                lib.oxygen_capture_end(token)
                with contextlib.suppress(TypeError):  # not weak-referenceable: reset() releases
                    self._oxygen_finalizer = weakref.finalize(
                        self, lib.oxygen_capture_release, token
                    )

    def graph_reset(self) -> None:
        reset(self)
        fin = self.__dict__.pop("_oxygen_finalizer", None)
        self.__dict__.pop("_oxygen_token", None)
        if fin is not None:
            fin()  # releases the token once

    why = "captures announced to the pool (no event queries while one runs)"
    _patch(graph_cls, "capture_begin", capture_begin, why)
    _patch(graph_cls, "capture_end", capture_end, why)
    _patch(graph_cls, "reset", graph_reset, "a reset graph's capture arena goes back to the pool")
