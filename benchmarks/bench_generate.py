"""generate() on the H200: oxygen (paged KV + Triton attention) vs HF dynamic (SDPA) vs HF static
(compiled by transformers), and the capacity test under a 24 GiB cap. Same run, same weights.

Workloads (as benchmarks/../shared/anchors/hf_generate.py and tiers_and_capacity.py): random
Llama-1.1B shape, bf16; throughput: batch 16, prompt 512, 256 new tokens, the second of two
calls timed; capacity: the largest batch of 4096-token prompts + 256 new tokens that completes.

Each mode runs in its own subprocess (allocator state and peaks are its own). The table is
printed last; with $OUT set, bench_generate.json and bench_generate.md are written there.

    python benchmarks/bench_generate.py                 # every mode
    python benchmarks/bench_generate.py --modes oxygen hf_dynamic
    python benchmarks/bench_generate.py --smoke          # tiny model on CPU: checks the plumbing
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from oxygen_torch.tools.progress import progress

GIB = 1 << 30
CAP_BYTES = 24 * GIB
B, P, N = 16, 512, 256
CAP_P, CAP_N = 4096, 256
CAP_BATCHES = (32, 48, 64, 80, 96, 112, 128)
MODES = (
    "hf_dynamic",
    "hf_static",
    "oxygen",
    "oxygen_eager",  # oxygen with kv.decode_graphs off: every decode step launched eagerly
    "oxygen_modules",  # decode graphs with only RMSNorm / MLP / rotary compiled
    # the user's line: model.forward = torch.compile(model.forward, backend="oxygen",
    # mode="reduce-overhead"), then generate() on the paged cache after enable()
    "oxygen_compiled",
    "oxygen_fp8",  # kv.kv_dtype=fp8_e4m3: K/V as e4m3 codes + block scales
    "oxygen_static",
    "cap_hf",
    "cap_oxygen",
    "cap_oxygen_fp8",
)
TIMEOUTS = {"hf_static": 240, "oxygen_static": 240, "cap_hf": 200, "cap_oxygen": 240}
TIMEOUTS.update(oxygen=240, oxygen_compiled=240, oxygen_modules=240, oxygen_fp8=240)
TIMEOUTS.update(cap_oxygen_fp8=420)
CAP_BATCHES_FP8 = (128, 160, 192, 224, 256)


SMOKE = os.environ.get("BENCH_GENERATE_SMOKE") == "1"  # tiny model on CPU: the plumbing only
DEVICE = "cpu" if SMOKE else "cuda"
if SMOKE:
    B, P, N = 2, 24, 8


def build_model():
    from oxygen_torch.tools.demo_models import LLAMA_1B, random_llama

    shape = dict(LLAMA_1B)
    if SMOKE:
        shape.update(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    dtype = torch.float32 if SMOKE else torch.bfloat16
    model = random_llama(shape, dtype=dtype, device=DEVICE, init_on_device=True)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return model


def prompts(batch, length):
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 32000, (batch, length), generator=g).to(DEVICE)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def kv_peak_bytes() -> int:
    from oxygen_torch import kv

    return max((p["peak_mapped_bytes"] for p in kv.pool_stats()), default=0)


def pool_churn() -> dict:
    """The global pool's map/unmap counters, or {} where it is not PyTorch's allocator."""
    from oxygen_torch import pool as allocator

    if not (DEVICE == "cuda" and allocator.is_enabled()):
        return {}
    s = allocator.memory_stats(0)
    return {k: s[k] for k in ("num_maps", "num_unmaps")}


def switch_on(cfg=None, **overrides):
    """cfg None: the product path, oxygen_torch.enable(**overrides) (+ the HF wiring,
    idempotent). With a cfg: the HF integration only, torch's own allocator (the capacity test
    caps it)."""
    import oxygen_torch
    from oxygen_torch.integrations.hf import integration as hf

    if cfg is None:
        cfg = oxygen_torch.enable(**overrides)
    hf.enable_hf(cfg)


def throughput(mode: str) -> dict:
    if mode.startswith("oxygen"):
        kv = dict(
            decode_graphs=mode != "oxygen_eager", decode_graph_compile=mode != "oxygen_modules"
        )
        switch_on(kv=dict(kv, kv_dtype="fp8_e4m3" if mode == "oxygen_fp8" else "auto"))
    model = build_model()
    if mode == "oxygen_compiled":
        model.forward = torch.compile(model.forward, backend="oxygen", mode="reduce-overhead")
    ids = prompts(B, P)
    kw = dict(
        attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N, do_sample=False
    )
    if mode.endswith("static"):
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        _, first = timed(lambda: model.generate(ids, **kw))
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        churn = pool_churn()
        t0 = time.perf_counter()
        out, dt = timed(lambda: model.generate(ids, **kw))
        churn = {k: v - churn[k] for k, v in pool_churn().items()}
    res = dict(
        mode=mode,
        attn=model.config._attn_implementation,
        first_call_s=round(first, 1),
        tok_per_s=round(B * N / dt, 1),
        step_ms=round(dt / N * 1e3, 2),
        tokens=out[:, P:].tolist(),
    )
    try:
        if DEVICE == "cuda":
            res["peak_reserved_GiB"] = round(torch.cuda.max_memory_reserved() / GIB, 2)
            res["peak_allocated_GiB"] = round(torch.cuda.max_memory_allocated() / GIB, 2)
    except RuntimeError as exc:  # a global pluggable allocator may not report device stats
        res["torch_stats"] = str(exc)[:200]
    if mode.startswith("oxygen"):
        from oxygen_torch.integrations.hf import graphs as hf_graphs

        res["kv_peak_mapped_GiB"] = round(kv_peak_bytes() / GIB, 2)
        steps = engine_steps(model, t0)
        if steps:  # the call ran as an engine request: its steps' figures
            res["engine"] = steps
        else:
            res["decode_graphs"] = hf_graphs.stats(model)
    if churn:  # the global pool's page maps/unmaps during the timed call (~59 / ~37 us each)
        res["pool_maps_per_step"] = round(churn["num_maps"] / N, 1)
        res["pool_unmaps_per_step"] = round(churn["num_unmaps"] / N, 1)
    return res


def engine_steps(model, since: float) -> dict:
    """The timed call's engine steps (a call alone is an engine request): medians over its
    decode steps of the period between launches, the launch's host time and the engine
    thread's CPU in it, the GPU time and the GPU's idle time before a step (CUDA events), in
    ms; {} when no engine served the model."""
    from oxygen_torch.integrations.hf import engine_runner

    eng = next(iter((engine_runner._engines.get(model) or {}).values()), None)
    if eng is None:
        return {}
    tl = [x for x in eng.stats.timeline if x[0] >= since]
    dec = [x for x in tl if x[1] == x[2]]  # decode steps (a token a row)

    def med(xs):
        xs = sorted(x for x in xs if x is not None)
        return round(1e3 * xs[len(xs) // 2], 3) if xs else None

    return dict(
        steps=len(tl),
        decode_steps=len(dec),
        period_ms=med(b[0] - a[0] for a, b in zip(dec, dec[1:])),
        launch_ms=med(x[4] for x in dec),
        launch_cpu_ms=med(x[8] for x in dec),
        gpu_ms=med(x[6] for x in dec),
        gpu_idle_ms=med(x[7] for x in dec),
        graphs=eng.runner.graphs.stats(),
    )


def capacity_kv_bytes(
    batch: int, layers=16, kv_heads=8, head_dim=64, bt=16, page=2 << 20, elem=2
) -> tuple[int, int]:
    """(arena bytes that hold `batch` sequences of CAP_P + CAP_N tokens + the guard block,
    bytes of the fp8 scales' pages those blocks map: one fp32 per block and kv head)."""
    blocks = batch * -(-(CAP_P + CAP_N) // bt) + 1
    region = -(-blocks * bt * kv_heads * head_dim * elem // page) * page
    scales = -(-blocks * kv_heads * 4 // page) * page if elem == 1 else 0
    return 2 * layers * region, 2 * layers * scales


def _long_generate(model, batch: int) -> float:
    ids = prompts(batch, CAP_P)
    with torch.no_grad():
        _, dt = timed(
            lambda: model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=CAP_N,
                min_new_tokens=CAP_N,
                do_sample=False,
            )
        )
    return dt


def capacity(mode: str) -> dict:
    """Largest batch that completes with torch's allocator + the KV arena within CAP_BYTES."""
    from oxygen_torch.kv import KVCacheFull, release_pools

    total = torch.cuda.get_device_properties(0).total_memory
    model = build_model()
    res, best = {"mode": mode, "runs": {}}, 0
    fp8 = mode == "cap_oxygen_fp8"
    for batch in CAP_BATCHES_FP8 if fp8 else CAP_BATCHES:
        kv_bytes = 0
        if mode.startswith("cap_oxygen"):
            # The arena is outside torch's allocator: cap it at exactly the KV this batch needs
            # and give torch only what is left of the 24 GiB (fp8: the scales' pages too).
            from oxygen_torch.integrations.hf import integration as hf

            arena, scales = capacity_kv_bytes(batch, elem=1 if fp8 else 2)
            kv_bytes = arena + scales
            from oxygen_torch.config import load_config

            kv = dict(arena_bytes=arena, kv_dtype="fp8_e4m3" if fp8 else "auto")
            switch_on(load_config(kv=kv))
            hf.apply(model, load_config(kv=kv))
        torch.cuda.set_per_process_memory_fraction((CAP_BYTES - kv_bytes) / total)
        try:
            dt = _long_generate(model, batch)
            best = batch
            res["runs"][batch] = f"ok {dt:.1f}s"
        except (torch.OutOfMemoryError, KVCacheFull) as exc:
            res["runs"][batch] = "OOM"
            res["oom"] = str(exc).splitlines()[0][:200]
            break
        finally:
            torch.cuda.empty_cache()
            release_pools()
        print(f"{mode} B={batch}: {res['runs'][batch]}", flush=True)
    res["max_batch"] = best
    return res


def run_mode(mode: str) -> dict:
    try:
        return capacity(mode) if mode.startswith("cap_") else throughput(mode)
    except Exception:
        return {"mode": mode, "error": traceback.format_exc()[-1500:]}


def spawn(mode: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--run", mode]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUTS.get(mode, 150))
    except subprocess.TimeoutExpired:
        return {"mode": mode, "error": f"timed out after {TIMEOUTS.get(mode, 150)} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return {"mode": mode, "error": f"exit {proc.returncode}: {proc.stderr[-1500:]}"}
    return json.loads(lines[-1])


def agreement(a, b) -> str:
    a, b = torch.tensor(a), torch.tensor(b)
    same = (a == b).int().cumprod(1).sum().item()
    return f"{same}/{a.numel()}"


def table(results: dict) -> str:
    rows = [
        "| mode | tok/s | vs hf_static | ms/step | first call s | peak torch reserved GiB "
        "| KV mapped GiB | tokens = hf_dynamic |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref = results.get("hf_dynamic", {}).get("tokens")
    anchor = results.get("hf_static", {}).get("tok_per_s")
    for mode in [m for m in MODES if not m.startswith("cap_")]:
        r = results.get(mode)
        if r is None:
            continue
        if "error" in r:
            rows.append(f"| {mode} | error: {r['error'].strip().splitlines()[-1][:80]} ||||||")
            continue
        agree = agreement(r["tokens"], ref) if ref and mode != "hf_dynamic" else "-"
        ratio = f"{r['tok_per_s'] / anchor:.2f}x" if anchor else "-"
        rows.append(
            f"| {mode} | {r['tok_per_s']} | {ratio} | {r['step_ms']} | {r['first_call_s']} | "
            f"{r.get('peak_reserved_GiB', '?')} | {r.get('kv_peak_mapped_GiB', '-')} | "
            f"{agree} |"
        )
    rows += ["", "| capacity (P=4096, N=256, 24 GiB) | max batch | runs |", "|---|---|---|"]
    for mode in ("cap_hf", "cap_oxygen", "cap_oxygen_fp8"):
        r = results.get(mode)
        if r is not None:
            runs = r.get("runs", r.get("error", "")[-100:])
            rows.append(f"| {mode} | {r.get('max_batch', '?')} | {runs} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES,
                    help="modes to run (default: all); cap_*: the capacity test")  # fmt: skip
    ap.add_argument("--run", choices=MODES, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, no capacity test")
    args = ap.parse_args()
    if args.smoke:
        os.environ["BENCH_GENERATE_SMOKE"] = "1"
        args.modes = [m for m in args.modes if not m.startswith("cap_")]
    if args.run:
        print(json.dumps(run_mode(args.run)), flush=True)
        return
    results = {}
    for mode in progress(args.modes, "generate modes"):
        t = time.time()
        results[mode] = spawn(mode)
        brief = {k: v for k, v in results[mode].items() if k != "tokens"}
        print(f"[{mode} {time.time() - t:.0f}s] {json.dumps(brief)[:600]}", flush=True)
    md = table(results)
    print("\n" + md)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_generate.json"), "w") as f:
            json.dump(results, f)
        with open(os.path.join(out, "bench_generate.md"), "w") as f:
            f.write(md + "\n")


if __name__ == "__main__":
    main()
