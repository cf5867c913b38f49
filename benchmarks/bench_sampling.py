"""The engine's logits processing and draw for a step's rows (engine/sampling.py), on a GPU:
transformers' processors in PyTorch (top-p by a sort; the anchor) against the top-k candidates
path (scheduler.sampling_kernel "topk", the default: the warpers and the draw over each row's
top_k + 64 largest scores, no sort of the vocabulary), and greedy, at 1, 64 and 256 rows of a
128k vocabulary.

    python benchmarks/bench_sampling.py                     # H200: rows 1 64 256, vocab 128256
    python benchmarks/bench_sampling.py --rows 256 --vocab 32000 --top-p 0.9

Per row count: the median ms of a Sampler call (CUDA events around it, the GPU time; the
host's launch is in it where it outlasts the GPU's work) for greedy rows, the PyTorch
processors and the topk path (processed scores not wanted, as in a step where no call asks
output_scores), the topk path's time over the processors', and the share of the topk path's
tokens equal to the processors' (the same seeds: 1.0 but for cuts within rounding and ties at a
top-p cut), and the path's candidates alone: the chunk kernel (`top_candidates`, what the
path takes on the GPU) against torch.topk over whole rows (what it took before). Issue 34's
goal: logits and sampling <= 10 % of a decode step at 256 rows (the
engine's decode step at 256 rows: RESULTS.md). A fused one-kernel variant this benchmark
measured before ("fused": the warpers, top-p by bisection, and the draw in one kernel) was
slower than both at every row count and was removed (its figures: RESULTS.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics

import torch
from oxygen_torch.triton_kernels.sampling import top_candidates

from oxygen_torch.engine.sampling import TIE_SLACK, RowSample, Sampler, SamplingParams


def timed(call, runs: int) -> float:
    """Median ms of call() on the current stream, after a few warm-up calls."""
    for _ in range(3):
        call()
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256],
                    help="row counts, one table line each (default: 1 64 256)")  # fmt: skip
    ap.add_argument("--vocab", type=int, default=128256, help="vocabulary (default: 128256)")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--top-k", type=int, default=50,
                    help="0: off, where the topk path hands the step to the processors "
                         "(transformers' default: 50)")  # fmt: skip
    ap.add_argument("--runs", type=int, default=20, help="timed calls a figure (median)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sampling.py: needs a CUDA device (the CPU runs the sort only)")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sampled = SamplingParams(do_sample=True, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k)  # fmt: skip
    print("| rows | greedy ms | torch processors ms | topk ms | topk / torch | topk tokens = "
          "torch's | candidates: chunk kernel / torch.topk ms (ratio) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for k in args.rows:
        # logits as a model gives them: bf16, a few likely tokens over a long tail
        logits = (torch.randn(k, args.vocab, device=dev, generator=gen) * 2).bfloat16()
        greedy = [RowSample(SamplingParams(), 0, i) for i in range(k)]
        rows = [RowSample(dataclasses.replace(sampled, seed=i), 3, i) for i in range(k)]
        torch_s, topk = Sampler(args.vocab, dev, "torch"), Sampler(args.vocab, dev, "topk")
        torch_ms = timed(functools.partial(torch_s, logits, rows), args.runs)
        topk_ms = timed(functools.partial(topk, logits, rows, scores_wanted=False), args.runs)
        greedy_ms = timed(functools.partial(torch_s, logits, greedy), args.runs)
        want, _ = torch_s(logits, rows)
        same = (topk(logits, rows, scores_wanted=False)[0] == want).float().mean().item()
        # the topk path's candidates alone: the chunk kernel (top_candidates) against
        # torch.topk over whole rows, the width the path asks (top_k + the tie slack)
        width = min(args.vocab, max(args.top_k, 1) + TIE_SLACK)
        cand_ms = timed(functools.partial(top_candidates, logits, width), args.runs)
        whole_ms = timed(functools.partial(logits.topk, width, dim=-1), args.runs)
        print(f"| {k} | {greedy_ms:.3f} | {torch_ms:.3f} | {topk_ms:.3f} | "
              f"{topk_ms / torch_ms:.2f}x | {same:.3f} | {cand_ms:.3f} / {whole_ms:.3f} "
              f"({cand_ms / whole_ms:.2f}x) |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
