"""How fast does one kernel move whole KV blocks across PCIe itself (transfer.COPIES "mapped"),
by grid size, and what does it cost a decode step beside it (issue 19)?

triton_kernels/block_rows.py reads a block's regions from the pool's arena and writes them into
pinned host rows through their device address (and back): no staging buffer, nothing queued on
the copy engines. This times it on the H200 for grids of 1 to 132 programs, 256 and 2,048 blocks
of the bench_tier migration pool's geometry (16 layers x 8 kv heads x 64, bf16, 16 tokens: 512
KiB a block), blocks in order and scattered, each way, beside one contiguous pinned copy of the
same bytes (the copy engine's peak) and the tier's gathers (the default way). Then, for a few
grids, a decode-like loop (a matmul chain of a 1.1B model's step on the current stream, timed
per step) alone and beside a thread moving 256 blocks down and up without pause by the kernel:
the step's rise from the kernel's SMs, HBM and PCIe traffic alone (the step ends reading one
element back, as generate()'s stopping check does), no Python of generate() in it.

    python benchmarks/diag_mapped_rows.py      (H200; writes $OUT/diag_mapped_rows.json)
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time

import torch
from bench_tier import scattered  # (benchmarks/ is the script's own directory)

MIB, GIB = 1 << 20, 1 << 30


def timed(fn, iters: int = 5) -> float:
    """Median seconds of fn over iters calls after one warm call, by CUDA events."""
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def main() -> None:
    from oxygen_torch.triton_kernels.block_rows import block_rows, mapped_view

    import oxygen_torch
    from oxygen_torch.kv import transfer
    from oxygen_torch.kv.pool import PoolKey, get_pool

    oxygen_torch.enable()
    dev = torch.device("cuda")
    pool = get_pool(PoolKey(dev, 16, 8, 64, torch.bfloat16, 16, "auto", 4 * GIB, 2 * MIB))
    view = pool.storage.block_view()
    bb = transfer._width(view)
    with pool.lock:
        blocks = pool.manager.allocate(4096)
    held = torch.tensor(blocks, device=dev)  # only allocated blocks' pages are mapped
    for c in (*pool.storage.k, *pool.storage.v):
        c.index_copy_(0, held, torch.randn(len(blocks), *c.shape[1:], device=dev).to(c.dtype))
    host = torch.empty(4096, bb, dtype=torch.uint8, pin_memory=True)
    alias = mapped_view(host, dev)
    out = {"block_bytes": bb, "rows": [], "tpot": []}

    # correctness first: every byte, both ways, scattered
    g = torch.Generator().manual_seed(0)
    pick = [blocks[i] for i in torch.randperm(4096, generator=g)[:300].tolist()]
    ids = torch.tensor(pick, device=dev)
    rows = torch.randperm(4096, generator=g)[:300].to(dev)
    block_rows([view], alias, ids, rows, False, 16)
    torch.cuda.synchronize()
    want = transfer.gather([view], ids).cpu()
    ok_down = torch.equal(host[rows.cpu()], want)
    scratch = torch.randperm(4096, generator=g)[:300].tolist()
    dst = torch.tensor([blocks[i] for i in scratch], device=dev)
    block_rows([view], alias, dst, rows, True, 16)
    torch.cuda.synchronize()
    ok_up = torch.equal(transfer.gather([view], dst).cpu(), want)
    out["byte_exact"] = ok_down and ok_up
    print(f"byte exact: down {ok_down}, up {ok_up}", flush=True)

    for n in (256, 2048):
        nbytes = n * bb
        dense = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        flat = host.view(-1)[:nbytes]
        peak_d = timed(lambda f=flat, d=dense: f.copy_(d, non_blocking=True))
        peak_u = timed(lambda f=flat, d=dense: d.copy_(f, non_blocking=True))
        print(f"{n} blocks: pinned copy peak down {nbytes / peak_d / 1e9:.1f} GB/s, up "
              f"{nbytes / peak_u / 1e9:.1f}", flush=True)  # fmt: skip
        for order in ("consecutive", "scattered"):
            sel = blocks[:n] if order == "consecutive" else scattered(blocks[: 2 * n])
            ids = torch.tensor(sel, device=dev)
            rr = torch.arange(n, device=dev)
            for programs in (1, 2, 4, 8, 16, 32, 132):

                def move(up, i=ids, r=rr, p=programs):
                    block_rows([view], alias, i, r, up, p)

                td, tu = timed(lambda: move(False)), timed(lambda: move(True))
                row = dict(blocks=n, order=order, programs=programs,
                           down_GBps=nbytes / td / 1e9, up_GBps=nbytes / tu / 1e9,
                           peak_down_GBps=nbytes / peak_d / 1e9,
                           peak_up_GBps=nbytes / peak_u / 1e9)  # fmt: skip
                out["rows"].append(row)
                print(f"  {order} x{programs}: down {row['down_GBps']:.1f} GB/s, up "
                      f"{row['up_GBps']:.1f}", flush=True)  # fmt: skip
        del dense

    # a decode-like step: 22 layers of a 1.1B model's matmuls at batch 16 (no Python of
    # generate() in it: the SMs' and HBM's share alone), timed per step by events
    w = [torch.randn(2048, 2048 * 4, device=dev, dtype=torch.bfloat16) for _ in range(22)]
    x = torch.randn(16, 2048, device=dev, dtype=torch.bfloat16)

    def step():  # ... ending as generate()'s step does: one element read back by the host
        y = x
        for m in w:
            y = (y @ m)[:, :2048]
        return y[0, 0].item()

    def per_step() -> float:
        return timed(step, 50)

    ids = torch.tensor(blocks[:256], device=dev)
    rr = torch.arange(256, device=dev)
    for programs in (1, 2, 4, 8, 16):
        alone = per_step()
        stop, moved = threading.Event(), [0]

        def churn(programs=programs, stop=stop, moved=moved):
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                while not stop.is_set():
                    block_rows([view], alias, ids, rr, False, programs)
                    block_rows([view], alias, ids, rr, True, programs)
                    s.synchronize()
                    moved[0] += 2 * 256 * bb

        th = threading.Thread(target=churn, daemon=True)
        t0 = time.perf_counter()
        th.start()
        busy = per_step()
        stop.set()
        th.join()
        gbps = moved[0] / (time.perf_counter() - t0) / 1e9
        row = dict(programs=programs, step_ms_alone=alone * 1e3, step_ms_beside=busy * 1e3,
                   rise=busy / alone - 1, moved_GBps=gbps)  # fmt: skip
        out["tpot"].append(row)
        print(f"step x{programs}: {alone * 1e3:.3f} ms alone, {busy * 1e3:.3f} beside "
              f"({gbps:.1f} GB/s moved): {100 * row['rise']:+.1f} %", flush=True)  # fmt: skip
    path = os.path.join(os.environ.get("OUT", "."), "diag_mapped_rows.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
