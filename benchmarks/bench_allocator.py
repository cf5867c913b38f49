"""The pool against PyTorch's allocators on the GPU, side by side in one run (H200):

1. malloc+free latency, 4 KiB ... 64 MiB: torch.empty + del (Python) under the default caching
   allocator and under the pool (global route); the pool also from C (a loop in the library, no
   Python per call) and through ctypes (one Python call per malloc and per free: overhead
   included), next to torch.cuda.caching_allocator_alloc/delete from Python.
2. The mixed HF generate() workload (benchmarks/mixed_workload.py) in three processes: default,
   expandable_segments:True, oxygen: peak allocated, peak reserved/mapped, fragmentation, memory
   still held after, tokens/s.
3. Growth: time on the allocating thread to make 1 GiB more usable, with handles prepared ahead
   (map + set-access only) and without (create too); cudaMalloc of 1 GiB for reference.

Every measurement runs in its own child process (the global route must be installed before CUDA
initialises). Prints a table last; writes bench_allocator.json and bench_allocator.md to $OUT.

    python benchmarks/bench_allocator.py [--calls 14] [--skip-workload] [--allocators oxygen ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from oxygen_torch.tools.progress import progress

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIZES = [4 << 10, 64 << 10, 1 << 20, 2 << 20, 16 << 20, 64 << 20]
ENABLE = (
    "import types; from oxygen_torch import pool as allocator; allocator.enable_allocator("
    "__import__('oxygen_torch.config').config.PoolConfig())"
)


def child(code: str, env_extra: dict | None = None, timeout: int = 600) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


LATENCY = """
import json, time, ctypes, torch
{enable}
SIZES = {sizes}
def per_pair(fn, n):
    for _ in range(50): fn()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e6
res = {{}}
for sz in SIZES:
    empty = lambda: torch.empty(sz, dtype=torch.uint8, device="cuda")
    res[f"torch.empty {{sz}}"] = per_pair(empty, 20000)
    s = torch.cuda.current_stream()
    if {oxygen}:
        from oxygen_torch.pool import native as _native
        lib = _native.lib(); h = lib.oxygen_global_pool(0); st = s.cuda_stream
        res[f"C loop {{sz}}"] = lib.oxygen_pool_bench(h, sz, 20000, st) / 1e3
        pair = lambda: lib.oxygen_free(lib.oxygen_malloc(sz, 0, st), sz, 0, st)
        res[f"ctypes {{sz}}"] = per_pair(pair, 20000)
    else:
        cm = torch.cuda.memory
        pair = lambda: cm.caching_allocator_delete(cm.caching_allocator_alloc(sz, 0, s))
        res[f"caching_allocator_alloc {{sz}}"] = per_pair(pair, 20000)
print(json.dumps(res))
"""

GROWTH = """
import json, time, torch
from oxygen_torch.pool import VirtualPool
torch.cuda.init()
GiB = 1 << 30
res = {}
with VirtualPool("cuda", capacity=8 * GiB, high_pages=4) as pool:
    pool.malloc(1 << 20); torch.cuda.synchronize()       # context, refill thread, first page
    for prepared in (True, False, True):
        pool.empty_cache()
        if prepared:
            pool.prepare(GiB); time.sleep(0.05)
        m0 = pool.stats()["num_maps"]
        t = time.perf_counter(); p = pool.malloc(GiB); dt = time.perf_counter() - t
        key = "prepared" if prepared else "cold"
        res[f"growth_1GiB_{key}_ms"] = min(dt * 1e3, res.get(f"growth_1GiB_{key}_ms", 1e9))
        res[f"pages_mapped_{key}"] = pool.stats()["num_maps"] - m0
        pool.free(p)
    s = pool.stats()
    res["mean_map_latency_us"] = s["mean_map_latency_us"]
    res["mean_unmap_latency_us"] = s["mean_unmap_latency_us"]
    res["map_hist"] = pool.latency_histogram()
torch.cuda.synchronize(); torch.cuda.empty_cache()
t = time.perf_counter()
x = torch.empty(GiB, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
res["torch_cudaMalloc_1GiB_ms"] = (time.perf_counter() - t) * 1e3
print(json.dumps(res))
"""


def bench_latency() -> dict:
    default = child(LATENCY.format(enable="", sizes=SIZES, oxygen=False))
    oxygen = child(LATENCY.format(enable=ENABLE, sizes=SIZES, oxygen=True))
    return {"default": default, "oxygen": oxygen}


WORKLOAD_ALLOCATORS = ("default", "expandable", "oxygen")


def bench_workload(calls: int, allocators=WORKLOAD_ALLOCATORS) -> dict:
    out = {}
    for mode in progress(allocators, "mixed workload"):
        code = (
            f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import mixed_workload as m; "
            f"print(json.dumps(m.run({mode!r}, {calls})))"
        )
        t = time.perf_counter()
        out[mode] = child(code, timeout=900)
        out[mode]["wall_s"] = round(time.perf_counter() - t, 1)
        print(f"workload {mode}: {out[mode]}", flush=True)
    return out


def table(r: dict) -> str:
    lines = ["## 1. malloc+free latency (us per pair)", "",
             "| size | torch.empty default | torch.empty oxygen | ratio | caching_allocator_alloc "
             "(py) | oxygen ctypes | oxygen C loop |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    d, o = r["latency"]["default"], r["latency"]["oxygen"]
    for sz in SIZES:
        td, to = d.get(f"torch.empty {sz}"), o.get(f"torch.empty {sz}")
        ratio = f"{to / td:.2f}x" if td and to else "-"
        cells = [
            d.get(f"caching_allocator_alloc {sz}"),
            o.get(f"ctypes {sz}"),
            o.get(f"C loop {sz}"),
        ]
        fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else "-"  # noqa: E731
        lines.append(f"| {sz >> 10} KiB | {fmt(td)} | {fmt(to)} | {ratio} | "
                     + " | ".join(fmt(c) for c in cells) + " |")  # fmt: skip
    if "workload" in r:
        lines += ["", "## 2. mixed generate() workload", "",
                  "| allocator | peak alloc GiB | peak reserved/mapped GiB | fragmentation % "
                  "| held after GiB (now / +100 ms) | tok/s |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for mode, w in r["workload"].items():
            if "error" in w:
                lines.append(f"| {mode} | error: {w['error'][-200:]!r} |||||")
                continue
            lines.append(f"| {mode} | {w['peak_alloc_GiB']} | {w['peak_reserved_GiB']} | "
                         f"{w['frag_pct']} | {w['end_reserved_GiB']} / "
                         f"{w['end_reserved_100ms_GiB']} | {w['tok_per_s']} |")  # fmt: skip
    g = r["growth"]
    lines += ["", "## 3. growth: 1 GiB more usable on the allocating thread", "",
              f"- handles prepared ahead (map + set-access only): "
              f"{g.get('growth_1GiB_prepared_ms', float('nan')):.2f} ms "
              f"({g.get('pages_mapped_prepared')} pages); goal < 2 ms",
              f"- cold (create + map + set-access): "
              f"{g.get('growth_1GiB_cold_ms', float('nan')):.2f} ms",
              f"- torch cudaMalloc 1 GiB (empty cache): "
              f"{g.get('torch_cudaMalloc_1GiB_ms', float('nan')):.2f} ms",
              f"- mean per-page map {g.get('mean_map_latency_us', 0):.1f} us, unmap "
              f"{g.get('mean_unmap_latency_us', 0):.1f} us"]  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=14, help="generate() calls (anchor: 14)")
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument("--allocators", nargs="+", default=list(WORKLOAD_ALLOCATORS),
                    choices=WORKLOAD_ALLOCATORS,
                    help="which allocators run the workload (each ~2 min on the H200)")  # fmt: skip
    args = ap.parse_args()
    t0 = time.perf_counter()
    r = {"latency": bench_latency()}
    print(f"latency: {r['latency']}", flush=True)
    r["growth"] = child(GROWTH)
    print(f"growth: {r['growth']}", flush=True)
    if not args.skip_workload:
        r["workload"] = bench_workload(args.calls, args.allocators)
    r["seconds"] = round(time.perf_counter() - t0, 1)
    md = table(r)
    print("\n" + md)
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"])
        (out / "bench_allocator.json").write_text(json.dumps(r, indent=1))
        (out / "bench_allocator.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
