"""One rank of the tensor-parallel test (tests/test_tp_gloo.py): run by that test, one process a
rank, with torch.distributed's environment set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Loads the tiny checkpoint with transformers' own tensor-parallel plan (gloo on the CPU), runs
generate() stock, then after oxygen_torch.enable() on the same model, then the wide call again on
a pool it does not fit (row groups), then calls from several threads at once (merged in steps
rank 0 chooses; on a small pool, with preemption), and writes what the test compares to a JSON
file per rank: the tokens, the cache the call used, its KV geometry on this rank, the block
tables it decided, the oversubscription counters and the step schedulers' figures."""

from __future__ import annotations

import faulthandler
import json
import logging
import sys
import threading
import time
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import oxygen_torch
from oxygen_torch import _patching
from oxygen_torch.integrations.hf import batched, compat
from oxygen_torch.kv import pool_stats as kv_pool_stats


def prompts(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((3, 1, 0)):  # left padding
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return ids, mask


CALLS = {
    "wide": dict(max_new_tokens=4, do_sample=False),
    "greedy": dict(max_new_tokens=9, do_sample=False),
    "beams": dict(max_new_tokens=6, do_sample=False, num_beams=2),
    "sampled": dict(max_new_tokens=7, do_sample=True, top_k=20),
}


WIDE_ROWS = 130  # one 256-token block a row: more than the small pool holds


def wide(seed: int):
    g = torch.Generator().manual_seed(seed + 100)
    ids = torch.randint(1, 128, (WIDE_ROWS, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, :2] = 0  # left padding on every third row
    return ids * mask, mask


def run(model, seed: int, calls=None) -> dict:
    got = {}
    for name, kw in (calls or CALLS).items():
        ids, mask = wide(seed) if name == "wide" else prompts(seed)
        torch.manual_seed(seed)  # the same draws on every rank (their logits agree)
        out = model.generate(
            ids, attention_mask=mask, return_dict_in_generate=True, pad_token_id=0, **kw
        )
        cache = compat.output_cache(out)
        entry = {"tokens": out.sequences[:, ids.shape[1] :].tolist(), "cache": type(cache).__name__}
        core = getattr(cache, "_core", None)
        if core is not None and core.pool is not None:
            entry["kv_heads"] = core.pool.key.num_kv_heads
            entry["blocks"] = [list(b) for b in core.seqs.blocks]
        got[name] = entry
    return got


# concurrent calls, thread -> its calls (rows, prompt length, new tokens, extra generate() args);
# "solo" asks for hidden states: its forwards cannot merge and are steps of their own
THREADS = {
    "tp-a": [(2, 9, 12, {}), (1, 20, 6, {})],
    "tp-b": [(3, 14, 10, {})],
    "tp-c": [(1, 7, 8, {"output_hidden_states": True, "return_dict_in_generate": True})],
}
# on a pool of 31 blocks (one a row): 48 rows at once, so calls wait and the low ones are
# preempted for the high one
CONTENDED = {f"tp-{i}": [(12, 11, 40, {})] for i in range(4)}
HIGH = "tp-3"  # starts a little after the others, which hold the pool by then


def thread_prompt(name: str, k: int, rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + sum(map(ord, name)) * 10 + k)
    ids = torch.randint(1, 128, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, : length // 3] = 0  # left padding on the first row
    return ids * mask, mask


def thread_call(model, name: str, k: int, spec, seed: int) -> list:
    rows, length, new, extra = spec
    ids, mask = thread_prompt(name, k, rows, length, seed)
    prio = "high" if name == HIGH else "low"
    with torch.no_grad(), oxygen_torch.task(priority=prio, name=name):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             pad_token_id=0, **extra)  # fmt: skip
    seqs = out.sequences if not isinstance(out, torch.Tensor) else out
    return seqs[:, length:].tolist()


def run_threads(model, plan: dict, seed: int, concurrent: bool) -> dict:
    """Every thread's calls, the threads at once (or one after another: the reference)."""
    got, errors = {}, []

    def work(name):
        if concurrent and name == HIGH and plan is CONTENDED:
            time.sleep(0.3)
        try:
            got[name] = [
                thread_call(model, name, k, spec, seed) for k, spec in enumerate(plan[name])
            ]
        except BaseException as err:  # noqa: BLE001 - reported to the test
            errors.append(f"{name}: {err!r}")

    threads = [threading.Thread(target=work, args=(n,), name=n) for n in plan]
    for t in threads:
        t.start()
        if not concurrent:
            t.join()
    for t in threads:
        t.join()
    return {"tokens": got, "errors": errors}


def sched_stats(model) -> list:
    return sorted(
        ({"steps": m.scheduler.stats.steps, "batch_sizes": m.scheduler.stats.batch_sizes,
          "preemptions": m.scheduler.stats.preemptions, "swaps": m.scheduler.stats.swaps}
         for m in batched._mergers[model].values()),
        key=lambda s: s["steps"],
    )  # fmt: skip


def phase(name: str) -> None:
    """Where this rank is, in its output (the test shows a failed rank's output): a rank that
    dies in native code (once in CI: heap corruption, no Python stack) says how far it got."""
    print(f"tp_worker rank {dist.get_rank() if dist.is_initialized() else '?'}: {name}",
          flush=True)  # fmt: skip


def main(path: str, out_path: str, seed: int) -> None:
    warnings.simplefilter("ignore", FutureWarning)
    # a rank still running near the test's limit (240 s) says where each of its threads is
    # (once seen: a hang on the CPU machine under CI's load, not reproduced since)
    faulthandler.dump_traceback_later(200, exit=False)
    faulthandler.enable(all_threads=True)  # a native crash (once: heap corruption) says where
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
    ).eval()
    text = model.config.get_text_config(decoder=True)
    phase("stock")
    result = {"rank": dist.get_rank(), "tp_size": model.tp_size, "stock": run(model, seed)}
    result["stock_threads"] = run_threads(model, THREADS, seed, concurrent=False)
    result["stock_contended"] = run_threads(model, CONTENDED, seed, concurrent=False)
    phase("enable")
    oxygen_torch.enable()
    oxygen_torch.apply(model)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    _patching.log.addHandler(handler)
    try:
        phase("oxygen")
        result["oxygen"] = run(model, seed)
        # a pool too small for the wide call: it runs as row groups (kv.oversubscribe), which
        # every rank must cut alike (the groups' collectives pair up across ranks)
        phase("oversubscribed")
        oxygen_torch.apply(model, kv={"block_tokens": 256, "arena_bytes": 8 << 20})
        result["oversubscribed"] = run(model, seed, {"wide": CALLS["wide"]})["wide"]
        small = [p for p in kv_pool_stats() if p["block_tokens"] == 256]
        result["split"] = [p["oversubscribed"] for p in small]
        result["small_blocks"] = [p["blocks_total"] for p in small]
        # concurrent calls from threads: merged in the steps rank 0 chose, on every rank
        phase("threads")
        oxygen_torch.apply(model)
        result["threads"] = run_threads(model, THREADS, seed, concurrent=True)
        result["threads_sched"] = sched_stats(model)
        phase("contended")
        oxygen_torch.apply(model, kv={"block_tokens": 256, "arena_bytes": 8 << 20})
        result["contended"] = run_threads(model, CONTENDED, seed, concurrent=True)
        result["contended_sched"] = sched_stats(model)
        phase("swapped")
        # the same with a CPU tier: the preempted calls' KV (this rank's share) is swapped out
        oxygen_torch.apply(model, kv={"block_tokens": 256, "arena_bytes": 8 << 20},
                           pool={"cpu_tier_bytes": 64 << 20})  # fmt: skip
        result["swapped"] = run_threads(model, CONTENDED, seed, concurrent=True)
        result["swapped_sched"] = sched_stats(model)
        tiers = [p["cpu_tier"] for p in kv_pool_stats() if p["cpu_tier"]]
        result["tier"] = [{k: t[k] for k in ("migrations_down", "bytes_down", "bytes_up")}
                          for t in tiers]  # fmt: skip
    finally:
        _patching.log.removeHandler(handler)
    result["warned_not_merged"] = any("is tensor-parallel" in m for m in seen)
    result["merged_sessions"] = len(batched._mergers.get(model, {}))
    result["local_kv_heads"] = compat.local_kv_heads(model, text)
    with open(out_path, "w") as f:
        json.dump(result, f)
    phase("done")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
