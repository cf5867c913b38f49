"""Time to first token of generate(): after enable() (kv.fresh_prefill auto, dense, paged) against
stock transformers' dynamic and static cache, same weights, same machine, same run.

Rows: batch {1, 32} x prompt {1024, 8192} tokens. TTFT is the wall time of
generate(max_new_tokens=1) (prefill, then the first token sampled), the median of REPEATS calls
after one warm-up call. Each mode runs in its own subprocess (enable() must come before the first
CUDA allocation). Oxygen rows print the prefill attention path that ran
(oxygen_torch.compile.stats()["prefill_attention"]: calls per path, one per layer and forward;
a prompt over kv.prefill_chunk_tokens runs in chunks, whose later chunks read the cache).
Goal (issue 17): TTFT after enable() <= stock's on every row.

    python benchmarks/bench_ttft.py [--modes ...] [--shape qwen1.5b|llama1b]  # OUT=dir: json, md
    python benchmarks/bench_ttft.py --smoke      # tiny model on CPU: the plumbing only
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

MODES = ("hf_dynamic", "hf_static", "oxygen", "oxygen_dense", "oxygen_paged")
SETTING = {"oxygen": "auto", "oxygen_dense": "dense", "oxygen_paged": "paged"}
ROWS = ((1, 1024), (1, 8192), (32, 1024), (32, 8192))
REPEATS = 3
TIMEOUT_S = 420
SHAPES = {
    # the 1.5B-parameter model (Qwen2-1.5B's attention: 12 heads, 2 KV heads, head dim
    # 128, the head dim of kv.fresh_prefill auto's measured entry) as a random Llama
    "qwen1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=32000,
    ),  # fmt: skip
    "llama1b": None,  # demo_models.LLAMA_1B: head dim 64
    "tiny": None,  # demo_models.TINY_LLAMA (--smoke)
}


def build_model(shape: str, device: str):
    from oxygen_torch.tools.demo_models import LLAMA_1B, TINY_LLAMA, random_llama

    dims = SHAPES[shape] or (LLAMA_1B if shape == "llama1b" else TINY_LLAMA)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return random_llama(dims, dtype=dtype, device=device, init_on_device=device == "cuda",
                        max_position_embeddings=16384)  # fmt: skip


def timed(fn, device: str):
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def run_mode(mode: str, shape: str, rows, device: str) -> dict:
    import oxygen_torch.compile as oc

    if mode in SETTING:
        import oxygen_torch

        oxygen_torch.enable(kv={"fresh_prefill": SETTING[mode]})
    model = build_model(shape, device)
    out = []
    for b, p in rows:
        ids = torch.randint(1, 32000 if shape != "tiny" else 1024, (b, p),
                            generator=torch.Generator().manual_seed(b * p)).to(device)  # fmt: skip
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        if mode == "hf_static":
            kw["cache_implementation"] = "static"
        gen = functools.partial(model.generate, ids, **kw)
        with torch.no_grad():
            timed(gen, device)  # warm-up: kernels compiled / autotuned, pages mapped
            oc.reset_stats()
            runs = [timed(gen, device) for _ in range(REPEATS)]
        paths = oc.stats()["prefill_attention"] if mode in SETTING else None
        r = dict(mode=mode, batch=b, prompt=p, ttft_ms=statistics.median(t for _, t in runs) * 1e3,
                 paths=paths, token=runs[-1][0][:, -1].tolist())  # fmt: skip
        print(f"# {mode} B={b} P={p}: {r['ttft_ms']:.1f} ms, prefill path {paths}", flush=True)
        out.append(r)
        del ids, runs, gen
        if device == "cuda":
            torch.cuda.empty_cache()
    return dict(mode=mode, rows=out)


def spawn(mode: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--run", mode, "--shape", args.shape]
    cmd += ["--smoke"] if args.smoke else []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {TIMEOUT_S} s"}
    sys.stdout.write("".join(ln + "\n" for ln in proc.stdout.splitlines() if ln.startswith("#")))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"mode": mode, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def _path(paths: dict | None) -> str:
    if not paths:
        return "stock SDPA"
    return f"dense {paths['dense']} / paged {paths['paged']} ({', '.join(paths['why'])})"


def table(results: dict) -> str:
    lines = ["| B | prompt | mode | TTFT ms | vs best stock | prefill attention (calls) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    by_row: dict = {}
    for mode, res in results.items():
        if "error" in res:
            lines.append(f"| | | {mode} | error: {res['error'].strip().splitlines()[-1][:80]} |||")
        for r in res.get("rows", ()):
            by_row.setdefault((r["batch"], r["prompt"]), []).append(r)
    for (b, p), rs in sorted(by_row.items()):
        stock = [r["ttft_ms"] for r in rs if r["mode"].startswith("hf_")]
        best = min(stock) if stock else None
        for r in rs:
            ratio = f"{r['ttft_ms'] / best:.2f}x" if best else "-"
            lines.append(f"| {b} | {p} | {r['mode']} | {r['ttft_ms']:.1f} | {ratio} | "
                         f"{_path(r['paths'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                    help="modes to run (default: all)")  # fmt: skip
    ap.add_argument("--shape", default="qwen1.5b", choices=list(SHAPES), help="model shape")
    ap.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, short prompts")
    args = ap.parse_args(argv)
    device, rows = ("cpu", ((1, 16), (2, 24))) if args.smoke else ("cuda", ROWS)
    if args.smoke:
        args.shape = "tiny"
    if args.run:
        try:
            res = run_mode(args.run, args.shape, rows, device)
        except Exception:
            res = {"mode": args.run, "error": traceback.format_exc()[-1500:]}
        print(json.dumps(res), flush=True)
        return
    results = {mode: spawn(mode, args) for mode in args.modes}
    md = table(results)
    print("\n" + md, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_ttft.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out, "bench_ttft.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
