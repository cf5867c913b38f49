"""Loads ``_oxygen.so`` (the native pool) with ctypes and turns its status codes into exceptions.

The library links neither torch nor the CUDA driver: it opens ``libcuda.so.1`` itself when a cuda
backend is asked for, so loading it always works on a CPU-only machine.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import operator
from pathlib import Path

LIB_PATH = Path(__file__).resolve().parent.parent / "_oxygen.so"

# Status codes of csrc/vmm_backend.h
OK = 0
ERR_NO_DRIVER = 1
ERR_DRIVER = 2
ERR_NO_DEVICE = 3
ERR_INVALID = 4
ERR_OOM = 5
ERR_OS = 6
ERR_UNSUPPORTED = 7
ERR_FORKED = 8
ERR_INTERNAL = 9

STATUS_NAMES = {
    ERR_NO_DRIVER: "no CUDA driver",
    ERR_DRIVER: "CUDA driver error",
    ERR_NO_DEVICE: "no such device",
    ERR_INVALID: "invalid argument",
    ERR_OOM: "out of memory",
    ERR_OS: "operating-system error",
    ERR_UNSUPPORTED: "unsupported",
    ERR_FORKED: "created before fork()",
    ERR_INTERNAL: "internal error",
}

# Bounds of the C types the wrappers pass: ctypes converts a Python int by wrapping it silently
# (2**64 as int64_t is 0, -1 as size_t is 2**64 - 1), so every integer is checked against these
# first (int_arg).
SIZE_MAX = (1 << 64) - 1
INT64_MAX = (1 << 63) - 1
INT_MAX = (1 << 31) - 1
MAX_DEVICES = 64  # kMaxDevices in csrc/pool_capi.cpp


class NativeLibraryError(RuntimeError):
    """The native library is missing or could not be loaded."""


class NativeError(RuntimeError):
    """A call into the native library failed; ``status`` is the code from vmm_backend.h."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@functools.cache
def lib() -> ctypes.CDLL:
    """The loaded library, with argument types declared. Raises NativeLibraryError if missing."""
    if not LIB_PATH.is_file():
        raise NativeLibraryError(
            f"oxygen_torch's native library is missing ({LIB_PATH}). The package was not built: "
            "reinstall with `pip install -e .` (or `pip install .`) from the source tree; the "
            "build needs a C++17 compiler and `nvidia-cuda-runtime-cu12` for cuda.h."
        )
    try:
        so = ctypes.CDLL(str(LIB_PATH))
    except OSError as exc:
        raise NativeLibraryError(f"could not load {LIB_PATH}: {exc}") from exc
    _declare(so)
    # Stop the pool's background threads before the interpreter (and the driver) shut down.
    atexit.register(so.oxygen_shutdown)
    return so


def _declare(so: ctypes.CDLL) -> None:
    c = ctypes
    so.oxygen_version.restype = c.c_char_p
    so.oxygen_last_error.restype = c.c_char_p
    so.oxygen_cuda_probe.argtypes = [c.POINTER(c.c_int), c.POINTER(c.c_int)]
    so.oxygen_cuda_device_info.argtypes = [
        c.c_int,
        c.c_char_p,
        c.c_size_t,
        c.POINTER(c.c_size_t),
        c.POINTER(c.c_size_t),
        c.POINTER(c.c_size_t),
        c.POINTER(c.c_int),
    ]
    so.oxygen_backend_selftest.argtypes = [c.c_char_p, c.c_int, c.c_size_t, c.POINTER(c.c_size_t)]
    so.oxygen_backend_map_probe.argtypes = [
        c.c_char_p, c.c_int, c.c_size_t, c.c_size_t, c.c_int, c.POINTER(c.c_uint64)
    ]  # fmt: skip
    _declare_pool(so)


def _declare_pool(so: ctypes.CDLL) -> None:
    """The pool's functions (csrc/pool_capi.cpp, csrc/arena.cpp)."""
    c = ctypes
    vp, sz, u64, i64 = c.c_void_p, c.c_size_t, c.c_uint64, c.c_int64
    u64p = c.POINTER(c.c_uint64)
    sig = {
        "oxygen_configure": (c.c_int, [c.c_char_p, sz, c.c_double, sz, sz, sz, u64, c.c_int]),
        "oxygen_malloc": (vp, [c.c_ssize_t, c.c_int, vp]),
        "oxygen_free": (None, [vp, c.c_ssize_t, c.c_int, vp]),
        "oxygen_global_pool": (vp, [c.c_int]),
        "oxygen_pool_create": (
            c.c_int,
            [c.c_char_p, c.c_int, sz, sz, c.c_double, sz, sz, u64, c.POINTER(vp)],
        ),
        "oxygen_pool_destroy": (c.c_int, [vp]),
        "oxygen_pool_malloc": (c.c_int, [vp, i64, vp, c.POINTER(vp)]),
        "oxygen_pool_free": (c.c_int, [vp, vp, i64, vp]),
        "oxygen_pool_record_stream": (c.c_int, [vp, vp, vp]),
        "oxygen_pool_empty_cache": (c.c_int, [vp]),
        "oxygen_pool_reset_peak": (c.c_int, [vp]),
        "oxygen_pool_set_lending": (c.c_int, [vp, c.c_int]),
        "oxygen_configure_lending": (c.c_int, [c.c_int]),
        "oxygen_pool_prepare": (c.c_int, [vp, sz]),
        "oxygen_pool_mem_info": (c.c_int, [vp, c.POINTER(sz), c.POINTER(sz)]),
        "oxygen_pool_backend": (c.c_char_p, [vp]),
        "oxygen_pool_device": (c.c_int, [vp]),
        "oxygen_pool_base": (u64, [vp]),
        "oxygen_stats_names": (c.c_char_p, []),
        "oxygen_pool_stats": (c.c_int, [vp, u64p, c.c_int]),
        "oxygen_pool_latency_hist": (c.c_int, [vp, u64p, c.c_int]),
        "oxygen_pool_bench": (c.c_double, [vp, i64, c.c_int, vp]),
        "oxygen_capture_begin": (u64, []),
        "oxygen_capture_end": (None, [u64]),
        "oxygen_capture_release": (None, [u64]),
        "oxygen_capture_maybe_active": (c.c_int, []),
        "oxygen_shutdown": (None, []),
        "oxygen_set_virtual_clock": (None, [u64]),
        "oxygen_host_hold_events": (None, [c.c_int]),
        "oxygen_host_set_event_lag": (None, [u64]),
        "oxygen_host_set_create_delay": (None, [u64]),
        "oxygen_host_set_unmap_delay": (None, [u64]),
        "oxygen_pageset_selftest": (c.c_int, [u64, c.c_int, c.c_int]),
        "oxygen_host_set_capture": (None, [vp, u64]),
        "oxygen_arena_create": (c.c_int, [c.c_char_p, c.c_int, sz, sz, c.c_double, c.POINTER(vp)]),
        "oxygen_arena_destroy": (c.c_int, [vp]),
        "oxygen_arena_base": (u64, [vp]),
        "oxygen_arena_pages": (sz, [vp]),
        "oxygen_arena_page_size": (sz, [vp]),
        "oxygen_arena_map": (c.c_int, [vp, sz, sz]),
        "oxygen_arena_unmap": (c.c_int, [vp, sz, sz]),
        "oxygen_arena_is_mapped": (c.c_int, [vp, sz]),
        "oxygen_arena_mapped_pages": (sz, [vp]),
        "oxygen_arena_stats": (c.c_int, [vp, u64p, c.c_int]),
        "oxygen_arena_latency_hist": (c.c_int, [vp, u64p, c.c_int]),
    }
    for name, (restype, argtypes) in sig.items():
        fn = getattr(so, name)
        fn.restype = restype
        fn.argtypes = argtypes


def describe_int(value: int) -> str:
    """An integer as an error message can show it: Python refuses str() of one past 4,300 digits,
    and a number of a few hundred digits says less than its size does."""
    if value.bit_length() <= 128:
        return str(value)
    return f"an integer of {value.bit_length()} bits (about 2**{value.bit_length() - 1})"


def int_arg(what: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi] before it becomes a C argument; raises TypeError (not an
    integer, or a bool) or ValueError (out of range), naming ``what`` and the allowed range."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be an integer, got {type(value).__name__} {value!r:.80}")
    v = operator.index(value)
    if not lo <= v <= hi:
        raise ValueError(f"{what} = {describe_int(v)} is out of range; allowed: {lo} to {hi}")
    return v


def fraction_arg(what: str, value: object) -> float:
    """A share in (0, 1] (reserve_fraction) as a C double."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r:.80}")
    if not 0 < value <= 1:  # also false for NaN
        raise ValueError(f"{what} = {value!r} is out of range; allowed: (0, 1]")
    return float(value)


def last_error() -> str:
    return lib().oxygen_last_error().decode(errors="replace")


def check(status: int, what: str) -> None:
    """Raise NativeError for a non-zero status, with the library's own explanation."""
    if status != OK:
        kind = STATUS_NAMES.get(status, f"status {status}")
        raise NativeError(status, f"{what}: {kind}: {last_error()}")


def version() -> str:
    return lib().oxygen_version().decode()


def cuda_probe() -> tuple[int, int]:
    """(driver_version, device_count). Raises NativeError(ERR_NO_DRIVER) without a driver."""
    ver, count = ctypes.c_int(), ctypes.c_int()
    check(lib().oxygen_cuda_probe(ctypes.byref(ver), ctypes.byref(count)), "CUDA driver probe")
    return ver.value, count.value


def cuda_device_info(device: int) -> dict:
    name = ctypes.create_string_buffer(256)
    gran, free, total = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
    vmm = ctypes.c_int()
    check(
        lib().oxygen_cuda_device_info(
            device,
            name,
            256,
            ctypes.byref(gran),
            ctypes.byref(free),
            ctypes.byref(total),
            ctypes.byref(vmm),
        ),
        f"CUDA device {device} info",
    )
    return {
        "name": name.value.decode(),
        "granularity": gran.value,
        "free_bytes": free.value,
        "total_bytes": total.value,
        "vmm_supported": bool(vmm.value),
    }


MAP_PROBE_CALLS = ("create", "map", "set_access", "unmap", "release")


def backend_map_probe(kind: str, handle_bytes: int, total_bytes: int = 1 << 30, device: int = 0,
                      access_each: bool = False) -> dict:  # fmt: skip
    """The backend's calls timed for `total_bytes` as handles of `handle_bytes` each, mapped side
    by side in one fresh reserved range and then undone: seconds spent in each of
    MAP_PROBE_CALLS over all the handles (set_access: one call over the range, or one a handle
    with `access_each`). What growth by `total_bytes` costs with handles of that size on this
    machine (benchmarks/bench_allocator.py --map-probe)."""
    out = (ctypes.c_uint64 * len(MAP_PROBE_CALLS))()
    check(
        lib().oxygen_backend_map_probe(
            kind.encode(), device, handle_bytes, total_bytes, int(access_each), out
        ),
        f"{kind} backend map probe ({handle_bytes} B handles, {total_bytes} B)",
    )
    return {name: out[k] / 1e9 for k, name in enumerate(MAP_PROBE_CALLS)}


def backend_selftest(kind: str, device: int = 0, page_size: int = 2 << 20) -> int:
    """Run one reserve/create/map/access/unmap/release cycle; returns the backend's granularity."""
    gran = ctypes.c_size_t()
    check(
        lib().oxygen_backend_selftest(kind.encode(), device, page_size, ctypes.byref(gran)),
        f"{kind} backend self-test",
    )
    return gran.value
