"""Where an eager decode step's time goes: torch.profiler over generate() on the H200.

bench_generate.py measured oxygen's eager decode at 19.3 ms a step against 12.4 for HF's dynamic
cache (Llama-1.1B shape, bf16, B=16, P=512), both launch-bound on the host. This profiles 16 new
tokens after a warm-up call, per mode in its own process, and prints the operators by self CPU
time and the CPU time per step, so the host work oxygen adds per layer is counted, not guessed.

    python benchmarks/profile_decode.py [hf_dynamic] [oxygen] [oxygen_hf]

Modes: hf_dynamic (stock), oxygen (oxygen_torch.enable(): pool + HF integration), oxygen_hf
(the HF integration only, torch's allocator). With $OUT set, each table is written there too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

MODES = ("hf_dynamic", "oxygen", "oxygen_hf")
B, P, N = 16, 512, 16


POOL_COUNTS = ("num_allocs", "num_maps", "num_unmaps", "pages_lent", "events_recorded",
               "map_ns", "unmap_ns")  # fmt: skip


def pool_counts(mode: str) -> dict:
    if mode != "oxygen":
        return {}
    import oxygen_torch

    s = oxygen_torch.memory_stats()
    return {k: s[k] for k in POOL_COUNTS}


def child(mode: str) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if mode == "oxygen":
        import oxygen_torch

        oxygen_torch.enable()
    elif mode == "oxygen_hf":
        from oxygen_torch.integrations.hf import integration as hf

        hf.enable_hf()
    from oxygen_torch.tools.demo_models import LLAMA_1B, random_llama

    model = random_llama(dict(LLAMA_1B), init_on_device=True)
    ids = torch.randint(1, 32000, (B, P), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=N, min_new_tokens=N,
              do_sample=False)  # fmt: skip
    with torch.no_grad():
        model.generate(ids, **kw)  # warm-up: kernels compiled, pools grown
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, **kw)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        pool = pool_counts(mode)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.generate(ids, **kw)
            torch.cuda.synchronize()
        pool = {k: v - pool[k] for k, v in pool_counts(mode).items()}
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35)
    head = f"== {mode}: generate B={B} P={P} N={N}: {wall * 1e3:.1f} ms unprofiled\n"
    if pool:  # what the pool did during the profiled call: maps and unmaps cost 20-60 us each
        head += f"pool during the profiled call: {pool}\n"
    print(head + table, flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile_decode_{mode}.txt"), "w") as f:
            f.write(head + table)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return 0
    modes = sys.argv[1:] or MODES
    bad = [m for m in modes if m not in MODES]
    if bad:  # before any mode runs: each one costs a model build on the device
        raise SystemExit(f"profile_decode: unknown mode(s) {bad}; modes: {', '.join(MODES)}")
    for mode in modes:
        subprocess.run([sys.executable, __file__, "--child", mode], timeout=240, check=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
