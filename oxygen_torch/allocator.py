"""The VMM pool from Python: ``VirtualPool`` and ``Arena`` objects, the global allocator route
(``enable_allocator``), the MemPool route (``pool()``), and the pool's statistics.

The mechanism lives in ``_oxygen.so`` (csrc/): one reserved virtual range per pool, 2 MiB physical
pages mapped exactly while live blocks touch them, handles created ahead by a refill thread.
Statistics are atomics in C, read here without taking any allocation lock.
"""

from __future__ import annotations

import contextlib
import ctypes
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from . import _native
from .config import PoolConfig

MiB = 1 << 20
DEFAULT_PAGE = 2 * MiB  # the VMM granularity the H200 reports
HIST_BOUNDS_US = [float(1 << i) for i in range(15)] + [float("inf")]  # map-latency buckets

__all__ = [
    "VirtualPool",
    "Arena",
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


def _resolve_backend(backend: str) -> str:
    if backend not in ("auto", "cuda", "host"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'host', got {backend!r}")
    if backend != "auto":
        return backend
    try:
        return "cuda" if _native.cuda_probe()[1] > 0 else "host"
    except (_native.NativeError, _native.NativeLibraryError):
        return "host"


def _stream_handle(stream: Any) -> int:
    """A cudaStream_t value from an int, a torch.cuda.Stream, or None (the legacy stream, 0)."""
    if stream is None:
        return 0
    return int(getattr(stream, "cuda_stream", stream))


def _read(fn, handle) -> dict:
    names = _native.lib().oxygen_stats_names().decode().split(",")
    arr = (ctypes.c_uint64 * len(names))()
    n = fn(handle, arr, len(names))
    return dict(zip(names, arr[:n], strict=False))


def _derive(raw: dict, backend: str, device: int) -> dict:
    """The documented statistics (names like PyTorch's where it has one) from the raw counters."""
    d = dict(raw)
    peak_mapped = raw.get("peak_mapped_bytes", 0)
    d["fragmentation"] = (
        1.0 - raw.get("peak_allocated_bytes", 0) / peak_mapped if peak_mapped else 0.0
    )
    maps, unmaps = raw.get("num_maps", 0), raw.get("num_unmaps", 0)
    d["mean_map_latency_us"] = raw.get("map_ns", 0) / maps / 1e3 if maps else 0.0
    d["mean_unmap_latency_us"] = raw.get("unmap_ns", 0) / unmaps / 1e3 if unmaps else 0.0
    d["physical_bytes"] = raw.get("mapped_bytes", 0) + raw.get("handle_cache_pages", 0) * raw.get(
        "page_size", 0
    )
    d["backend"] = backend
    d["device"] = device
    return d


def _oom(message: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(message)


class _NativeObject:
    """A native pool or arena: released by close(), at the end of a with-block, or when collected.
    close() releases everything: blocks still live are unmapped, do not touch them afterwards."""

    _h = None
    _destroy = ""  # name of the C function that releases the handle

    def close(self) -> None:
        if self._h:
            getattr(_native.lib(), self._destroy)(self._h)
            self._h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules it needs may already be gone
            pass


class VirtualPool(_NativeObject):
    """One pool as a Python object (tests, benchmarks, the KV cache). ``capacity`` is the physical
    limit in bytes (default: device memory x ``reserve_fraction``); the virtual range reserved is
    twice that, so that holes never starve it."""

    _destroy = "oxygen_pool_destroy"

    def __init__(
        self,
        backend: str = "auto",
        capacity: int | None = None,
        page_size: int = DEFAULT_PAGE,
        device: int = 0,
        reserve_fraction: float = 0.9,
        low_pages: int = 0,
        high_pages: int = 0,
        hysteresis_us: int = 0,
    ):
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
        if not 0 < reserve_fraction <= 1:
            raise ValueError(f"reserve_fraction must be in (0, 1], got {reserve_fraction}")
        self.backend = _resolve_backend(backend)
        self.device = device
        self.page_size = page_size
        lib = _native.lib()
        h = ctypes.c_void_p()
        _native.check(
            lib.oxygen_pool_create(
                self.backend.encode(),
                device,
                page_size,
                capacity or 0,
                reserve_fraction,
                low_pages,
                high_pages,
                hysteresis_us,
                ctypes.byref(h),
            ),
            f"creating a {self.backend} pool",
        )
        self._h = h.value
        self.base = int(lib.oxygen_pool_base(self._h))
        raw = self._raw()
        self.capacity = raw["max_pages"] * raw["page_size"]

    def _handle(self) -> int:
        if not self._h:
            raise RuntimeError("this VirtualPool is closed")
        return self._h

    def _raw(self) -> dict:
        return _read(_native.lib().oxygen_pool_stats, self._handle())

    def malloc(self, size: int, stream: Any = 0) -> int:
        """Address of a new block of ``size`` bytes; raises torch.OutOfMemoryError with the
        pool's figures when the pool (after reclaiming) or the device has no memory left."""
        out = ctypes.c_void_p()
        lib = _native.lib()
        st = lib.oxygen_pool_malloc(self._handle(), size, _stream_handle(stream), ctypes.byref(out))
        if st == _native.OK:
            return int(out.value)
        if st == _native.ERR_OOM:
            raise _oom(self._oom_message(size))
        _native.check(st, f"malloc({size})")
        raise AssertionError("unreachable")

    def _oom_message(self, size: int) -> str:
        s = self.stats()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if _native.lib().oxygen_pool_mem_info(self._h, ctypes.byref(free), ctypes.byref(total)):
            free.value = total.value = 0
        return (
            f"oxygen_torch pool ({self.backend}, device {self.device}) out of memory: requested "
            f"{size / MiB:.2f} MiB; live {s['allocated_bytes'] / MiB:.2f} MiB, mapped "
            f"{s['mapped_bytes'] / MiB:.2f} MiB, capacity {self.capacity / MiB:.2f} MiB, reserved "
            f"VA {s['reserved_va_bytes'] / MiB:.2f} MiB, device free {free.value / MiB:.2f} MiB "
            f"of {total.value / MiB:.2f} MiB"
        )

    def free(self, ptr: int, size: int | None = None, stream: Any = 0) -> bool:
        """Free a block. A double free or unknown pointer is reported once on stderr, counted in
        ``stats()['num_bad_frees']`` and ignored: returns False then."""
        st = _native.lib().oxygen_pool_free(
            self._handle(), ptr, -1 if size is None else size, _stream_handle(stream)
        )
        return st == _native.OK

    def empty_cache(self) -> None:
        """Wait for the device, then unmap every page with nothing live and drop cached handles."""
        _native.lib().oxygen_pool_empty_cache(self._handle())

    def reset_peak(self) -> None:
        _native.lib().oxygen_pool_reset_peak(self._handle())

    def prepare(self, nbytes: int) -> None:
        """Create physical handles now for ``nbytes`` (growth then only maps)."""
        _native.check(_native.lib().oxygen_pool_prepare(self._handle(), nbytes), "prepare")

    def bench(self, size: int, iters: int, stream: Any = 0) -> float:
        """Nanoseconds per malloc+free pair, looped in C (no Python per call)."""
        return float(
            _native.lib().oxygen_pool_bench(self._handle(), size, iters, _stream_handle(stream))
        )

    def stats(self) -> dict:
        return _derive(self._raw(), self.backend, self.device)

    def latency_histogram(self) -> list[int]:
        arr = (ctypes.c_uint64 * 16)()
        n = _native.lib().oxygen_pool_latency_hist(self._handle(), arr, 16)
        return list(arr[:n])


_arenas: weakref.WeakSet = weakref.WeakSet()


class Arena(_NativeObject):
    """A reserved virtual range for the KV cache; its pages are mapped explicitly. Handles come
    from the device context shared with the global pool and count in the same mapped bytes.

    Touching an unmapped page is fatal (SIGSEGV on the host backend, an illegal address that
    poisons the CUDA context on a GPU): unmap only pages no kernel can still read."""

    _destroy = "oxygen_arena_destroy"

    def __init__(
        self,
        nbytes: int,
        backend: str = "auto",
        device: int = 0,
        page_size: int = DEFAULT_PAGE,
        reserve_fraction: float = 0.9,
    ):
        if nbytes <= 0:
            raise ValueError(f"Arena size must be > 0 bytes, got {nbytes}")
        self.backend = _resolve_backend(backend)
        self.device = device
        lib = _native.lib()
        h = ctypes.c_void_p()
        _native.check(
            lib.oxygen_arena_create(
                self.backend.encode(), device, page_size, nbytes, reserve_fraction, ctypes.byref(h)
            ),
            f"creating a {self.backend} KV arena of {nbytes} bytes",
        )
        self._h = h.value
        self.base = int(lib.oxygen_arena_base(self._h))
        self.page_size = int(lib.oxygen_arena_page_size(self._h))
        self.num_pages = int(lib.oxygen_arena_pages(self._h))
        self.capacity = self.num_pages * self.page_size
        _arenas.add(self)

    def _handle(self) -> int:
        if not self._h:
            raise RuntimeError("this Arena is closed")
        return self._h

    def map_pages(self, first: int, count: int = 1) -> None:
        _native.check(
            _native.lib().oxygen_arena_map(self._handle(), first, count),
            f"arena map_pages({first}, {count})",
        )

    def unmap_pages(self, first: int, count: int = 1) -> None:
        _native.check(
            _native.lib().oxygen_arena_unmap(self._handle(), first, count),
            f"arena unmap_pages({first}, {count})",
        )

    def is_mapped(self, page: int) -> bool:
        return bool(_native.lib().oxygen_arena_is_mapped(self._handle(), page))

    def mapped_pages(self) -> int:
        return int(_native.lib().oxygen_arena_mapped_pages(self._handle()))

    def stats(self) -> dict:
        return _derive(
            _read(_native.lib().oxygen_arena_stats, self._handle()), self.backend, self.device
        )

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat tensor over the whole range (no copy, does not own the memory: keep the arena
        alive). Built from the data pointer with an explicit device, so torch does not probe the
        (possibly unmapped) base address."""
        dev = torch.device("cuda", self.device) if self.backend == "cuda" else torch.device("cpu")
        storage = torch._C._construct_storage_from_data_pointer(self.base, dev, self.capacity)
        t = torch.empty(0, dtype=torch.uint8, device=dev)
        t.set_(storage, 0, (self.capacity,), (1,))
        return t.view(dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        if self.backend != "cuda":
            raise AttributeError("__cuda_array_interface__ exists only on a cuda arena")
        return {
            "shape": (self.capacity,),
            "typestr": "|u1",
            "data": (self.base, False),
            "version": 3,
            "strides": None,
        }


# ---------------------------------------------------------------------------------------------
# The global route: PyTorch's CUDA allocator replaced by the pool (one per device, created by the
# first oxygen_malloc on that device).


class _Route:
    enabled = False  # enable_allocator() ran
    installed = False  # the CUDAPluggableAllocator is PyTorch's current allocator
    backend = "host"
    pluggable = None  # torch.cuda.memory.CUDAPluggableAllocator, kept alive
    saved_allocator = None  # PyTorch's allocator before enable (restorable until CUDA init)
    configured = False  # oxygen_configure ran
    patches: list = []  # (owner, name, original)
    pools: list = []  # MemPools of the pool() route, kept alive with their segments


_route = _Route()


def is_enabled() -> bool:
    return _route.enabled


def _configure(cfg: Any) -> None:
    """The C side needs page size, reserve fraction and hysteresis before the first
    oxygen_malloc."""
    page = int(getattr(cfg, "page_size", DEFAULT_PAGE) or DEFAULT_PAGE)
    frac = float(getattr(cfg, "reserve_fraction", 0.9))
    hyst_us = max(1, round(float(getattr(cfg, "hysteresis_ms", PoolConfig.hysteresis_ms)) * 1000))
    st = _native.lib().oxygen_configure(b"cuda", page, frac, 0, 0, 0, hyst_us, 1)
    _native.check(st, "configuring the global pool")
    _route.configured = True


def _pluggable():
    if _route.pluggable is None:
        _route.pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            str(Path(_native.LIB_PATH)), "oxygen_malloc", "oxygen_free"
        )
    return _route.pluggable


def enable_allocator(cfg: Any) -> None:
    """Make the pool PyTorch's CUDA allocator. Must run before CUDA is initialised. On a machine
    without CUDA (or with ``cfg.backend == "host"``) nothing is swapped; stats report the host
    backend."""
    if _route.enabled:
        return
    backend = getattr(cfg, "backend", "auto")
    if backend == "host" or not torch.cuda.is_available():
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
        _configure(object())  # defaults: 2 MiB pages, reserve fraction 0.9
    mp = torch.cuda.MemPool(_pluggable().allocator())
    _route.pools.append(mp)
    with torch.cuda.use_mem_pool(mp, device):
        yield mp


# ---------------------------------------------------------------------------------------------
# Statistics


def _global_handle(device: int) -> int | None:
    try:
        return _native.lib().oxygen_global_pool(device)
    except _native.NativeLibraryError:
        return None


def raw_counters(device: int = 0) -> dict:
    """The raw counters of the global pool of ``device`` (or of a live arena's device context when
    no global pool exists), read from atomics without taking any allocation lock."""
    h = _global_handle(device)
    if h:
        return _read(_native.lib().oxygen_pool_stats, h)
    for arena in list(_arenas):
        if arena._h and arena.device == device:
            return _read(_native.lib().oxygen_arena_stats, arena._h)
    names = _native.lib().oxygen_stats_names().decode().split(",")
    return dict.fromkeys(names, 0)


def map_latency_histogram(device: int = 0) -> list[tuple[float, int]]:
    """(upper bound in microseconds, pages) per bucket of per-page map latency."""
    arr = (ctypes.c_uint64 * 16)()
    h = _global_handle(device)
    n = _native.lib().oxygen_pool_latency_hist(h, arr, 16) if h else 0
    return list(zip(HIST_BOUNDS_US, arr[:n], strict=False))


def memory_stats(device: int | None = None) -> dict:
    """Allocated / mapped / peak / fragmentation / map latency ... of the global pool.

    Without a global pool (a CPU machine, or before enable()), the physical figures are those of
    the device's KV arenas, which hand out whole KV blocks and keep no allocation counters:
    fragmentation is then None (not applicable; `oxygen_torch.kv.pool_stats()` has the blocks
    in use), not the 1.0 that "nothing allocated, pages mapped" would compute."""
    dev = 0 if device is None else int(device)
    backend = "cuda" if _global_handle(dev) else _route.backend
    if not _global_handle(dev):
        arenas = [a for a in list(_arenas) if a._h and a.device == dev]
        backend = arenas[0].backend if arenas else backend
    d = _derive(raw_counters(dev), backend, dev)
    if not _global_handle(dev):
        d["fragmentation"] = None
    return d


def empty_cache() -> None:
    """Unmap every page with nothing live in the global pools and release cached handles."""
    lib = _native.lib()
    for dev in range(64):
        h = lib.oxygen_global_pool(dev)
        if h:
            lib.oxygen_pool_empty_cache(h)


def reset_peak_memory_stats(device: int | None = None) -> None:
    h = _global_handle(0 if device is None else int(device))
    if h:
        _native.lib().oxygen_pool_reset_peak(h)


def _torch_like_stats(device: Any = None) -> dict:
    """PyTorch's memory_stats() keys answered from the pool (reserved = mapped)."""
    dev = torch.cuda._utils._get_device_index(device, optional=True)
    s = memory_stats(dev)
    out = {
        "allocated_bytes.all.current": s["allocated_bytes"],
        "allocated_bytes.all.peak": s["peak_allocated_bytes"],
        "active_bytes.all.current": s["allocated_bytes"],
        "active_bytes.all.peak": s["peak_allocated_bytes"],
        "requested_bytes.all.current": s["requested_bytes"],
        "reserved_bytes.all.current": s["mapped_bytes"],
        "reserved_bytes.all.peak": s["peak_mapped_bytes"],
        "allocation.all.current": s["live_blocks"],
        "allocation.all.allocated": s["num_allocs"],
        "allocation.all.freed": s["num_frees"],
        "num_alloc_retries": s["reclaims"],
        "num_ooms": s["num_ooms"],
    }
    out.update({f"oxygen.{k}": v for k, v in s.items()})
    return out


# ---------------------------------------------------------------------------------------------
# What enable_allocator patches in PyTorch while the pool is its allocator


def _patch(owner: Any, name: str, value: Any) -> None:
    _route.patches.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _unpatch_torch() -> None:
    while _route.patches:
        owner, name, original = _route.patches.pop()
        setattr(owner, name, original)


def _patch_torch() -> None:
    # Under CUDAPluggableAllocator the device-stats family raises ("does not yet support
    # getDeviceStats"); memory_allocated & co. look memory_stats up in torch.cuda.memory.
    original_empty = torch.cuda.memory.empty_cache

    def empty(*_a: Any) -> None:
        original_empty()
        empty_cache()

    def reset_peak(device: Any = None) -> None:
        reset_peak_memory_stats(torch.cuda._utils._get_device_index(device, optional=True))

    for owner in (torch.cuda.memory, torch.cuda):
        _patch(owner, "memory_stats", _torch_like_stats)
        _patch(owner, "reset_peak_memory_stats", reset_peak)
        _patch(owner, "reset_accumulated_memory_stats", lambda device=None: None)
        _patch(owner, "empty_cache", empty)
    _patch_graphs()
    _patch_inductor()


def _patch_inductor() -> None:
    # CUDA-graph trees need checkPoolLiveAllocations and allocator checkpoints, which
    # CUDAPluggableAllocator lacks (H200: reduce-overhead failed there). Inductor's non-tree
    # graphs run instead, captured by the oxygen backend's runner (compile/cudagraphs.py).
    try:
        import torch._inductor.compile_fx as compile_fx
        import torch._inductor.config as inductor_config
    except Exception:  # inductor unavailable: nothing compiles with cudagraphs anyway
        return
    from .compile.cudagraphs import inductor_cudagraphify

    _patch(inductor_config.triton, "cudagraph_trees", False)
    if callable(getattr(compile_fx, "cudagraphify_impl", None)):
        _patch(compile_fx, "cudagraphify_impl", inductor_cudagraphify)


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

    _patch(graph_cls, "capture_begin", capture_begin)
    _patch(graph_cls, "capture_end", capture_end)
    _patch(graph_cls, "reset", graph_reset)
