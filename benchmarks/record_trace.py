"""Record the allocation trace of a real HF generate() run on the GPU, for the pool's CPU replay
test (tests/test_pool_trace.py).

The model and workload are the anchor script generate_mixed_workload.py (../shared/anchors/):
random-weight Llama-1.1B shape, bf16, sdpa, greedy, cut to the first --calls generate() calls with
at most --max-new new tokens each so the trace stays small. PyTorch's default caching allocator
runs; torch.cuda.memory._record_memory_history records every block's alloc and free, and the trace
keeps only (op, size, block id, stream): allocator-independent lifetimes.

Output: $OUT/generate_trace.jsonl.gz (or --out). First line: a JSON header; then one JSON array
per event: ["a", size, id, stream] or ["f", size, id, stream]. Ids are dense and reused after a
free; streams are numbered in order of appearance.

    python benchmarks/record_trace.py            # on the H200; then commit the file under
                                                 # tests/data/generate_trace.jsonl.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time


def workload(calls: int, max_new: int) -> list[tuple[int, int, int]]:
    rng = random.Random(1)  # the anchor's seed and draw order
    work = [
        (rng.choice([1, 4, 8, 16, 32]), rng.randint(64, 2048), rng.choice([64, 128, 256]))
        for _ in range(14)
    ]
    return [(b, p, min(n, max_new)) for b, p, n in work[:calls]]


def build_model():
    from oxygen_torch.tools.demo_models import random_llama

    model = random_llama()
    model.config._attn_implementation = "sdpa"
    return model, model.config


def compact(events: list[dict]) -> tuple[list[list], dict]:
    """Alloc/free events -> [op, size, id, stream] with dense, reused ids."""
    has_requested = any(e["action"] == "free_requested" for e in events)
    free_action = "free_requested" if has_requested else "free_completed"
    ids: dict[int, int] = {}
    spare: list[int] = []
    streams: dict[int, int] = {}
    out = []
    next_id = 0
    for e in events:
        act = e["action"]
        if act not in ("alloc", free_action):
            continue
        st = streams.setdefault(int(e.get("stream", 0)), len(streams))
        addr, size = int(e["addr"]), int(e["size"])
        if act == "alloc":
            if spare:
                i = spare.pop()
            else:
                i, next_id = next_id, next_id + 1
            ids[addr] = i
            out.append(["a", size, i, st])
        elif addr in ids:  # frees of blocks allocated before recording began are dropped
            i = ids.pop(addr)
            spare.append(i)
            out.append(["f", size, i, st])
    return out, {"free_action": free_action, "streams": len(streams), "ids": next_id}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=6, help="generate() calls of the anchor workload")
    ap.add_argument("--max-new", type=int, default=64, help="cap on new tokens per call")
    ap.add_argument(
        "--out", default=None, help="output path (default $OUT/generate_trace.jsonl.gz)"
    )
    args = ap.parse_args()

    import torch

    model, cfg = build_model()  # weights before recording: the trace is the workload's churn
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=5_000_000
    )
    t0 = time.perf_counter()
    toks = 0
    for b, p, n in workload(args.calls, args.max_new):
        ids = torch.randint(0, cfg.vocab_size, (b, p), device="cuda")
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        toks += b * n
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = snap["device_traces"][torch.cuda.current_device()]
    ops, info = compact(events)
    header = {
        "format": "oxygen-alloc-trace/1",
        "what": "HF generate(), random-weight Llama-1.1B shape, bf16, sdpa, greedy",
        "workload": workload(args.calls, args.max_new),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "events": len(ops),
        "weights_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
        "tokens": toks,
        "seconds": round(time.perf_counter() - t0, 1),
        **info,
    }
    path = args.out or os.path.join(os.environ.get("OUT", "/tmp"), "generate_trace.jsonl.gz")
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(header) + "\n")
        for op in ops:
            f.write(json.dumps(op, separators=(",", ":")) + "\n")
    print(json.dumps({k: header[k] for k in ("events", "workload", "seconds", "streams")}))
    print(f"wrote {path} ({os.path.getsize(path) / 2**20:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
