"""The mixed HF generate() workload of the anchor (../shared/anchors/generate_mixed_workload.py),
in one process per allocator: ``default``, ``expandable`` (expandable_segments:True) or ``oxygen``
(the pool as PyTorch's allocator, installed before CUDA initialises).

Same model shape (random-weight Llama-1.1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, bf16,
sdpa), same 14 (batch, prompt, new tokens) draws from random.Random(1), greedy with
min_new_tokens. One difference, for run time: the weights are created directly on the GPU in bf16
(the anchor builds them on the CPU in fp32 and copies), which gives the same tensors in memory and
saves ~15 s per process. ``--calls N`` keeps the first N calls (say so when quoting figures).

Prints one JSON line; also writes $OUT/gen_<mode>.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

MODES = ("default", "expandable", "oxygen")


def workload(calls: int) -> list[tuple[int, int, int]]:
    rng = random.Random(1)
    work = [
        (rng.choice([1, 4, 8, 16, 32]), rng.randint(64, 2048), rng.choice([64, 128, 256]))
        for _ in range(14)
    ]
    return work[:calls]


def setup(mode: str):
    if mode == "expandable":
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    import torch

    if mode == "oxygen":
        from oxygen_torch import pool as allocator
        from oxygen_torch.config import PoolConfig

        cfg = PoolConfig(page_size=2 << 20, reserve_fraction=0.9, backend="auto")
        if os.environ.get("OXYGEN_HYSTERESIS_MS"):  # compare settings; default pool.hysteresis_ms
            cfg.hysteresis_ms = float(os.environ["OXYGEN_HYSTERESIS_MS"])
        allocator.enable_allocator(cfg)
    return torch


def build(torch, arch=None):
    """The anchor's Llama-1.1B shape, or `arch` (a workloads.Arch of the seed family; every
    shape is built as a Llama: same sizes, no Qwen attention bias)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000,
    )  # fmt: skip
    if arch is not None:
        shape = dict(
            hidden_size=arch.hidden, intermediate_size=arch.intermediate,
            num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
            num_key_value_heads=arch.kv_heads, vocab_size=arch.vocab,
            tie_word_embeddings=arch.tied,
        )  # fmt: skip
    cfg = LlamaConfig(**shape, max_position_embeddings=8192)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model, cfg


def family_workload(seed: int):
    """A seed's workload of benchmarks/workloads.py (imported from this file's folder)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import workloads

    return workloads.family(seed)


def run(mode: str, calls: int | None, seed: int | None = None) -> dict:
    """seed None: the anchor workload (first `calls` calls); else the family's workload of that
    seed (its model shape and calls, all of them when calls is None)."""
    fam = family_workload(seed) if seed is not None else None
    work = workload(calls if calls is not None else 14) if fam is None else fam.calls[:calls]
    torch = setup(mode)
    model, cfg = build(torch, fam.arch if fam else None)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    toks = 0
    t0 = time.perf_counter()
    for b, p, n in work:
        ids = torch.randint(0, cfg.vocab_size, (b, p), device="cuda")
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                           min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
        toks += b * n
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    pa, pr = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    end_now = torch.cuda.memory_reserved()
    time.sleep(0.1)  # oxygen: idle pages leave after the hysteresis (pool.hysteresis_ms, 20 ms)
    r = {
        "mode": mode,
        "calls": len(work),
        "seed": seed,
        "arch": fam.arch.name if fam else "llama-1.1b (anchor)",
        "weights_GiB": round(base / 2**30, 3),
        "peak_alloc_GiB": round(pa / 2**30, 3),
        "peak_reserved_GiB": round(pr / 2**30, 3),
        "frag_pct": round(100 * (1 - pa / pr), 2),
        "end_reserved_GiB": round(end_now / 2**30, 3),
        "end_reserved_100ms_GiB": round(torch.cuda.memory_reserved() / 2**30, 3),
        "end_allocated_GiB": round(torch.cuda.memory_allocated() / 2**30, 3),
        "tok_per_s": round(toks / dt, 1),
        "seconds": round(dt, 1),
    }
    if mode == "oxygen":
        from oxygen_torch import pool as allocator

        s = allocator.memory_stats()
        r["oxygen"] = {k: s[k] for k in (
            "num_maps", "num_unmaps", "mean_map_latency_us", "mean_unmap_latency_us",
            "handles_created_inline", "reclaims", "pages_lent", "events_recorded",
            "handle_cache_pages", "idle_pages", "slab_cached_pages", "num_ooms")}  # fmt: skip
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=MODES)
    ap.add_argument("--calls", type=int, default=14)
    args = ap.parse_args()
    r = run(args.mode, args.calls)
    print(json.dumps(r), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"gen_{args.mode}.json"), "w") as f:
            json.dump(r, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
