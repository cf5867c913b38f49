"""Diagnostic for the H200: VirtualPool(cuda) malloc/free/empty_cache crashed (SIGSEGV) in
empty_cache on 2026-11-29. Run under cuda-gdb for a native backtrace; prints each step."""

import torch

from oxygen_torch.pool import VirtualPool

MiB = 1 << 20
torch.cuda.init()
stream = torch.cuda.current_stream()
with VirtualPool(backend="cuda", capacity=2 << 30) as pool:
    blocks = [(pool.malloc(n, stream), n) for n in (0, 4096, 700_000, 3 * MiB + 512, 64 * MiB)]
    print("malloc ok", pool.stats()["mapped_bytes"], flush=True)
    for ptr, n in blocks:
        pool.free(ptr, n, stream)
    print("free ok", flush=True)
    pool.empty_cache()
    print("empty_cache ok", pool.stats()["mapped_bytes"], flush=True)
print("closed ok", flush=True)
