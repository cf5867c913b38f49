"""Tensor-parallel generate() (issue 20): oxygen against stock transformers TP in the same run,
concurrent calls merged under TP, and the host's peer copy bandwidth.

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py              # GPUs: Llama-8B shape, bf16
    torchrun --nproc-per-node 1 benchmarks/bench_tp.py              # the one-GPU figures
    python benchmarks/bench_tp.py --spawn 2 --smoke                 # CPU, gloo, tiny: plumbing

Rank 0 saves a random-weight checkpoint of the shape once (in $TMPDIR, reused), then every rank
loads it with transformers' own plan (`DistributedConfig(tp_plan="auto")`). Parts, rank 0
writing bench_tp_<N>.json / .md to $OUT:

- generate: B prompts of P tokens, N new, greedy, on stock TP and then, after
  oxygen_torch.enable(), on oxygen TP (same model, same run): tok/s and whether the tokens agree;
- multitask: calls drawn from a seed (lengths, priorities), four threads at once on oxygen
  (merged, in the steps rank 0 chooses), against the same calls one after another on stock TP
  (stock cannot take calls from threads at once under TP: its collectives would interleave):
  tok/s;
- peer (GPUs, rank 0): device-to-device copy GB/s between each pair of this host's GPUs
  (256 MiB) and `nvidia-smi topo -m`.

NVLink multicast stays off (NCCL_NVLS_ENABLE=0, the device notes). Not run on several GPUs yet.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=128),
}  # fmt: skip


def say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(f"# {msg}", flush=True)


def checkpoint(shape: str, dtype: torch.dtype) -> Path:
    """Rank 0 saves the random checkpoint (once per shape and dtype); every rank gets its path."""
    import transformers as T

    path = Path(tempfile.gettempdir()) / f"oxygen-bench-tp-{shape}-{str(dtype)[6:]}"
    if dist.get_rank() == 0 and not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = T.LlamaConfig(**SHAPES[shape], max_position_embeddings=8192)
        model = T.LlamaForCausalLM(cfg).to(dtype)
        model.save_pretrained(path)
        del model
    dist.barrier()
    return path


def load(path: Path, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype
    ).eval()
    if device == "cpu":
        model = model.to("cpu")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def gen(model, ids, new: int):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False)  # fmt: skip


def timed_generate(model, ids, new: int, device: str) -> tuple[torch.Tensor, float]:
    gen(model, ids[:, :32], 2)  # warm
    sync(device)
    t = time.perf_counter()
    out = gen(model, ids, new)
    sync(device)
    return out, time.perf_counter() - t


def calls(seed: int, n: int, vocab: int, smoke: bool) -> list[dict]:
    """n calls: rows, prompt and new-token lengths and a priority, drawn from the seed."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        rows, p = r.choice((1, 2, 4)), r.randint(16, 64) if smoke else r.randint(128, 1024)
        new = r.randint(4, 12) if smoke else r.randint(32, 256)
        g = torch.Generator().manual_seed(seed * 1000 + i)
        ids = torch.randint(1, vocab, (rows, p), generator=g)
        out.append(dict(ids=ids, new=new, priority=r.choice(("high", "normal", "low"))))
    return out


def multitask(model, work: list[dict], device: str, threaded: bool) -> tuple[list, float]:
    """The calls, four threads at once (each its share, in order) or one after another."""
    import oxygen_torch

    got: dict[int, list] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        w = work[i]
        with oxygen_torch.task(priority=w["priority"]):
            out = gen(model, w["ids"].to(device), w["new"])
        got[i] = out[:, w["ids"].shape[1] :].tolist()

    def share(k: int) -> None:
        try:
            for i in range(k, len(work), 4):
                one(i)
        except BaseException as err:  # noqa: BLE001 - reported
            errors.append(repr(err))

    sync(device)
    t = time.perf_counter()
    if threaded:
        threads = [threading.Thread(target=share, args=(k,), name=f"bench-tp-{k}")
                   for k in range(4)]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    else:
        for i in range(len(work)):
            one(i)
    sync(device)
    if errors:
        raise RuntimeError(f"multitask calls failed: {errors[:3]}")
    return [got[i] for i in range(len(work))], time.perf_counter() - t


def peer() -> dict:
    """Device-to-device copy GB/s between each pair of this host's GPUs (rank 0)."""
    n = torch.cuda.device_count()
    res = {"pairs": []}
    nbytes = 256 << 20
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            src = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}")
            dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{j}")
            dst.copy_(src)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            t = time.perf_counter()
            for _ in range(5):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(i)
            torch.cuda.synchronize(j)
            gbps = 5 * nbytes / (time.perf_counter() - t) / 1e9
            access = torch.cuda.can_device_access_peer(i, j)
            res["pairs"].append(dict(src=i, dst=j, GBps=gbps, peer_access=access))
    try:
        res["topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                     text=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        res["topo"] = f"nvidia-smi topo -m: {exc}"
    return res


def run(args) -> dict:
    import oxygen_torch

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    shape = "tiny" if args.smoke else args.shape
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = load(checkpoint(shape, dtype), dtype, device)
    world = dist.get_world_size()
    vocab = SHAPES[shape]["vocab_size"]
    b, p, n = (2, 24, 8) if args.smoke else (args.batch, args.prompt, args.new)
    ids = torch.randint(1, vocab, (b, p), generator=torch.Generator().manual_seed(1)).to(device)
    work = calls(args.seed, 8 if args.smoke else args.calls, vocab, args.smoke)
    res = dict(world=world, shape=shape, batch=b, prompt=p, new=n, seed=args.seed)

    out_stock, t_stock = timed_generate(model, ids, n, device)
    mt_stock, tm_stock = multitask(model, work, device, threaded=False)
    oxygen_torch.enable()
    oxygen_torch.apply(model)
    out_ox, t_ox = timed_generate(model, ids, n, device)
    mt_ox, tm_ox = multitask(model, work, device, threaded=True)
    new_tokens = sum(w["ids"].shape[0] * w["new"] for w in work)
    res["generate"] = dict(
        stock_tok_s=b * n / t_stock, oxygen_tok_s=b * n / t_ox, ratio=t_stock / t_ox,
        same_tokens=bool(torch.equal(out_stock, out_ox)),
    )  # fmt: skip
    res["multitask"] = dict(
        calls=len(work), new_tokens=new_tokens, stock_serial_tok_s=new_tokens / tm_stock,
        oxygen_threads_tok_s=new_tokens / tm_ox, ratio=tm_stock / tm_ox,
        same_tokens=mt_stock == mt_ox,
    )  # fmt: skip
    say(f"generate: {res['generate']}")
    say(f"multitask: {res['multitask']}")
    if device == "cuda" and dist.get_rank() == 0 and torch.cuda.device_count() > 1:
        res["peer"] = peer()
        for x in res["peer"]["pairs"]:
            say(f"peer {x['src']} -> {x['dst']}: {x['GBps']:.1f} GB/s (access {x['peer_access']})")
    dist.barrier()
    return res


def table(r: dict) -> str:
    g, m = r["generate"], r["multitask"]
    out = [
        f"| TP={r['world']}, {r['shape']} | stock TP | oxygen TP | oxygen / stock | same tokens |",
        "|---|---|---|---|---|",
        f"| generate B={r['batch']} P={r['prompt']} N={r['new']}, tok/s | "
        f"{g['stock_tok_s']:.1f} | {g['oxygen_tok_s']:.1f} | {g['ratio']:.2f}x | "
        f"{g['same_tokens']} |",
        f"| {m['calls']} calls (seed {r['seed']}), tok/s: stock one by one, oxygen 4 threads | "
        f"{m['stock_serial_tok_s']:.1f} | {m['oxygen_threads_tok_s']:.1f} | {m['ratio']:.2f}x |"
        f" {m['same_tokens']} |",
    ]
    for x in r.get("peer", {}).get("pairs", []):
        out.append(f"| peer copy {x['src']} -> {x['dst']} | | {x['GBps']:.1f} GB/s | | |")
    return "\n".join(out)


def spawn(n: int, argv: list[str]) -> int:
    """Runs n ranks of this script on this host (CPU smoke runs: no torchrun needed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], env=env))
    return max(p.wait() for p in procs)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape")
    ap.add_argument("--batch", type=int, default=16, help="generate: prompts")
    ap.add_argument("--prompt", type=int, default=512, help="generate: prompt tokens")
    ap.add_argument("--new", type=int, default=128, help="generate: new tokens")
    ap.add_argument("--calls", type=int, default=32, help="multitask: calls drawn")
    ap.add_argument("--seed", type=int, default=0, help="multitask: the calls' seed")
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (gloo)")
    ap.add_argument("--spawn", type=int, default=0, help="start this many ranks here")
    args = ap.parse_args()
    if args.spawn:
        argv, child = sys.argv[1:], []
        while argv:  # the same arguments less --spawn N (or --spawn=N)
            a = argv.pop(0)
            if a == "--spawn":
                argv.pop(0)
            elif not a.startswith("--spawn="):
                child.append(a)
        sys.exit(spawn(args.spawn, child))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("gloo" if args.smoke else "nccl")
    try:
        res = run(args)
        if dist.get_rank() == 0:
            md = table(res)
            print(md, flush=True)
            if os.environ.get("OUT"):
                name = Path(os.environ["OUT"]) / f"bench_tp_{res['world']}"
                name.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
                name.with_suffix(".md").write_text(md + "\n")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
