"""The main job (README: `make run`): the same generate() call with and without oxygen_torch.

    python examples/generate.py                   # random-weight Llama: tiny on CPU, 1.1B on GPU
    python examples/generate.py /path/to/ckpt     # a local checkpoint (no download)
    python examples/generate.py --batch 8 --new 64 --runs 9

Each side runs in its own process, so peak memory and the allocator are its own. Each warms up
with the very call it is timed on (kernels compiled, pools made), then the sides take turns, one
timed call each, so that a machine whose load changes (other jobs on a shared CPU) weighs on both
alike; `--sequential` runs one side after the other instead, for a model that fits only once.
Prints what was compared, the median and the spread (min-max) of each side's times, the ratio
of the medians, peak memory, memory_stats(), and whether the generated tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

GIB = 1 << 30

# the Llama-1.1B shape of the benchmarks on a GPU; a tiny one (a fraction of a second a call on
# two cores) on CPU
LLAMA_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # fmt: skip
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024)  # fmt: skip


def build_model(args):
    import transformers as T

    dtype = getattr(torch, args.dtype)
    if not args.checkpoint:
        shape = LLAMA_1B if args.device == "cuda" else TINY
        torch.manual_seed(0)  # random weights, the same on both sides
        model = T.LlamaForCausalLM(T.LlamaConfig(**shape, max_position_embeddings=4096))
    else:
        model = T.AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype)
    model = model.to(dtype).to(args.device).eval()
    model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
    model.generation_config.eos_token_id = None  # fixed length: both sides make the same work
    return model


def describe_model(args, model) -> str:
    c = model.config
    heads, kv = c.num_attention_heads, getattr(c, "num_key_value_heads", c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    params = sum(p.numel() for p in model.parameters())
    name = "random-weight Llama"
    if args.checkpoint:
        name = f"{os.path.basename(os.path.normpath(args.checkpoint))} ({c.model_type})"
    return (
        f"{name}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, {heads} heads ({kv} KV) "
        f"of {head_dim}, vocab {c.vocab_size}; {params / 1e6:.1f} M parameters, {args.dtype}"
    )


def prompts(args, vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (args.batch, args.prompt), generator=g)
    mask = torch.ones_like(ids)
    for i in range(1, args.batch, 2):  # every other row left-padded, as a tokenizer would
        pad = (i * 7) % max(1, args.prompt // 2)
        mask[i, :pad] = 0
        ids[i, :pad] = 0
    return ids.to(args.device), mask.to(args.device)


def oxygen_stats() -> dict:
    import oxygen_torch

    s = oxygen_torch.memory_stats()
    keys = ("allocated_bytes", "mapped_bytes", "peak_mapped_bytes", "fragmentation")
    return {"kv_pools": oxygen_torch.kv_stats(), "memory_stats": {k: s[k] for k in keys}}


def serve_side(args) -> None:
    """One side in this process: build, warm up, then one timed generate() per "run" line on
    stdin, and the report at "done". Replies are JSON lines on the real stdout; anything a
    library prints goes to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.side == "oxygen":
        import oxygen_torch

        oxygen_torch.enable()  # the one line; before the model is built
    model = build_model(args)
    ids, mask = prompts(args, model.config.vocab_size)
    kw = dict(attention_mask=mask, do_sample=False, max_new_tokens=args.new,
              min_new_tokens=args.new)  # fmt: skip
    cuda = args.device == "cuda"

    def call() -> tuple[float, list]:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, **kw)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, out[:, args.prompt :].tolist()

    for _ in range(args.warmup):
        call()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    n = torch.get_num_threads()
    device = f"cuda ({torch.cuda.get_device_name()})" if cuda else f"cpu, {n} torch thread"
    device += "s" if not cuda and n > 1 else ""
    reply.write(json.dumps({"model": describe_model(args, model), "device": device}) + "\n")
    runs = []
    for line in sys.stdin:
        if line.strip() != "run":
            break
        dt, out = call()
        runs.append(out)
        reply.write(json.dumps({"seconds": dt}) + "\n")
    import transformers

    res = {
        "attn": model.config._attn_implementation,
        "tokens": runs[-1] if runs else [],
        "stable": all(r == runs[0] for r in runs),  # greedy: every call the same tokens
        "versions": f"torch {torch.__version__}, transformers {transformers.__version__}",
        "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
    }
    if cuda:
        try:
            res["peak_allocated_GiB"] = torch.cuda.max_memory_allocated() / GIB
            res["peak_reserved_GiB"] = torch.cuda.max_memory_reserved() / GIB
        except RuntimeError:  # a pluggable allocator without device stats: memory_stats() below
            res["peak_allocated_GiB"] = res["peak_reserved_GiB"] = float("nan")
    if args.side == "oxygen":
        res.update(oxygen_stats())
    reply.write(json.dumps(res) + "\n")


class Side:
    """A side's process: started, warmed up, then asked for one timed call at a time."""

    def __init__(self, side: str, argv: list[str]):
        self.side = side
        self.err = tempfile.TemporaryFile("w+")
        cmd = [sys.executable, os.path.abspath(__file__), *argv, "--side", side]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, text=True, bufsize=1)  # fmt: skip
        self.info = self._read()
        self.seconds: list[float] = []

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.err.seek(0)
            sys.stderr.write(self.err.read()[-4000:])
            raise SystemExit(f"the {self.side} side failed (exit {self.proc.returncode})")
        return json.loads(line)

    def run(self) -> None:
        self.proc.stdin.write("run\n")
        self.seconds.append(self._read()["seconds"])

    def finish(self) -> dict:
        self.proc.stdin.write("done\n")
        res = {**self.info, **self._read()}
        self.proc.wait()
        return res


def compare(args, argv: list[str]) -> tuple[dict, dict, list[float]]:
    """Both sides' reports, with their times; and each round's oxygen / stock time."""
    if args.sequential:
        stock = Side("stock", argv)
        for _ in range(args.runs):
            stock.run()
        s = stock.finish()
        ox = Side("oxygen", argv)
        for _ in range(args.runs):
            ox.run()
        o = ox.finish()
    else:
        stock, ox = Side("stock", argv), Side("oxygen", argv)
        for i in range(args.runs):  # the first to go alternates too
            for side in (stock, ox) if i % 2 == 0 else (ox, stock):
                side.run()
        s, o = stock.finish(), ox.finish()
    s["seconds"], o["seconds"] = stock.seconds, ox.seconds
    return s, o, [b / a for a, b in zip(stock.seconds, ox.seconds)]


def _calls(n: int, what: str) -> str:
    return f"{n} {what} call{'' if n == 1 else 's'}"


def report(args, stock: dict, ox: dict, ratios: list[float]) -> None:
    order = "one side after the other" if args.sequential else "the sides take turns, call by call"
    print(
        "\nCompared: the same greedy generate() call, stock transformers against "
        "oxygen_torch.enable(), each side in its own process\n"
        f"  model:   {stock['model']}\n"
        f"  call:    batch {args.batch}, prompt {args.prompt} tokens (every other row "
        f"left-padded), {args.new} new tokens\n"
        f"  device:  {stock['device']}; {stock['versions']}\n"
        f"  timing:  per side {_calls(args.warmup, 'warm-up')}, then {_calls(args.runs, 'timed')};"
        f" {order}\n"
    )
    med = {k: statistics.median(d["seconds"]) for k, d in (("stock", stock), ("ox", ox))}
    rows = [
        ("attention", stock["attn"], ox["attn"]),
        ("generate() s, median", f"{med['stock']:.3f}", f"{med['ox']:.3f}"),
        (
            "generate() s, min-max",
            *(f"{min(d['seconds']):.3f}-{max(d['seconds']):.3f}" for d in (stock, ox)),
        ),
        ("tokens/s, median", *(f"{args.batch * args.new / med[k]:.1f}" for k in ("stock", "ox"))),
    ]
    for key in ("peak_allocated_GiB", "peak_reserved_GiB", "peak_rss_GiB"):
        if key in stock and key in ox:
            rows.append((key.replace("_GiB", " (GiB)"), f"{stock[key]:.2f}", f"{ox[key]:.2f}"))
    print(f"{'':24}{'stock transformers':>22}{'oxygen_torch':>22}")
    for name, a, b in rows:
        print(f"{name:24}{a:>22}{b:>22}")
    rounds = "" if args.sequential else f"; per round {min(ratios):.2f}-{max(ratios):.2f}"
    print(
        f"oxygen / stock generate() time, ratio of the medians: {med['ox'] / med['stock']:.2f} "
        f"(below 1: oxygen faster){rounds}"
    )
    for pool in ox.get("kv_pools") or []:
        if isinstance(pool, dict):
            print(
                f"oxygen KV pool ({pool['backing']}): peak {pool['peak_blocks_used']} of "
                f"{pool['blocks_total']} blocks of {pool['block_tokens']} tokens, peak "
                f"{pool['peak_mapped_bytes'] / GIB:.3f} GiB mapped; now {pool['blocks_used']} "
                f"blocks, {pool['mapped_bytes'] / GIB:.3f} GiB"
            )
    print(f"oxygen memory_stats(): {ox.get('memory_stats')}")
    a, b = torch.tensor(stock["tokens"]), torch.tensor(ox["tokens"])
    same = (a == b).int().cumprod(1).sum().item()
    verdict = "yes" if torch.equal(a, b) else f"no: {same} of {a.numel()} before divergence"
    stable = " (each side gave the same tokens on every call)"
    if not (stock["stable"] and ox["stable"]):
        stable = f" (calls of one side differed: stock {'no' if stock['stable'] else 'yes'}, "
        stable += f"oxygen {'no' if ox['stable'] else 'yes'})"
    print(f"generated tokens agree: {verdict}{stable}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("checkpoint", nargs="?", help="local model directory (default: random Llama)")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda where torch sees a GPU, else cpu",
    )
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on GPU by default")
    p.add_argument("--batch", type=int, default=None, help="rows (4 on CPU, 16 on GPU)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (48 CPU, 512 GPU)")
    p.add_argument("--new", type=int, default=None, help="new tokens (24 CPU, 128 GPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per side (default 2)")
    p.add_argument("--runs", type=int, default=5, help="timed calls per side (default 5)")
    p.add_argument(
        "--sequential",
        action="store_true",
        help="one side's process after the other's (a model that fits only once)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per side (default: 1 for the built-in tiny model on CPU, whose "
        "steps are too small to share: with 2 threads on a busy 2-core machine its calls took "
        "10x longer; else torch's default)",
    )
    p.add_argument("--side", choices=("stock", "oxygen"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.runs < 1 or args.warmup < 0:
        p.error("--runs must be at least 1 and --warmup at least 0")
    gpu = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.batch = args.batch or (16 if gpu else 4)
    args.prompt = args.prompt or (512 if gpu else 48)
    args.new = args.new or (128 if gpu else 24)
    if args.threads is None and not gpu and not args.checkpoint:
        args.threads = 1
    if args.side:
        serve_side(args)
        return
    argv = [*([args.checkpoint] if args.checkpoint else []), "--device", args.device,
            "--dtype", args.dtype, "--batch", str(args.batch), "--prompt", str(args.prompt),
            "--new", str(args.new), "--warmup", str(args.warmup),
            "--threads", str(args.threads or 0)]  # fmt: skip
    report(args, *compare(args, argv))


if __name__ == "__main__":
    main()
