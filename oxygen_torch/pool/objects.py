"""The VMM pool as Python objects: ``VirtualPool`` (a pool of its own: tests, benchmarks) and
``Arena`` (a reserved range whose pages the KV cache maps explicitly).

The mechanism lives in ``_oxygen.so`` (csrc/): one reserved virtual range per pool, 2 MiB physical
pages mapped exactly while live blocks touch them, handles created ahead by a refill thread.
Statistics are atomics in C, read here without taking any allocation lock.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from typing import Any

import torch

from ..config import check_page_size
from . import native as _native
from .figures import _derive
from .native import INT64_MAX, INT_MAX, MAX_DEVICES, SIZE_MAX, fraction_arg, int_arg

MiB = 1 << 20
DEFAULT_PAGE = 2 * MiB  # the VMM granularity the H200 reports
# The native pool reserves twice its capacity as address space, and no machine has more than
# 2^56 bytes of it (csrc/page_pool.cpp, kMaxCapacity).
MAX_CAPACITY = 1 << 55


def _resolve_backend(backend: str) -> str:
    if backend not in ("auto", "cuda", "host"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'host', got {backend!r:.80}")
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
    return int_arg("stream", getattr(stream, "cuda_stream", stream), 0, SIZE_MAX)


def _read(export) -> dict:
    """The counters a C export writes: export(array, length) -> how many, or -status."""
    names = _native.lib().oxygen_stats_names().decode().split(",")
    arr = (ctypes.c_uint64 * len(names))()
    n = export(arr, len(names))
    if n < 0:  # -status: the handle cannot be used (inherited across fork)
        _native.check(-n, "reading the counters")
    return dict(zip(names, arr[:n], strict=False))


def _check_page_size(owner: str, page_size: Any) -> int:
    """The rule PoolConfig applies to pool.page_size, for every pool and arena (host included)."""
    page_size = int_arg(f"{owner} page_size", page_size, 0, SIZE_MAX)
    check_page_size(f"{owner} page_size", page_size)
    return page_size


def _oom(message: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(message)


class _Handle:
    """A native pool or arena handle. close() releases it (`destroy`), once its last holder lets
    it go: the object until close(), and every call in flight on it. A call holds its object's
    handle for its whole run (`_NativeObject._hold`), so close() on another thread never frees
    what a call is still using: that call finishes on the live object, the release follows it,
    and every call that starts after close() raises RuntimeError. ctypes lets other threads run
    during a native call: the object alone would not keep the handle alive."""

    closed = False  # set by the object's close(): only then does the last holder release it

    def __init__(self, h: int, destroy: str):
        self.h, self._destroy = h, destroy

    def __del__(self) -> None:
        if not self.closed:  # a close() that did nothing (tests/test_leakcheck.py) leaks it
            return
        try:
            getattr(_native.lib(), self._destroy)(self.h)
        except Exception:  # at interpreter exit the modules it needs may already be gone
            pass


class _NativeObject:
    """A native pool or arena: released by close(), at the end of a with-block, or when collected.
    close() releases everything: blocks still live are unmapped, do not touch them afterwards.
    Every method of a closed object raises RuntimeError; a call already running when close()
    comes (another thread) finishes first, and the release waits for it."""

    _owner: _Handle | None = None

    @property
    def _h(self) -> int | None:
        """The raw native handle (tests call the C functions with it), None once closed."""
        owner = self._owner
        return owner.h if owner is not None else None

    def close(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.closed = True  # released now, or when the last call in flight returns

    def _hold(self) -> _Handle:
        """The handle, held by the caller for the length of its native call."""
        owner = self._owner
        if owner is None:
            raise RuntimeError(f"this {type(self).__name__} is closed")
        return owner

    def _call(self, fn: str, *args):
        """The C function `fn` on this object's handle, held until it returns."""
        owner = self._hold()
        return getattr(_native.lib(), fn)(owner.h, *args)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules it needs may already be gone
            pass


def _create(fn, obj, args: tuple, what: str) -> int:
    """A native pool or arena for `obj` (its backend and device set): its handle."""
    h = ctypes.c_void_p()
    _native.check(fn(obj.backend.encode(), obj.device, *args, ctypes.byref(h)), what)
    return h.value


class VirtualPool(_NativeObject):
    """One pool as a Python object (tests, benchmarks, the KV cache). ``capacity`` is the physical
    limit in bytes (default: device memory x ``reserve_fraction``); the virtual range reserved is
    twice that, so that holes never starve it."""

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
        lend_idle: bool = True,
    ):
        if not isinstance(lend_idle, bool):
            raise TypeError(f"VirtualPool lend_idle: {lend_idle!r} is not a bool")
        if capacity is not None:
            capacity = int_arg("VirtualPool capacity (bytes)", capacity, 1, MAX_CAPACITY)
        args = (
            _check_page_size("VirtualPool", page_size),
            capacity or 0,
            fraction_arg("VirtualPool reserve_fraction", reserve_fraction),
            int_arg("VirtualPool low_pages", low_pages, 0, 1 << 32),
            int_arg("VirtualPool high_pages", high_pages, 0, 1 << 32),
            int_arg("VirtualPool hysteresis_us", hysteresis_us, 0, SIZE_MAX // 1000),
        )
        self.device = int_arg("VirtualPool device", device, 0, MAX_DEVICES - 1)
        self.backend = _resolve_backend(backend)
        self.page_size = args[0]
        h = _create(_native.lib().oxygen_pool_create, self, args, f"creating a {self.backend} pool")
        self._owner = _Handle(h, "oxygen_pool_destroy")
        self.base = int(self._call("oxygen_pool_base"))
        if not lend_idle:  # (pool.lend_idle_pages)
            _native.check(self._call("oxygen_pool_set_lending", 0), "set_lending")
        raw = self._raw()
        self.capacity = raw["max_pages"] * raw["page_size"]

    def _raw(self) -> dict:
        return _read(functools.partial(self._call, "oxygen_pool_stats"))

    def malloc(self, size: int, stream: Any = 0) -> int:
        """Address of a new block of ``size`` bytes; raises torch.OutOfMemoryError with the
        pool's figures when the pool (after reclaiming) or the device has no memory left."""
        size = int_arg("malloc size", size, 0, INT64_MAX)
        out, stream = ctypes.c_void_p(), _stream_handle(stream)
        owner = self._hold()  # as _call does, without its extra frame: this is the hot path
        st = _native.lib().oxygen_pool_malloc(owner.h, size, stream, ctypes.byref(out))
        if st == _native.OK:
            return int(out.value)
        if st == _native.ERR_OOM:
            raise _oom(self._oom_message(size))
        _native.check(st, f"malloc({size})")
        raise AssertionError("unreachable")

    def _oom_message(self, size: int) -> str:
        s = self.stats()
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        if self._call("oxygen_pool_mem_info", ctypes.byref(free), ctypes.byref(total)):
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
        ptr = int_arg("free pointer", ptr, 0, SIZE_MAX)
        if size is not None:
            size = int_arg("free size", size, 0, INT64_MAX)
        size, stream = -1 if size is None else size, _stream_handle(stream)
        owner = self._hold()
        st = _native.lib().oxygen_pool_free(owner.h, ptr, size, stream)
        if st == _native.ERR_FORKED:  # not a bad pointer: this pool cannot be used here at all
            _native.check(st, "free")
        return st == _native.OK

    def record_stream(self, ptr: int, stream: Any) -> None:
        """The live block at `ptr` is used on `stream` too (as torch.Tensor.record_stream): once
        freed, it is reused by no one before `stream` has passed the free (held meanwhile,
        counted in ``stats()['deferred_bytes']``). NativeError: not the start of a live block."""
        ptr = int_arg("record_stream pointer", ptr, 0, SIZE_MAX)
        st = self._call("oxygen_pool_record_stream", ptr, _stream_handle(stream))
        _native.check(st, "record_stream")

    def empty_cache(self) -> None:
        """Wait for the device, then unmap every page with nothing live and drop cached handles."""
        _native.check(self._call("oxygen_pool_empty_cache"), "empty_cache")

    def reset_peak(self) -> None:
        _native.check(self._call("oxygen_pool_reset_peak"), "reset_peak")

    def prepare(self, nbytes: int) -> None:
        """Create physical handles now for ``nbytes`` (growth then only maps)."""
        nbytes = int_arg("prepare nbytes", nbytes, 0, INT64_MAX)
        _native.check(self._call("oxygen_pool_prepare", nbytes), "prepare")

    def bench(self, size: int, iters: int, stream: Any = 0) -> float:
        """Nanoseconds per malloc+free pair, looped in C (no Python per call)."""
        size = int_arg("bench size", size, 0, INT64_MAX)
        iters = int_arg("bench iters", iters, 0, INT_MAX)
        ns = self._call("oxygen_pool_bench", size, iters, _stream_handle(stream))
        if ns < 0:
            raise _native.NativeError(_native.ERR_INVALID, f"bench: {_native.last_error()}")
        return float(ns)

    def stats(self) -> dict:
        return _derive(self._raw(), self.backend, self.device)

    def latency_histogram(self) -> list[int]:
        return _hist(self, "oxygen_pool_latency_hist")


def _hist(obj: _NativeObject, fn: str) -> list[int]:
    arr = (ctypes.c_uint64 * 16)()
    n = obj._call(fn, arr, 16)
    if n < 0:
        _native.check(-n, "reading the latency histogram")
    return list(arr[:n])


_arenas: weakref.WeakSet = weakref.WeakSet()
_held: weakref.WeakSet = weakref.WeakSet()  # _ArenaHandles of closed arenas that views keep


def live_arenas(device: int | None = None) -> list[Arena]:
    """The arenas not yet closed (on `device`, when given) of this process: in a forked child
    the parent's arenas refuse every call (csrc/fork.h), so they are not listed there."""
    pid = os.getpid()
    return [
        a
        for a in list(_arenas)
        if a._h and a._pid == pid and (device is None or a.device == device)
    ]


def held_arenas() -> list[_ArenaHandle]:
    """Arenas closed while tensors from ``as_tensor()`` still view them: their memory stays
    mapped (reading such a tensor must not fault) until the last of those tensors is dropped."""
    return list(_held)


class _ArenaHandle(_Handle):
    """The native arena, released when its last holder goes: the Arena until close(), every call
    in flight, and every tensor as_tensor() made. A view that outlives close() keeps the range
    mapped, because touching an unmapped page is fatal (a segfault here, a poisoned CUDA context
    on a GPU)."""

    def __init__(self, h: int, device: int):
        super().__init__(h, "oxygen_arena_destroy")
        lib = _native.lib()
        self.device, self.base = device, int(lib.oxygen_arena_base(h))
        self.page_size = int(lib.oxygen_arena_page_size(h))
        self.num_pages = int(lib.oxygen_arena_pages(h))
        self.capacity = self.num_pages * self.page_size

    def mapped_pages(self) -> int:
        return int(_native.lib().oxygen_arena_mapped_pages(self.h))

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.capacity,),
            "typestr": "|u1",
            "data": (self.base, False),
            "version": 3,
            "strides": None,
        }


class Arena(_NativeObject):
    """A reserved virtual range for the KV cache; its pages are mapped explicitly. Handles come
    from the device context shared with the global pool and count in the same mapped bytes.

    Touching an unmapped page is fatal (SIGSEGV on the host backend, an illegal address that
    poisons the CUDA context on a GPU): unmap only pages no kernel can still read."""

    def __init__(
        self,
        nbytes: int,
        backend: str = "auto",
        device: int = 0,
        page_size: int = DEFAULT_PAGE,
        reserve_fraction: float = 0.9,
    ):
        nbytes = int_arg("Arena size (bytes)", nbytes, 1, MAX_CAPACITY)
        args = (
            _check_page_size("Arena", page_size),
            nbytes,
            fraction_arg("Arena reserve_fraction", reserve_fraction),
        )
        self.device = int_arg("Arena device", device, 0, MAX_DEVICES - 1)
        self.backend = _resolve_backend(backend)
        what = f"creating a {self.backend} KV arena of {nbytes} bytes"
        owner = _ArenaHandle(_create(_native.lib().oxygen_arena_create, self, args, what), device)
        self.base, self.page_size = owner.base, owner.page_size
        self.num_pages, self.capacity = owner.num_pages, owner.capacity
        self._owner = owner
        self._pid = os.getpid()
        _arenas.add(self)

    def close(self) -> None:
        """Unmaps and releases the range -- once no tensor from as_tensor() views it any more;
        until then its memory stays mapped (leakcheck reports it as held by views)."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.closed = True
            _held.add(owner)  # gone from the set by itself once the last view is dropped
        del owner  # the last reference unless a view or a call holds one: the arena goes now

    def _pages_arg(self, what: str, first: int, count: int) -> tuple[int, int]:
        first = int_arg(f"arena {what} first page", first, 0, self.num_pages - 1)
        return first, int_arg(f"arena {what} count", count, 1, self.num_pages - first)

    def map_pages(self, first: int, count: int = 1) -> None:
        self._hold()
        first, count = self._pages_arg("map_pages", first, count)
        st = self._call("oxygen_arena_map", first, count)
        _native.check(st, f"arena map_pages({first}, {count})")

    def unmap_pages(self, first: int, count: int = 1) -> None:
        self._hold()
        first, count = self._pages_arg("unmap_pages", first, count)
        st = self._call("oxygen_arena_unmap", first, count)
        _native.check(st, f"arena unmap_pages({first}, {count})")

    def is_mapped(self, page: int) -> bool:
        self._hold()
        page = int_arg("arena is_mapped page", page, 0, self.num_pages - 1)
        r = self._call("oxygen_arena_is_mapped", page)
        if r < 0:
            _native.check(-r, f"arena is_mapped({page})")
        return bool(r)

    def mapped_pages(self) -> int:
        return int(self._call("oxygen_arena_mapped_pages"))

    def _raw(self) -> dict:
        return _read(functools.partial(self._call, "oxygen_arena_stats"))

    def stats(self) -> dict:
        return _derive(self._raw(), self.backend, self.device)

    def latency_histogram(self) -> list[int]:
        return _hist(self, "oxygen_arena_latency_hist")

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A flat tensor over the whole range, no copy: the one view of an arena as a tensor.

        The tensor (and every view of it) keeps the native arena alive, on both backends: after
        close() the memory under it stays mapped until it is dropped, so reading it never
        faults. cuda: through ``__cuda_array_interface__`` (torch asks the driver about the base
        address, so map page 0 first). host: over the mapping."""
        owner = self._hold()
        if self.backend == "cuda":
            t = torch.as_tensor(owner, device=torch.device("cuda", self.device))
        else:
            buf = (ctypes.c_byte * self.capacity).from_address(self.base)
            buf.oxygen_arena = owner  # torch.frombuffer holds `buf`, and so the tensor the owner
            t = torch.frombuffer(buf, dtype=torch.uint8, count=self.capacity)
        return t.view(dtype)

    @property
    def __cuda_array_interface__(self) -> dict:
        owner = self._hold()
        if self.backend != "cuda":
            raise AttributeError("__cuda_array_interface__ exists only on a cuda arena")
        return owner.__cuda_array_interface__
