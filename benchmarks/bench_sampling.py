"""The engine's logits processing and draw for a step's rows (engine/sampling.py), on a GPU:
top-p by transformers' sort (the anchor) against the cut kernel (scheduler.top_p_kernel "cut",
triton_kernels/sampling.py top_p_cut), and greedy, at 1, 64 and 256 rows of a 128k vocabulary.

    python benchmarks/bench_sampling.py                     # H200: rows 1 64 256, vocab 128256
    python benchmarks/bench_sampling.py --rows 256 --vocab 32000 --top-p 0.9

Per setting and row count: the median ms of a Sampler call (CUDA events around it, the GPU
time; the host's launch is in it where it outlasts the GPU's work), the cut kernel's ms beside
the sort's and their ratio, and whether the two kept the same tokens (the cut keeps every token
tied at the cut; bf16 logits tie often far below it). Issue 34's goal: logits and sampling
<= 10 % of a decode step at 256 rows (the engine's decode step at 256 rows: RESULTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from oxygen_torch.engine.sampling import RowSample, Sampler, SamplingParams


def timed(sampler: Sampler, logits: torch.Tensor, rows: list, runs: int) -> float:
    """Median ms of sampler(logits, rows) on the current stream, after a few warm-up calls."""
    for _ in range(3):
        sampler(logits, rows)
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        sampler(logits, rows)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--runs", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampling.py: needs a CUDA device (the CPU runs the sort only)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sampled = SamplingParams(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    print("| rows | greedy ms | top-p by sort ms | top-p by cut ms | cut / sort | same kept |")
    print("|---|---|---|---|---|---|")
    for k in args.rows:
        # logits as a model gives them: bf16, a few likely tokens over a long tail
        logits = (torch.randn(k, args.vocab, device=dev, generator=gen) * 2).bfloat16()
        greedy = [RowSample(SamplingParams(), 0, i) for i in range(k)]
        rows = [RowSample(dataclasses.replace(sampled, seed=i), 3, i) for i in range(k)]
        out = {}
        for kind in ("sort", "cut"):
            s = Sampler(args.vocab, dev, top_p_kernel=kind)
            out[kind] = (timed(s, logits, rows, args.runs), s(logits, rows)[1])
        greedy_ms = timed(Sampler(args.vocab, dev), logits, greedy, args.runs)
        (sort_ms, sort_scores), (cut_ms, cut_scores) = out["sort"], out["cut"]
        same = bool(torch.equal(sort_scores.isinf(), cut_scores.isinf()))
        print(f"| {k} | {greedy_ms:.3f} | {sort_ms:.3f} | {cut_ms:.3f} | "
              f"{cut_ms / sort_ms:.2f}x | {same} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
