"""torch.compile backend "oxygen" against transformers' own static-cache compile, on the H200.

Workload (the anchors' one): Llama-1.1B shape (hidden 2048, 16 layers, 32/8 heads, vocab 32000),
random weights, bf16, batch 16, prompt 512, 256 new tokens, greedy. Modes, each in its own
subprocess (a fresh CUDA context, Dynamo cache and allocator):

  hf_static        generate(cache_implementation="static"): transformers compiles the decode step
                   with Inductor, mode="reduce-overhead" (CUDA-graph trees). The anchor.
  oxygen           the same, with compile_config=CompileConfig(backend="oxygen",
                   mode="reduce-overhead"): attention rewritten to oxygen::attention (repeat_kv
                   folded into GQA), the backend's own CUDA graphs.
  oxygen_default   backend="oxygen", mode="default": no CUDA graphs (what the graphs are worth).
  oxygen_enabled   oxygen_torch.enable() first (pool as allocator, HF integration), then as
                   `oxygen` (not run unless named: --modes ... oxygen_enabled).

first_call_s is the first generate() call (compilation and capture included), tok/s the second.
Prints a compact table last; with $OUT set, writes bench_compile.json and bench_compile.md there.

    python benchmarks/bench_compile.py [--modes hf_static oxygen oxygen_default] [--new 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

from oxygen_torch.tools.progress import progress

B, P, N = 16, 512, 256
MODES = ("hf_static", "oxygen", "oxygen_default", "oxygen_enabled")
DEFAULT_MODES = ("hf_static", "oxygen", "oxygen_default")
CHILD_TIMEOUT_S = 300


def build_model():
    from oxygen_torch.tools.demo_models import random_llama

    model = random_llama(attn_implementation="sdpa")
    return model, model.config


def compile_config(mode: str):
    from transformers import CompileConfig

    if mode == "hf_static":
        return None  # transformers' default: Inductor, reduce-overhead
    ro = "default" if mode == "oxygen_default" else "reduce-overhead"
    return CompileConfig(backend="oxygen", mode=ro, fullgraph=True)


def child(mode: str, new_tokens: int) -> dict:
    import torch

    res = {"mode": mode}
    if mode == "oxygen_enabled":
        import oxygen_torch

        oxygen_torch.enable()
    import oxygen_torch.compile as oc

    model, cfg = build_model()
    ids = torch.randint(1, cfg.vocab_size, (B, P), device="cuda")
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        attention_mask=torch.ones_like(ids),
    )
    cc = compile_config(mode)
    if cc is not None:
        kw["compile_config"] = cc

    def timed():
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kw)
        torch.cuda.synchronize()
        return out, time.perf_counter() - t

    first, first_s = timed()
    second, dt = timed()
    res.update(
        first_call_s=round(first_s, 1),
        tok_per_s=round(B * new_tokens / dt, 1),
        step_ms=round(dt / new_tokens * 1e3, 2),
        same_tokens=bool(torch.equal(first, second)),
        peak_alloc_GiB=round(torch.cuda.max_memory_allocated() / 2**30, 2),
    )
    if mode != "hf_static":
        s = oc.stats()
        res.update(
            graphs_compiled=s["graphs_compiled"],
            attention_rewritten=s["rewritten"],
            attention_left=s["left"],
            cuda_graphs=s["cuda_graphs"],
            left_reasons=s["left_reasons"][:3],
        )
    return res


def run_child(mode: str, new_tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--new", str(new_tokens)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {CHILD_TIMEOUT_S} s"}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {"mode": mode, "error": f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}"}


def table(rows: list[dict]) -> str:
    base = next((r.get("tok_per_s") for r in rows if r["mode"] == "hf_static"), None)
    lines = [
        "| mode | tok/s | vs hf_static | step ms | first call s | rewritten | graphs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | error: {r['error'][-120:]!r} | | | | | |")
            continue
        ratio = f"{r['tok_per_s'] / base:.2f}x" if base else "-"
        cg = r.get("cuda_graphs", {})
        graphs = f"{cg.get('captured', 0)} cap / {cg.get('replayed', 0)} rep" if cg else "-"
        lines.append(
            f"| {r['mode']} | {r['tok_per_s']:.0f} | {ratio} | {r['step_ms']} | "
            f"{r['first_call_s']} | {r.get('attention_rewritten', '-')} | {graphs} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES,
                    help="modes to run (default: hf_static oxygen oxygen_default)")  # fmt: skip
    ap.add_argument("--new", type=int, default=N, help="new tokens per sequence")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            res = child(args.child, args.new)
        except Exception:
            res = {"mode": args.child, "error": traceback.format_exc()[-1500:]}
        print(json.dumps(res), flush=True)
        return
    rows = []
    for mode in progress(args.modes, "compile modes"):
        rows.append(run_child(mode, args.new))
        print(json.dumps(rows[-1]), flush=True)
    md = (
        f"Llama-1.1B shape, random bf16 weights, B={B} P={P} N={args.new}, greedy, static "
        f"cache\n\n{table(rows)}\n"
    )
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_compile.json"), "w") as f:
            json.dump(rows, f, indent=1)
        with open(os.path.join(out, "bench_compile.md"), "w") as f:
            f.write(md)
    print(md)


if __name__ == "__main__":
    main()
