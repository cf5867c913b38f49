"""The main job (README: `make run`): the same generate() call with and without oxygen_torch.

    python examples/generate.py                   # random-weight Llama: tiny on CPU, 1.1B on GPU
    python examples/generate.py /path/to/ckpt     # a local checkpoint (no download)
    python examples/generate.py --batch 8 --new 64

Each side runs in its own process, so peak memory and the allocator are its own. Prints tokens/s,
peak memory, memory_stats() side by side, and whether the generated tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

GIB = 1 << 30


# the Llama-1.1B shape of the benchmarks on a GPU; a tiny one (seconds on two cores) on CPU
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


def run_side(args) -> dict:
    """One side in this process: build, warm up, time generate(), report."""
    if args.side == "oxygen":
        import oxygen_torch

        oxygen_torch.enable()  # the one line; before the model is built
    model = build_model(args)
    ids, mask = prompts(args, model.config.vocab_size)
    kw = dict(attention_mask=mask, do_sample=False, min_new_tokens=args.new)
    cuda = args.device == "cuda"
    with torch.no_grad():
        warm = ids[:, -8:]  # the unpadded tail: warm-up compiles kernels, creates pools
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new, **kw)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    res = {
        "side": args.side,
        "attn": model.config._attn_implementation,
        "seconds": dt,
        "tok_per_s": args.batch * args.new / dt,
        "tokens": out[:, args.prompt :].tolist(),
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
    return res


def spawn(side: str, argv: list[str]) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--side", side]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"the {side} side failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(args, stock: dict, ox: dict) -> None:
    rows = [
        ("attention", stock["attn"], ox["attn"]),
        ("generate() seconds", f"{stock['seconds']:.2f}", f"{ox['seconds']:.2f}"),
        ("tokens/s", f"{stock['tok_per_s']:.1f}", f"{ox['tok_per_s']:.1f}"),
    ]
    for key in ("peak_allocated_GiB", "peak_reserved_GiB", "peak_rss_GiB"):
        if key in stock and key in ox:
            rows.append((key.replace("_GiB", " (GiB)"), f"{stock[key]:.2f}", f"{ox[key]:.2f}"))
    print(
        f"\nLlama generate(): batch {args.batch}, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.device} {args.dtype}\n"
    )
    print(f"{'':22}{'stock transformers':>22}{'oxygen_torch':>22}")
    for name, a, b in rows:
        print(f"{name:22}{a:>22}{b:>22}")
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
    print(f"generated tokens agree: {verdict}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", nargs="?", help="local model directory (default: random Llama)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on GPU by default")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--new", type=int, default=None)
    p.add_argument("--side", choices=("stock", "oxygen"), help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.batch = args.batch or (16 if gpu else 4)
    args.prompt = args.prompt or (512 if gpu else 48)
    args.new = args.new or (128 if gpu else 24)
    if args.side:
        print(json.dumps(run_side(args)))
        return
    argv = sys.argv[1:]
    argv += [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--batch",
        str(args.batch),
        "--prompt",
        str(args.prompt),
        "--new",
        str(args.new),
    ]
    report(args, spawn("stock", argv), spawn("oxygen", argv))


if __name__ == "__main__":
    main()
