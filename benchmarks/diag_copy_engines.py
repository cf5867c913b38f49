"""Why a decode step slows beside migration (issue 19): the copy engines or the host?

Measures on the GPU, each beside the same thing with no traffic:
1. the latency of the small copies a decode step makes (a 4 KiB pinned host-to-device copy, a
   one-element device-to-host read as generate()'s stopping check does) and of the same moves
   done by a kernel reading / writing mapped pinned memory (no copy engine), while a thread
   streams 16 MiB pinned copies down, up, or both;
2. the bandwidth of such a kernel over 256 MiB (could migration itself avoid the copy engines?);
3. generate()'s time per output token (B=16, P=512) beside copies down only, up only, both.

    python benchmarks/diag_copy_engines.py      (H200; writes $OUT/diag_copy_engines.json)
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

MIB = 1 << 20
PIECE = 16 * MIB
TRAFFIC = 128 * MIB


@triton.jit
def _copy_words(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def kernel_copy(dst: torch.Tensor, src: torch.Tensor, block: int = 1024) -> None:
    n = src.numel()
    _copy_words[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block)


TILE = 1024


@triton.jit
def _blocks_to_rows(
    src, idx, dst, rows, n, regions, width, s_block, s_region, s_row, TILE: tl.constexpr
):
    tiles = tl.cdiv(width, TILE)
    total = n * regions * tiles
    offs = tl.arange(0, TILE)
    for item in range(tl.program_id(0), total, tl.num_programs(0)):
        t = item % tiles
        r = (item // tiles) % regions
        i = item // (tiles * regions)
        b = tl.load(idx + i).to(tl.int64)
        row = tl.load(rows + i).to(tl.int64)
        col = t * TILE + offs
        m = col < width
        x = tl.load(src + b * s_block + r * s_region + col, mask=m)
        tl.store(dst + row * s_row + r * width + col, x, mask=m)


def blocks_to_rows(view, idx, dst, rows, programs: int) -> None:
    """dst[rows[i]] = every region of block idx[i] of `view` [N, R, W], stored by `programs`
    programs walking (block, region, tile) items: into pinned host rows, no copy engine."""
    n, (_, regions, width) = idx.numel(), view.shape
    grid = (max(1, min(programs, n * regions * triton.cdiv(width, TILE))),)
    _blocks_to_rows[grid](
        view, idx, dst, rows, n, regions, width,
        view.stride(0), view.stride(1), dst.stride(0), TILE=TILE,
    )  # fmt: skip


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Traffic:
    """A thread streaming PIECE-sized pinned copies on its own stream: 'down', 'up' or 'both';
    'kdown': the same bytes down by the tier's kernel (16 programs storing into pinned rows),
    'kdown_up': that, then up by copies; 'down_paced': copies down, a small kernel on another
    stream between two (as transfer.PACE_DOWN does)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.dense = torch.empty(TRAFFIC, dtype=torch.uint8, device="cuda")
        self.host = torch.empty(TRAFFIC, dtype=torch.uint8, pin_memory=True)
        self.stop = threading.Event()
        self.moved = 0

    def _run(self):
        s = torch.cuda.Stream()
        n = TRAFFIC // (512 << 10)
        view = self.dense.view(torch.int64).view(n, 1, -1)
        rows = self.host.view(torch.int64).view(n, -1)
        gap, tiny = torch.cuda.Stream(), torch.zeros(1, device="cuda")
        with torch.cuda.stream(s):
            idx = torch.arange(n, device="cuda")
            while not self.stop.is_set():
                if self.kind.startswith("kdown"):
                    blocks_to_rows(view, idx, rows, idx, 16)
                for lo in range(0, TRAFFIC, PIECE):
                    if self.kind == "down_paced":  # as transfer.PACE_DOWN: a kernel between
                        gap.wait_stream(s)
                        with torch.cuda.stream(gap):
                            tiny.add_(1)
                        s.wait_stream(gap)
                    if self.kind in ("down", "both", "down_paced"):
                        self.host[lo : lo + PIECE].copy_(self.dense[lo : lo + PIECE], True)
                    if self.kind in ("up", "both", "kdown_up"):
                        self.dense[lo : lo + PIECE].copy_(self.host[lo : lo + PIECE], True)
                s.synchronize()
                self.moved += TRAFFIC * (2 if self.kind in ("both", "kdown_up") else 1)

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.th.join()
        self.gbps = self.moved / (time.perf_counter() - self.t0) / 1e9


def latencies(n: int = 300) -> dict:
    small_host = torch.arange(1024, dtype=torch.int32).pin_memory()
    small_dev = torch.empty(1024, dtype=torch.int32, device="cuda")
    flag_dev = torch.zeros(2, dtype=torch.int32, device="cuda")
    flag_host = torch.zeros(2, dtype=torch.int32).pin_memory()
    ev = torch.cuda.Event()

    def h2d_copy():
        small_dev.copy_(small_host, non_blocking=True)
        ev.record()
        ev.synchronize()

    def h2d_kernel():
        kernel_copy(small_dev, small_host)
        ev.record()
        ev.synchronize()

    def d2h_item():
        bool(flag_dev[0] == 0)

    def d2h_kernel():
        kernel_copy(flag_host, flag_dev, block=2)
        ev.record()
        ev.synchronize()

    ops = dict(h2d_copy=h2d_copy, h2d_kernel=h2d_kernel, d2h_item=d2h_item, d2h_kernel=d2h_kernel)
    for f in ops.values():
        for _ in range(20):
            f()
    assert torch.equal(small_dev.cpu(), small_host)
    out = {}
    for traffic in ("none", "down", "down_paced", "kdown"):
        ctx = Traffic(traffic) if traffic != "none" else contextlib.nullcontext()
        with ctx as tr:
            for name, f in ops.items():
                ts = []
                for _ in range(n):
                    t = time.perf_counter()
                    f()
                    ts.append((time.perf_counter() - t) * 1e6)
                    time.sleep(0.0002)
                out[f"{traffic}/{name}"] = dict(p50_us=pct(ts, 0.5), p90_us=pct(ts, 0.9))
        gb = tr.gbps if traffic != "none" else 0.0
        print(f"traffic {traffic} ({gb:.1f} GB/s): " + ", ".join(
            f"{k.split('/')[1]} p50 {v['p50_us']:.0f} p90 {v['p90_us']:.0f} us"
            for k, v in out.items() if k.startswith(traffic + "/")
        ), flush=True)  # fmt: skip
    return out


def kernel_bandwidth() -> dict:
    nbytes = 256 * MIB
    dev = torch.randint(0, 1 << 30, (nbytes // 8,), dtype=torch.int64, device="cuda")
    host = torch.empty(nbytes // 8, dtype=torch.int64).pin_memory()
    out = {}
    for block in (1024, 4096):
        for name, (dst, src) in (("d2h", (host, dev)), ("h2d", (dev, host))):
            kernel_copy(dst, src, block)
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                t = time.perf_counter()
                kernel_copy(dst, src, block)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
            out[f"kernel_{name}_block{block}_GBps"] = nbytes / statistics.median(ts) / 1e9
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    out["copy_engine_d2h_GBps"] = nbytes / statistics.median(ts) / 1e9
    assert torch.equal(host, dev.cpu())
    print("bandwidth: " + ", ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
    return out


def tpot() -> dict:
    import bench_tier

    import oxygen_torch

    oxygen_torch.enable()
    model = bench_tier.build_model()
    ids = bench_tier.prompts(16, 512)

    def gen(new):
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False)  # fmt: skip

    def one():
        gen(128)
        t1 = statistics.median(bench_tier.timed(lambda: gen(1))[1] for _ in range(3))
        tn = statistics.median(bench_tier.timed(lambda: gen(128))[1] for _ in range(3))
        return (tn - t1) / 127 * 1e3

    alone = one()
    out = {"alone_ms": alone}
    for traffic in ("down", "down_paced", "up", "both"):
        with Traffic(traffic) as tr:
            t = one()
        out[traffic] = dict(ms=t, rise=t / alone - 1, GBps=tr.gbps)
        print(f"TPOT alone {alone:.2f} ms; beside {traffic} ({tr.gbps:.1f} GB/s) {t:.2f} ms: "
              f"{100 * (t / alone - 1):+.1f} %", flush=True)  # fmt: skip
    return out


def tier_host() -> dict:
    """The host's own time in the tier's moves (no other thread): a cycle of 256 blocks down,
    up, released, waited for, under cProfile."""
    import cProfile
    import io
    import pstats

    from oxygen_torch.kv.pool import PoolKey, get_pool

    key = PoolKey(torch.device("cuda"), 16, 8, 64, torch.bfloat16, 16, "auto", 1 << 30, 2 << 20)
    pool = get_pool(key)
    tier = pool.cpu_tier(300 * pool.block_bytes())
    with pool.lock:
        blocks = pool.manager.allocate(256)

    def cycle():
        slots = tier.down(blocks)
        tier.up(slots, blocks)
        tier.release(slots)
        tier.wait()

    for _ in range(3):
        cycle()
    t = time.perf_counter()
    for _ in range(10):
        cycle()
    wall = (time.perf_counter() - t) / 10
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(10):
        cycle()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"tier cycle alone: {wall * 1e3:.2f} ms wall\n{buf.getvalue()}", flush=True)
    return {"cycle_ms": wall * 1e3}


def main():
    res = {"tpot": tpot()}  # first: enable() comes before the first CUDA allocation
    res.update(latency=latencies(), bandwidth=kernel_bandwidth(), tier_host=tier_host())
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "diag_copy_engines.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
