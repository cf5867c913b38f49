"""Where a graph-replayed decode step's time goes, inside an unchanged generate() (H200).

Llama-1.1B shape, bf16, B=16, P=512, 256 new tokens (bench_generate.py's workload), after
oxygen_torch.enable(). Three generate() calls after a warm-up:

1. plain: the step time as bench_generate.py measures it;
2. host: the host time spent inside oxygen's decode step (planning, copies, replay launch,
   logits copy) per step; the rest of the step is generate()'s own loop;
3. synced: each replay bracketed by device syncs, so the bracket is the graph's GPU time (plus
   one launch); this call is slower and only gives that figure.

    python benchmarks/step_breakdown.py [--batch 16] [--prompt 512] [--new 256]
                                        [--fusion compiled|modules|off]

--fusion: what the graph is captured from: the forward compiled whole by backend "oxygen"
(default), only RMSNorm / MLP / rotary compiled (kv.decode_graph_compile off), or the eager
forward as it is (kv.decode_graph_fusion off).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


class _SyncedGraph:
    def __init__(self, graph, times):
        self.graph, self.times = graph, times

    def replay(self):
        torch.cuda.synchronize()
        t = time.perf_counter()
        self.graph.replay()
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t)


def kernel_table(model, ids, n: int) -> str:
    """The GPU kernels of a short generate() (the graphs' kernels included), by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n)
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(ids, do_sample=False, **kw)
        torch.cuda.synchronize()
    head = f"kernels of one generate() with {n} new tokens (prefill included), by GPU time\n"
    return head + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--fusion", choices=("compiled", "modules", "off"), default="compiled")
    args = ap.parse_args()
    import oxygen_torch
    from oxygen_torch.integrations.hf import graphs as hf_graphs
    from oxygen_torch.tools.demo_models import LLAMA_1B, random_llama

    fusion = args.fusion != "off"
    oxygen_torch.enable(
        kv=dict(decode_graph_fusion=fusion, decode_graph_compile=args.fusion == "compiled")
    )
    model = random_llama(dict(LLAMA_1B), init_on_device=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 32000, (args.batch, args.prompt), generator=g).cuda()
    n = args.new
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n)
    kw["do_sample"] = False

    def generate() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate()  # warm-up: Triton compiles, the graph is captured
    step_ms = generate() / n * 1e3

    host, original = [], hf_graphs.DecodeGraph.run

    def timed_run(self, *a, **k):
        t = time.perf_counter()
        out = original(self, *a, **k)
        host.append(time.perf_counter() - t)
        return out

    hf_graphs.DecodeGraph.run = timed_run
    try:
        host_step_ms = generate() / n * 1e3
    finally:
        hf_graphs.DecodeGraph.run = original
    gpu: list[float] = []
    for dg in hf_graphs._graphs[model].graphs.values():
        dg.graph = _SyncedGraph(dg.graph, gpu)
    generate()
    kernels = kernel_table(model, ids, n=32)
    res = {
        "shape": f"B={args.batch} P={args.prompt} N={n}",
        "fusion": args.fusion,
        "step_ms": round(step_ms, 3),
        "tok_per_s": round(args.batch / step_ms * 1e3, 1),
        "step_ms_in_host_run": round(host_step_ms, 3),
        "oxygen_step_host_ms": round(sum(host) / len(host) * 1e3, 3),
        "rest_of_generate_loop_ms": round(host_step_ms - sum(host) / len(host) * 1e3, 3),
        "graph_gpu_ms_median": round(sorted(gpu)[len(gpu) // 2] * 1e3, 3),
        "graphs": hf_graphs.stats(model),
    }
    print(json.dumps(res), flush=True)
    print(kernels, flush=True)
    if os.environ.get("OUT"):
        name = f"step_breakdown_{args.fusion}.json"
        with open(os.path.join(os.environ["OUT"], name), "w") as f:
            json.dump(res, f)
        with open(os.path.join(os.environ["OUT"], name.replace(".json", "_kernels.txt")), "w") as f:
            f.write(kernels)


if __name__ == "__main__":
    main()
