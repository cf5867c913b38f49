"""One rank of the tensor-parallel test (tests/test_tp_gloo.py): run by that test, one process a
rank, with torch.distributed's environment set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

Loads the tiny checkpoint with transformers' own tensor-parallel plan (gloo on the CPU), runs
generate() stock, then after oxygen_torch.enable() on the same model, then the wide call again on
a pool it does not fit (row groups), and writes what the test compares to a JSON file per rank:
the tokens, the cache the call used, its KV geometry on this rank, the block tables it decided
and the oversubscription counters."""

from __future__ import annotations

import json
import logging
import sys
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


def main(path: str, out_path: str, seed: int) -> None:
    warnings.simplefilter("ignore", FutureWarning)
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32
    ).eval()
    text = model.config.get_text_config(decoder=True)
    result = {"rank": dist.get_rank(), "tp_size": model.tp_size, "stock": run(model, seed)}
    oxygen_torch.enable()
    oxygen_torch.apply(model)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    _patching.log.addHandler(handler)
    try:
        result["oxygen"] = run(model, seed)
        # a pool too small for the wide call: it runs as row groups (kv.oversubscribe), which
        # every rank must cut alike (the groups' collectives pair up across ranks)
        oxygen_torch.apply(model, kv={"block_tokens": 256, "arena_bytes": 8 << 20})
        result["oversubscribed"] = run(model, seed, {"wide": CALLS["wide"]})["wide"]
        small = [p for p in kv_pool_stats() if p["block_tokens"] == 256]
        result["split"] = [p["oversubscribed"] for p in small]
        result["small_blocks"] = [p["blocks_total"] for p in small]
    finally:
        _patching.log.removeHandler(handler)
    result["warned_not_merged"] = sum("is tensor-parallel" in m for m in seen) == 1
    result["merged_sessions"] = len(batched._mergers.get(model, {}))
    result["local_kv_heads"] = compat.local_kv_heads(model, text)
    with open(out_path, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
