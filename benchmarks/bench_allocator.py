"""The VMM pool against PyTorch's allocators, side by side in one run.

On the GPU (H200), each measurement in its own child process (the global route must be
installed before CUDA initialises):

1. malloc+free latency, 4 KiB ... 64 MiB: torch.empty + del (Python) under the default caching
   allocator (the anchor) and under the pool (global route), with the ratio; the pool also from
   C (a loop in the library, no Python per call) and through ctypes (one Python call per malloc
   and per free), next to torch.cuda.caching_allocator_alloc/delete from Python.
2. Mixed generate() workloads (workloads.py) in one process per allocator: default,
   expandable_segments:True (the anchor), oxygen: peak allocated, peak reserved/mapped,
   fragmentation (1 - peak allocated / peak reserved), memory still held after, tokens/s and
   oxygen's over expandable's. --seeds picks the family's workloads (default 0-7; none with
   `--seeds` alone), --anchor adds the anchor's 14-call workload, --calls keeps the first N calls.
   OXYGEN_HYSTERESIS_MS=2 runs the oxygen process with that pool.hysteresis_ms.
3. Growth: time on the allocating thread to make 1 GiB more usable, with handles prepared ahead
   (map + set-access only) and without (create too), beside cudaMalloc of 1 GiB; goal < 2 ms.

On the CPU, --host runs the host backend's side instead (host_random.py), every block's content
checked: each seed's trace cut to --layers and --max-new (fragmentation per seed and the worst);
--threads x --ops random malloc/free of 512 B - 45 MiB (goal: no corruption, mapped back to 0,
fragmentation <= 5 %); and the trace recorded from generate() on the H200
(tests/data/generate_trace.jsonl.gz) paced at its recorded rate for each --hysteresis-ms: maps a
decode step beside the 2 ms row's; --latency adds malloc+free from C on a host-backend pool per
size (the pool's own cost, the part of the GPU's C loop column a CPU can measure). --dry-run
prints each seed's workload and the plan.

Prints a table last; with $OUT set, writes bench_allocator.json and bench_allocator.md there.

    python benchmarks/bench_allocator.py                      # H200, ~2 min per allocator a seed
    python benchmarks/bench_allocator.py --anchor --seeds --calls 7 --allocators expandable oxygen
    python benchmarks/bench_allocator.py --host               # CPU: seeds, random threads, pacing
    python benchmarks/bench_allocator.py --host --threads 4 --ops 3000 --hysteresis-ms 2 20
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
sys.path.insert(0, str(HERE))
import host_random  # noqa: E402  (this folder: the CPU side)
import workloads  # noqa: E402

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


def bench_workload(calls: int | None, allocators=workloads.ALLOCATORS, seeds=(None,)) -> dict:
    """{seed name: {allocator: figures}}; seed None is the anchor workload."""
    out: dict = {}
    for seed in seeds:
        name = "anchor" if seed is None else f"seed {seed}"
        out[name] = {}
        for mode in progress(allocators, f"mixed workload, {name}"):
            code = (
                f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import workloads as w; "
                f"print(json.dumps(w.run({mode!r}, {calls!r}, {seed!r})))"
            )
            t = time.perf_counter()
            out[name][mode] = r = child(code, timeout=900)
            r["wall_s"] = round(time.perf_counter() - t, 1)
            print(f"workload {name} {mode}: {r}", flush=True)
    return out


def worst(per_seed: dict, key: str = "frag_pct") -> dict:
    """{allocator: (worst value of key, seed name)} over the seeds that ran without error."""
    out: dict = {}
    for name, runs in per_seed.items():
        for mode, r in runs.items():
            if key in r and (mode not in out or r[key] > out[mode][0]):
                out[mode] = (r[key], name)
    return out


def replay_host(seeds, layers: int, max_new: int) -> dict:
    """Each seed's trace on the host backend, content checked: the CPU side of the family."""
    out = {}
    for seed in seeds:
        ops = workloads.trace(workloads.family(seed), layers=layers, max_new=max_new)
        s = host_random.replay(ops, capacity=2 * workloads.peak_live(ops) + (256 << 20))
        out[f"seed {seed}"] = r = {
            "events": len(ops),
            "frag_pct": round(100 * s["fragmentation"], 2),
            "peak_alloc_MiB": round(s["peak_allocated_bytes"] / 2**20, 1),
            "peak_mapped_MiB": round(s["peak_mapped_bytes"] / 2**20, 1),
            "overwritten": s["overwritten"],
            "mapped_after_empty_cache": s["mapped_after_empty_cache"],
        }
        print(f"host replay seed {seed}: {r}", flush=True)
    return out


def host_latency() -> dict[int, float]:
    """malloc + free of each size from C (a loop in the library) on a host-backend pool, ns a
    pair, beside one live 512-byte block (a program's other small tensors: a small block freed
    beside live ones is stashed for the next malloc of its size, csrc/allocator.h): the pool's
    own cost, the part of the GPU's `C loop` column this machine can measure (the GPU adds the
    driver's capture query; torch.empty adds PyTorch's pluggable wrapper)."""
    from oxygen_torch.pool import VirtualPool
    from oxygen_torch.pool import native as _native

    pool = VirtualPool(backend="host", capacity=1 << 30, hysteresis_us=20_000)
    try:
        lib = _native.lib()
        pool.malloc(512)  # (live until the pool closes)
        out = {}
        for sz in SIZES:
            lib.oxygen_pool_bench(pool._h, sz, 2_000, None)  # warm: the size's pages mapped
            out[sz] = min(lib.oxygen_pool_bench(pool._h, sz, 50_000, None) for _ in range(3))
        return out
    finally:
        pool.close()


def host(args) -> int:
    """The CPU side: seeds replayed, random threads, the recorded trace paced by hysteresis."""
    if args.latency:
        lat = host_latency()
        print("host backend, malloc + free from C, ns a pair (best of 3 x 50,000): " + ", ".join(
            f"{sz >> 10} KiB {ns:.0f}" for sz, ns in lat.items()))  # fmt: skip
    if args.seeds:
        res = replay_host(args.seeds, args.layers, args.max_new)
        v, name = max((r["frag_pct"], n) for n, r in res.items())
        bad = sum(r["overwritten"] for r in res.values())
        print(f"host replay: worst fragmentation over {len(res)} seeds {v} % ({name}); "
              f"blocks overwritten {bad}")  # fmt: skip
    if args.random_seeds:
        # the pool on the replay's own clock, 50 us an operation (the engine's allocations on the
        # H200 came ~18 a millisecond): the same decisions on every run; idle pages kept 20 ms
        # (pool.hysteresis_ms's default) or unmapped at once
        print("| seed | operations | fragmentation at the peak: hysteresis 20 ms / at once | "
              "peak allocated MiB | maps: 20 ms / at once | overwritten |")  # fmt: skip
        print("|---|---|---|---|---|---|")
        frags: dict[int, list[float]] = {20000: [], 1: []}
        for seed in args.random_seeds:
            ops = host_random.random_trace(seed, threads=args.threads, ops=args.ops or 3000)
            runs = {h: host_random.replay(ops, capacity=16 << 30, hysteresis_us=h, op_ns=50_000)
                    for h in frags}  # fmt: skip
            for h, r in runs.items():
                frags[h].append(100 * r["fragmentation"])
            a, b = runs[20000], runs[1]
            print(f"| {seed} | {len(ops)} | {frags[20000][-1]:.2f} / {frags[1][-1]:.2f} % | "
                  f"{a['peak_allocated_bytes'] / 2**20:.1f} | {a['num_maps']} / {b['num_maps']} | "
                  f"{a['overwritten'] + b['overwritten']} |", flush=True)  # fmt: skip
        for h, f in frags.items():
            print(f"seeded random traces, hysteresis {'20 ms' if h > 1 else 'none'}: "
                  f"fragmentation mean {sum(f) / len(f):.2f} %, worst {max(f):.2f} % (goal <= 3 %, "
                  "issue 35); the same figures on every run")  # fmt: skip
        return 0
    if args.ops:
        r = host_random.run(threads=args.threads, ops=args.ops)
        ok = not r["errors"] and r["mapped_after_empty_cache"] == 0
        print(f"random: {args.threads} threads x {args.ops} ops: fragmentation "
              f"{r['fragmentation']:.2%} (goal <= 5 %), {len(r['errors'])} errors, mapped after "
              f"empty_cache {r['mapped_after_empty_cache']} B: {'ok' if ok else 'FAILED'}, "
              f"{r['seconds']} s")  # fmt: skip
        if not ok:
            return 1
    if args.hysteresis_ms:
        header, ops = host_random.load_trace()
        steps = sum(new for _b, _p, new in header["workload"])
        pace_ns = int(header["seconds"] * 1e9 / len(ops))
        print(f"recorded trace: {len(ops)} events, {steps} decode steps, paced at "
              f"{pace_ns / 1e3:.1f} us an event")  # fmt: skip
        print("| hysteresis ms | maps | maps per step | vs 2 ms | unmaps | fragmentation "
              "| mapped at end GiB | mapped +100 ms GiB |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        anchor = None  # the 2 ms row (the default before 20 ms) runs first
        for h in [2.0] + [x for x in args.hysteresis_ms if x != 2.0]:
            s = host_random.paced_replay(ops, pace_ns, h)
            per_step = s["num_maps"] / steps
            anchor = per_step if anchor is None else anchor
            ratio = f"{per_step / anchor:.2f}x"
            frag = 1 - s["peak_allocated_bytes"] / s["peak_mapped_bytes"]
            print(f"| {h:g} | {s['num_maps']} | {per_step:.1f} | {ratio} | {s['num_unmaps']} | "
                  f"{frag:.2%} | {s['mapped_bytes'] / 2**30:.2f} | "
                  f"{s['mapped_after_100ms'] / 2**30:.2f} |", flush=True)  # fmt: skip
    return 0


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
        lines += ["", "## 2. mixed generate() workloads, one per seed", "",
                  "| workload | allocator | peak alloc GiB | peak reserved/mapped GiB "
                  "| fragmentation % | held after GiB (now / +100 ms) | tok/s "
                  "| tok/s vs expandable |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for name, runs in r["workload"].items():
            anchor = runs.get("expandable", {}).get("tok_per_s")
            for mode, w in runs.items():
                if "error" in w:
                    lines.append(f"| {name} | {mode} | error: {w['error'][-200:]!r} ||||||")
                    continue
                ratio = f"{w['tok_per_s'] / anchor:.2f}x" if anchor else "-"
                lines.append(f"| {name} ({w.get('arch')}) | {mode} | {w['peak_alloc_GiB']} | "
                             f"{w['peak_reserved_GiB']} | {w['frag_pct']} | "
                             f"{w['end_reserved_GiB']} / {w['end_reserved_100ms_GiB']} | "
                             f"{w['tok_per_s']} | {ratio} |")  # fmt: skip
        for mode, (v, name) in worst(r["workload"]).items():
            lines.append(f"| **worst** | {mode} | | | {v} ({name}) | | | |")
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


PROBE_HANDLES_MIB = (2, 4, 8, 16, 32, 64, 128, 512, 1024)


def map_probe(backend: str, repeats: int = 3, handles_mib=PROBE_HANDLES_MIB) -> str:
    """Growth by 1 GiB by the size of the physical handles behind it: the backend's create / map
    / set_access / unmap / release timed over 1 GiB of handles of each size (the best of
    `repeats`), beside torch's own 1 GiB cudaMalloc after empty_cache() (cuda). The pool maps
    2 MiB pages one handle each: the map column of the 2 MiB row is its growth cost; the larger
    rows say what mapping a large block's interior with larger handles would save."""
    from oxygen_torch.pool import native as _native

    anchor = None
    if backend == "cuda":
        import torch

        for _ in range(repeats):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            t = time.perf_counter()
            x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t) * 1e3
            anchor = dt if anchor is None else min(anchor, dt)
            del x
        torch.cuda.empty_cache()
    lines = [f"## growth by 1 GiB by handle size ({backend} backend; ms, best of {repeats})", "",
             "| handle MiB | handles | create | map | set_access: one call / one a handle | "
             "unmap | release | map + set_access (the allocating thread) | goal < 2 ms | "
             "torch cudaMalloc 1 GiB | ratio |", "|---" * 11 + "|"]  # fmt: skip
    for mib in handles_mib:
        best: dict[str, float] = {}
        each = float("inf")
        for _ in range(repeats):
            r = _native.backend_map_probe(backend, mib << 20)
            for k, v in r.items():
                best[k] = min(best.get(k, float("inf")), v * 1e3)
            e = _native.backend_map_probe(backend, mib << 20, access_each=True)
            each = min(each, e["set_access"] * 1e3)
        grow = round(best["map"] + best["set_access"], 2)  # (as printed: the goal column agrees)
        a = f"{anchor:.2f}" if anchor is not None else "-"
        ratio = f"{grow / anchor:.2f}x" if anchor else "-"
        lines.append(f"| {mib} | {1024 // mib} | {best['create']:.2f} | {best['map']:.2f} | "
                     f"{best['set_access']:.2f} / {each:.2f} | {best['unmap']:.2f} | "
                     f"{best['release']:.2f} | {grow:.2f} | {'met' if grow < 2 else 'missed'} | "
                     f"{a} | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--seeds",
        type=int,
        nargs="*",
        default=list(range(8)),
        help="workload family seeds (workloads.py), default 0-7; none: no family workload",
    )
    ap.add_argument("--anchor", action="store_true", help="also the anchor's 14-call workload")
    ap.add_argument(
        "--calls",
        type=int,
        default=None,
        help="keep the first N calls of each workload (default: all)",
    )
    ap.add_argument("--skip-workload", action="store_true", help="latency and growth only")
    ap.add_argument(
        "--allocators",
        nargs="+",
        default=list(workloads.ALLOCATORS),
        choices=workloads.ALLOCATORS,
        help="which allocators run the workloads (each ~2 min a workload on the H200)",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="print each seed's workload and what would run; no GPU",
    )
    ap.add_argument("--host", action="store_true", help="the CPU side on the host backend")
    ap.add_argument(
        "--map-probe",
        action="store_true",
        help="only: growth by 1 GiB by physical handle size, the backend's calls timed (with "
        "--host: the host backend)",
    )
    ap.add_argument(
        "--latency",
        action="store_true",
        help="--host: also malloc + free from C on a host-backend pool, per size",
    )
    ap.add_argument("--layers", type=int, default=2, help="--host: layers kept of each seed")
    ap.add_argument("--max-new", type=int, default=8, help="--host: new tokens per call")
    ap.add_argument("--threads", type=int, default=8, help="--host: random malloc/free threads")
    ap.add_argument("--random-seeds", type=int, nargs="*", default=None,
                    help="--host: instead, the random workers' operations as one seeded trace "
                         "each (--threads workers x --ops, default 3,000), replayed on one "
                         "thread on the pool's virtual clock: fragmentation per seed, the same "
                         "on every run")  # fmt: skip
    ap.add_argument(
        "--ops", type=int, default=200_000, help="--host: operations per thread (0: skip)"
    )
    ap.add_argument(
        "--hysteresis-ms",
        type=float,
        nargs="*",
        default=[20.0, 50.0],
        help="--host: the recorded trace paced, per pool.hysteresis_ms (2 runs first, the "
        "anchor); none: skip",
    )
    args = ap.parse_args(argv)  # fmt: skip
    if any(s < 0 for s in args.seeds):
        ap.error(f"--seeds must be non-negative, got {args.seeds}")
    if args.calls is not None and args.calls < 1:
        ap.error(f"--calls must be >= 1, got {args.calls}")
    if args.layers < 1 or args.max_new < 1 or args.threads < 1 or args.ops < 0:
        ap.error("--layers, --max-new and --threads must be >= 1, --ops >= 0")
    if any(not 0.01 <= h <= 60000 for h in args.hysteresis_ms):
        ap.error(f"--hysteresis-ms must lie in 0.01 ... 60000, got {args.hysteresis_ms}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        for seed in args.seeds:
            print(workloads.family(seed).describe())
        print(f"would run: latency, growth, then {len(args.seeds) + args.anchor} workload(s) x "
              f"{args.allocators}")  # fmt: skip
        return 0
    if args.map_probe:
        import torch

        if not args.host and not torch.cuda.is_available():
            raise SystemExit("bench_allocator.py --map-probe: needs a CUDA device (--host: the "
                             "host backend's calls)")  # fmt: skip
        md = map_probe("host" if args.host else "cuda")
        print(md)
        if os.environ.get("OUT"):
            (Path(os.environ["OUT"]) / "bench_allocator_map_probe.md").write_text(md + "\n")
        return 0
    if args.host:
        return host(args)
    t0 = time.perf_counter()
    r = {"latency": bench_latency()}
    print(f"latency: {r['latency']}", flush=True)
    r["growth"] = child(GROWTH)
    print(f"growth: {r['growth']}", flush=True)
    if not args.skip_workload:
        seeds = ([None] if args.anchor else []) + list(args.seeds)
        r["workload"] = bench_workload(args.calls, args.allocators, seeds)
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
