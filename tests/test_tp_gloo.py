"""Tensor parallel on the CPU: transformers' own TP plan over torch.distributed's gloo backend,
two processes, each rank's generate() after oxygen_torch.enable() against stock TP.

Every rank runs tests/tp_worker.py on a tiny checkpoint (two architectures); the test then checks
that oxygen's tokens equal stock TP's (greedy, beams, and sampling with the same seed), that the
paged cache held this rank's share of the KV heads, that every rank decided the same block
tables (each rank plans its own; nothing is broadcast, so they must agree by construction), and
that a call too wide for the pool runs as the same row groups on every rank with stock's tokens,
and that calls from several threads at once are merged in the same steps on every rank (rank 0
chooses them; a forward that cannot merge is a step of its own; on a small pool calls are
preempted), each with the tokens it gets alone on stock TP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from test_hf_generate import COMMON

pytest.importorskip("accelerate")  # transformers' TP loading needs it (a dev dependency)
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)
WORLD = 2
WORKER = Path(__file__).with_name("tp_worker.py")


def checkpoint(tmp_path: Path, arch: str) -> Path:
    torch.manual_seed(3)
    if arch == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON))
    else:
        model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON))
    path = tmp_path / arch
    model.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(path: Path, tmp_path: Path, seed: int) -> list[dict]:
    port = free_port()
    procs, outs = [], []
    for rank in range(WORLD):
        out = tmp_path / f"rank{rank}.json"
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
        )  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
        cmd = [sys.executable, str(WORKER), str(path), str(out), str(seed)]
        pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append(subprocess.Popen(cmd, env=env, **pipe))
        outs.append(out)
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:  # every rank's last words (its threads' stacks at 200 s)
        for p in procs:
            p.kill()
        tails = [p.communicate()[0].decode(errors="replace")[-30000:] for p in procs]
        raise AssertionError("a rank ran past 240 s:\n" + "\n---\n".join(tails)) from None
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-12000:]
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("arch,seed", [("llama", 0), ("qwen3", 1)])
def test_tensor_parallel_generate_on_the_paged_cache_equals_stock_tp(tmp_path, arch, seed):
    ranks = run_ranks(checkpoint(tmp_path, arch), tmp_path, seed)
    heads = COMMON["num_key_value_heads"] // WORLD
    for r in ranks:
        assert r["tp_size"] == WORLD
        assert r["local_kv_heads"] == heads
        # calls are merged under TP too, in steps rank 0 chooses for every rank
        assert not r["warned_not_merged"] and r["merged_sessions"] >= 1
        for name, stock in r["stock"].items():
            ours = r["oxygen"][name]
            assert stock["cache"] != "PagedKVCache"
            assert ours["cache"] == "PagedKVCache", name
            assert ours["kv_heads"] == heads, name  # this rank's share of the KV heads
            assert ours["tokens"] == stock["tokens"], (r["rank"], name)
        # the wide call on a pool it does not fit: row groups, the tokens of stock's whole batch
        assert r["oversubscribed"]["tokens"] == r["stock"]["wide"]["tokens"], r["rank"]
        (blocks,) = r["small_blocks"]  # without the engine (TP) groups are as large as the pool
        groups = -(-130 // blocks)
        assert groups > 1 and r["split"] == [{"calls_split": 1, "groups_run": groups}], r["split"]
        # calls from threads at once: each thread's tokens are stock's, one call after another
        for phase, stock in (("threads", "threads"), ("contended", "contended"),
                             ("swapped", "contended")):  # fmt: skip
            assert not r[phase]["errors"], (r["rank"], r[phase]["errors"])
            assert r[phase]["tokens"] == r[f"stock_{stock}"]["tokens"], (r["rank"], phase)
        merged = max(max(s["batch_sizes"], default=0) for s in r["threads_sched"])
        assert merged > 3  # a step took rows of more than one call (the widest call has 3)
        assert sum(s["preemptions"] for s in r["contended_sched"]) > 0
        assert sum(s["swaps"] for s in r["swapped_sched"]) > 0  # the tier took them
        assert r["tier"] and r["tier"][0]["bytes_down"] == r["tier"][0]["bytes_up"] > 0
    for phase in ("threads_sched", "contended_sched", "swapped_sched", "tier"):
        assert all(r[phase] == ranks[0][phase] for r in ranks), phase  # the same on every rank
    first = ranks[0]["oxygen"]
    for r in ranks[1:]:
        for name in first:
            assert r["oxygen"][name]["tokens"] == first[name]["tokens"]
            assert r["oxygen"][name]["blocks"] == first[name]["blocks"], name
        assert r["split"] == ranks[0]["split"] and r["small_blocks"] == ranks[0]["small_blocks"]
