"""Where a prefix-cache hit's host time goes against a miss's: cProfile over one generate() each.

On the H200 (Llama-1.1B, bf16, 2,000-token system prompt + 100-token turn, batch 1) a GPU hit's
TTFT was 34.9 ms against a miss's 27.1 ms although the hit cut GPU time from 9.7 to 2.9 ms: TTFT
is host time. This builds a tiny random-weight Llama (2 layers, hidden 64: the model's compute is
small, so the Python around it shows), turns the prefix cache on with a CPU tier attached, and
times generate(max_new_tokens=1) on prompts of SYSTEM shared + USER own tokens:

- off: the prefix cache off (bench_tier.py's miss), a second model object with the same weights;
- miss: the cache on, a system prompt it has never seen (it pays the lookup and the insert);
- hit: the cache on, the shared system prompt, its blocks in the pool's device blocks;
- tier: as hit, but every cached block moved down to the CPU tier before the call (outside the
  timing), so the call promotes them first.

Per mode: the wall time and the calling thread's CPU time (time.thread_time) of --repeat calls
(no profiler; median and min), and the thread CPU time inside the prefix cache's two entry
points (generate.py's _start_on_prefix before the forward, finish after it), then one call
under cProfile timed by thread CPU time: the functions of interest (prefix cache, prefill plan,
the model's forward) and the top functions by cumulative time, in ms per call. On CPU torch
runs on one thread here (--threads 1), so the thread's CPU time is all the host work of a call
and does not count time the process spent descheduled (a shared machine). cProfile inflates
Python-heavy code; compare modes with each other, and the medians for absolute figures.

    python benchmarks/profile_prefix_host.py                  # CPU
    python benchmarks/profile_prefix_host.py --device cuda    # the same on a GPU
    python benchmarks/profile_prefix_host.py --modes hit tier --top 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch
from bench_tier import demote_all  # (benchmarks/ is the script's own directory)

MODES = ("off", "miss", "hit", "tier")
SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=1,
    num_key_value_heads=1,
    head_dim=64,  # a head_dim the CUDA kernels take
    vocab_size=1024,
)
# (file suffix, function name) shown for every mode whether or not it is in the top list
WATCH = (
    ("integrations/hf/generate.py", "_start_on_prefix"),
    ("integrations/hf/generate.py", "finish"),
    ("integrations/hf/prefix.py", "prompt_of"),
    ("integrations/hf/prefix.py", "start_on_cache"),
    ("integrations/hf/prefix.py", "keep"),
    ("integrations/hf/prefix.py", "_columns"),
    ("kv/prefix.py", "_chain"),  # (before the walks were memoized)
    ("kv/prefix.py", "_walk"),
    ("kv/prefix.py", "peek"),
    ("kv/prefix.py", "lookup"),
    ("kv/prefix.py", "insert"),
    ("kv/prefix.py", "promote"),
    ("kv/prefix.py", "sweep"),
    ("kv/prefix.py", "demote"),
    ("kv/core.py", "_begin_step"),
    ("kv/core.py", "_reserve"),
    ("kv/core.py", "_prefill_plan"),
    ("kv/core.py", "_reload"),
    ("kv/core.py", "write"),
    ("kv/step_attention.py", "attend"),
    ("generation/utils.py", "generate"),
    ("llama/modeling_llama.py", "forward"),
)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build(device: str, dtype: torch.dtype, prefix: bool, tier_bytes: int):
    from oxygen_torch.config import load_config
    from oxygen_torch.integrations.hf import integration as hf
    from oxygen_torch.tools.demo_models import random_llama

    model = random_llama(SHAPE, dtype=dtype, device=device, max_position_embeddings=4096)
    cfg = load_config(
        kv={"prefix_cache": prefix, "block_tokens": 16, "prefix_cache_bytes": 256 << 20},
        pool={"cpu_tier_bytes": tier_bytes},
    )
    return hf.apply(model, cfg)


def prefix_counts() -> dict:
    from oxygen_torch.kv import pool_stats

    return next((p["prefix_cache"] for p in pool_stats() if p.get("prefix_cache")), {})


def watched(stats: pstats.Stats) -> list[tuple[str, int, float, float]]:
    """(name, calls, cumulative ms, own ms) of the WATCH functions found in the profile."""
    out = []
    for suffix, name in WATCH:
        found = [
            (ct, calls, tt)
            for (file, _, fn), (_, calls, tt, ct, _) in stats.stats.items()
            if fn == name and file.replace(os.sep, "/").endswith(suffix)
        ]
        if found:  # (every llama module has a forward: the outermost one is shown)
            ct, calls, tt = max(found)
            label = f"{suffix.rsplit('/', 1)[-1][:-3]}.{name}"
            out.append((label, calls, ct * 1e3, tt * 1e3))
    return out


class EntryTimer:
    """Thread CPU time spent in the integration's prefix-cache entry points, per call."""

    def __init__(self):
        from oxygen_torch.integrations.hf import generate as gen

        self.ms: dict[str, list[float]] = {"_start_on_prefix": [], "finish": []}
        for name in self.ms:
            setattr(gen, name, self._wrap(name, getattr(gen, name)))

    def _wrap(self, name, fn):
        def timed(*a, **kw):
            t = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.ms[name].append((time.thread_time() - t) * 1e3)

        return timed

    def take(self) -> dict[str, float]:
        """Median ms per call of each entry point since the last take."""
        out = {k: statistics.median(v) if v else 0.0 for k, v in self.ms.items()}
        for v in self.ms.values():
            v.clear()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--system", type=int, default=2000, help="shared system-prompt tokens")
    ap.add_argument("--user", type=int, default=100, help="each call's own tokens")
    ap.add_argument("--repeat", type=int, default=15, help="timed calls per mode (median)")
    ap.add_argument("--top", type=int, default=25, help="top functions by cumulative time")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    dtype = torch.float32 if dev == "cpu" else torch.bfloat16
    on = build(dev, dtype, True, 64 << 20)
    off = build(dev, dtype, False, 0) if "off" in args.modes else None
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> torch.Tensor:
        return torch.randint(1, SHAPE["vocab_size"], (1, n), generator=g).to(dev)

    system = rand(args.system)

    def call(model, ids):
        with torch.no_grad():
            sync(dev)
            t, c = time.perf_counter(), time.thread_time()
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False
            )
            sync(dev)
            return out, time.perf_counter() - t, time.thread_time() - c

    def prompt(mode: str) -> tuple:
        """(model, ids) of one call of `mode`, its set-up (demotion) done."""
        if mode == "off":
            return off, torch.cat([rand(args.system), rand(args.user)], 1)
        if mode == "miss":
            return on, torch.cat([rand(args.system), rand(args.user)], 1)
        if mode == "tier":
            demote_all()
        return on, torch.cat([system, rand(args.user)], 1)

    call(on, torch.cat([system, rand(args.user)], 1))  # fills the cache with the system prompt
    for mode in args.modes:  # warm every path once
        call(*prompt(mode))
    medians, entry = {}, EntryTimer()
    print(f"ms per call, {args.repeat} calls a mode: wall median / min, thread CPU median / min")
    for mode in args.modes:
        before = dict(prefix_counts())
        runs = [call(*prompt(mode))[1:] for _ in range(args.repeat)]
        after = prefix_counts()
        wall, cpu = ([r[i] * 1e3 for r in runs] for i in (0, 1))
        medians[mode] = statistics.median(cpu)
        pre = entry.take()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses", "promoted")}
        print(
            f"{mode:5s} wall {statistics.median(wall):7.2f} / {min(wall):7.2f}  cpu "
            f"{medians[mode]:7.2f} / {min(cpu):7.2f}  prefix cache: start "
            f"{pre['_start_on_prefix']:.3f} + finish {pre['finish']:.3f}  ({delta})"
        )
    for mode in args.modes:
        model, ids = prompt(mode)
        prof = cProfile.Profile(time.thread_time)
        prof.enable()
        _, _, dt = call(model, ids)
        prof.disable()
        st = pstats.Stats(prof)
        print(f"\n=== {mode}: {dt * 1e3:.2f} ms thread CPU under cProfile (median without: "
              f"{medians[mode]:.2f} ms) ===")  # fmt: skip
        print(f"{'function':40s} {'calls':>7s} {'cum ms':>9s} {'own ms':>9s}")
        for label, calls, cum, own in watched(st):
            print(f"{label:40s} {calls:7d} {cum:9.3f} {own:9.3f}")
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(args.top)
        text = buf.getvalue()
        print(text[text.find("   ncalls") :])  # the table, without pstats' preamble


if __name__ == "__main__":
    main()
