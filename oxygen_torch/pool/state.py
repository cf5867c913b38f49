"""Where the routes onto the pool stand (route.py changes it, stats.py reads the backend)."""

from __future__ import annotations


class _Route:
    enabled = False  # enable_allocator() ran
    installed = False  # the CUDAPluggableAllocator is PyTorch's current allocator
    backend = "host"
    pluggable = None  # torch.cuda.memory.CUDAPluggableAllocator, kept alive
    saved_allocator = None  # PyTorch's allocator before enable (restorable until CUDA init)
    configured = False  # oxygen_configure ran
    pools: list = []  # MemPools of the pool() route, kept alive with their segments


_route = _Route()
