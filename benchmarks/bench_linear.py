"""A decode step's linear layers on the GPU: cuBLAS (torch.mm, what F.linear runs), Triton's
skinny_mm (triton_kernels/skinny_mm.py: the weight streamed once, split along K) over a sweep of
tiles, and with --inductor torch.compile's max-autotune choice, at the 1B shape with a 128k
vocabulary (hidden 2048, intermediate 8192, 32 query / 8 KV heads of 64) and the fused
projections a model could run instead (q|k|v in one weight, gate|up in one).

Issue 34's profile (H100, 64 rows): the seven GEMMs of a layer took 66 µs, 1.84 TB/s of weight
read; k and v (2 MiB each) 5.5 µs apiece, 0.38 TB/s. This measures what each lever would give:
a better kernel for the same shapes, and one GEMM instead of three (q, k, v) or two (gate, up).

Timing: one CUDA graph of R calls, each on its own copy of the weight (R copies hold more than
twice the L2, so each call reads its weight from HBM, as a layer's GEMM does in a step), replayed
and divided by R: the kernels' time back to back, with the gaps a graph has between them.

    python benchmarks/bench_linear.py [--rows 1 8 64 256] [--inductor] [--budget-s 240]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time

import torch
import torch.nn.functional as F
from oxygen_torch.triton_kernels.skinny_mm import SkinnyConfig, skinny_mm

HIDDEN, INTER, Q, KV, VOCAB = 2048, 8192, 2048, 512, 128256
SHAPES = {  # name: (N, K) of the weight, y = x @ w.T
    "q / o": (Q, HIDDEN),
    "k / v": (KV, HIDDEN),
    "q|k|v fused": (Q + 2 * KV, HIDDEN),
    "gate / up": (INTER, HIDDEN),
    "gate|up fused": (2 * INTER, HIDDEN),
    "down": (HIDDEN, INTER),
    "lm_head": (VOCAB, HIDDEN),
}
SWEEP = [
    SkinnyConfig(bn, bk, sk, w, st)
    for bn, bk, sk, w, st in itertools.product(
        (32, 64, 128), (128, 256), (1, 2, 4, 8), (4,), (3, 4)
    )
]
T0 = time.perf_counter()


def graph_us(fn, weights, x) -> float:
    """µs a call: a graph of fn(x, w) over every w, replayed, divided by the calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in weights[:2]:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    reps = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (reps * len(weights)))
    del graph
    return best


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--inductor", action="store_true", help="also torch.compile max-autotune")
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop the sweep past this")
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "L2_MiB": l2 >> 20},
          flush=True)  # fmt: skip
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        nbytes = n * k * 2
        copies = max(4, -(-4 * l2 // nbytes))
        weights = [torch.randn(n, k, device=dev, dtype=dt) / k**0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dt)
            ref = x.float() @ weights[0].float().T
            r = {"shape": name, "M": m, "N": n, "K": k, "MB": round(nbytes / 1e6, 1)}
            r["cublas_us"] = graph_us(lambda a, w: torch.mm(a, w.T), weights, x)
            best = None
            for cfg in SWEEP:
                if time.perf_counter() - T0 > args.budget_s:
                    break
                try:
                    got = skinny_mm(x, weights[0], cfg)
                    err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                    if err > 2e-2:
                        print(f"  {name} M={m} {cfg}: wrong (rel err {err:.1e})", flush=True)
                        continue
                    us = graph_us(lambda a, w, c=cfg: skinny_mm(a, w, c), weights, x)
                except Exception as e:  # a tile that does not fit: say so, go on
                    print(f"  {name} M={m} {cfg}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best:
                r["ours_us"], r["ours_cfg"] = best[0], best[1].__dict__
            if args.inductor:
                torch._dynamo.reset()
                fn = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
                r["inductor_us"] = graph_us(fn, weights, x)
            for key in ("cublas_us", "ours_us", "inductor_us"):
                if key in r:
                    r[key.replace("_us", "_TBs")] = round(nbytes / (r[key] * 1e-6) / 1e12, 2)
            rows.append(r)
            print(json.dumps(r), flush=True)
        del weights
        torch.cuda.empty_cache()
    lines = ["| weight | M | MB | cuBLAS µs (TB/s) | ours µs (TB/s), tiles | ours / cuBLAS time | "
             "Inductor max-autotune µs |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        ours = (f"{r['ours_us']:.1f} ({r['ours_TBs']}), {tuple(r['ours_cfg'].values())}"
                if "ours_us" in r else "-")  # fmt: skip
        ratio = f"{r['ours_us'] / r['cublas_us']:.2f}" if "ours_us" in r else "-"
        ind = f"{r['inductor_us']:.1f}" if "inductor_us" in r else "-"
        lines.append(f"| {r['shape']} | {r['M']} | {r['MB']} | {r['cublas_us']:.1f} "
                     f"({r['cublas_TBs']}) | {ours} | {ratio} | {ind} |")  # fmt: skip
    by = {(r["shape"], r["M"]): r["cublas_us"] for r in rows}
    for m in args.rows:
        three = [by.get((s, m)) for s in ("q / o", "k / v", "k / v")]
        if all(three) and ("q|k|v fused", m) in by:
            lines.append(f"\nM={m}: q + k + v {sum(three):.1f} µs apart, "
                         f"{by[('q|k|v fused', m)]:.1f} fused (cuBLAS)")  # fmt: skip
        two = [by.get(("gate / up", m))] * 2
        if all(two) and ("gate|up fused", m) in by:
            lines.append(f"M={m}: gate + up {sum(two):.1f} µs apart, "
                         f"{by[('gate|up fused', m)]:.1f} fused (cuBLAS)")  # fmt: skip
    md = "\n".join(lines)
    print("\n" + md + f"\n\ntotal {time.perf_counter() - T0:.0f} s", flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_linear.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(os.environ["OUT"], "bench_linear.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
