"""The pool on a GPU (H200): the cuda backend with torch tensors on it, the global route (in fresh
subprocesses: it must be installed before CUDA initialises) running HF generate(), CUDA-graph
capture and replay, torch.compile(mode="reduce-overhead"), OOM, and the MemPool route."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

ENABLE = """
import json, sys, types, torch
import oxygen_torch
from oxygen_torch import pool as allocator
oxygen_torch.enable(reserve_fraction={frac})  # the pool, and Inductor's graphs through its runner
"""


def run_py(code: str, timeout: int = 600) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        cwd=ROOT, timeout=timeout, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tensor_at(ptr: int, nbytes: int, dtype=torch.float32) -> torch.Tensor:
    dev = torch.device("cuda", 0)
    storage = torch._C._construct_storage_from_data_pointer(ptr, dev, nbytes)
    t = torch.empty(0, dtype=torch.uint8, device=dev)
    t.set_(storage, 0, (nbytes,), (1,))
    return t.view(dtype)


def test_cuda_virtual_pool_with_torch_tensors():
    from oxygen_torch.pool import VirtualPool

    torch.cuda.init()
    stream = torch.cuda.current_stream()
    with VirtualPool(backend="cuda", capacity=2 << 30) as pool:
        blocks = []
        for i, n in enumerate([0, 4096, 700_000, 3 * MiB + 512, 64 * MiB]):
            ptr = pool.malloc(n, stream)
            if n >= 4:
                t = tensor_at(ptr, n // 4 * 4)
                t.copy_(torch.arange(t.numel(), device="cuda", dtype=torch.float32) + i)
            blocks.append((ptr, n, i))
        assert len({p for p, _, _ in blocks}) == 5
        for ptr, n, i in blocks:
            if n >= 4:
                t = tensor_at(ptr, n // 4 * 4)
                ref = torch.arange(t.numel(), device="cuda", dtype=torch.float32) + i
                assert torch.equal(t, ref)
        s = pool.stats()
        assert s["backend"] == "cuda" and s["mapped_bytes"] >= 64 * MiB
        for ptr, n, _ in blocks:
            assert pool.free(ptr, n, stream)
        pool.empty_cache()  # synchronizes, then unmaps
        assert pool.stats()["mapped_bytes"] == 0


def test_cuda_arena_pages_hold_data():
    from oxygen_torch.pool import Arena

    with Arena(64 * MiB, backend="cuda") as ar:
        ar.map_pages(0, 4)
        t = ar.as_tensor(torch.float32)[: 4 * ar.page_size // 4]
        t.copy_(torch.arange(t.numel(), device="cuda", dtype=torch.float32))
        assert float(t[-1]) == t.numel() - 1
        torch.cuda.synchronize()
        ar.unmap_pages(2, 2)
        assert ar.mapped_pages() == 2 and not ar.is_mapped(3)


GENERATE = """
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=512)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
ids = torch.randint(0, 1000, (4, 37), device="cuda")
with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                         min_new_tokens=24, do_sample=False, pad_token_id=0)
res = {"tokens": out.tolist()}
"""


def test_global_route_generate_matches_default_allocator():
    default = run_py("import json, torch\n" + GENERATE + "print(json.dumps(res))")
    ours = run_py(
        ENABLE.format(frac=0.9)
        + GENERATE
        + """
res["allocated"] = torch.cuda.memory_allocated()
res["max_allocated"] = torch.cuda.max_memory_allocated()
res["reserved"] = torch.cuda.memory_reserved()
res["num_ooms"] = torch.cuda.memory_stats()["num_ooms"]
torch.cuda.reset_peak_memory_stats()
res["peak_after_reset"] = torch.cuda.max_memory_allocated()
del model, out
torch.cuda.empty_cache()
s = allocator.memory_stats()
res["frag"] = s["fragmentation"]; res["backend"] = s["backend"]
res["mapped_after"] = s["mapped_bytes"]; res["allocated_after"] = s["allocated_bytes"]
print(json.dumps(res))
"""
    )
    assert ours["tokens"] == default["tokens"]
    assert ours["backend"] == "cuda"
    assert ours["allocated"] > 0 and ours["max_allocated"] >= ours["allocated"]
    assert ours["reserved"] >= ours["allocated"]
    assert ours["peak_after_reset"] == ours["allocated"]
    assert ours["mapped_after"] <= ours["allocated_after"] + 64 * MiB


def test_global_route_refuses_after_cuda_init():
    out = run_py(
        """
        import json, types, torch
        torch.zeros(1, device="cuda")
        from oxygen_torch import pool as allocator
        try:
            from oxygen_torch.config import PoolConfig
            allocator.enable_allocator(PoolConfig(backend="auto"))
            msg = ""
        except RuntimeError as e:
            msg = str(e)
        print(json.dumps({"msg": msg}))
        """
    )
    assert "already initialised" in out["msg"] and "pool()" in out["msg"]


def test_cuda_graph_capture_replay_under_global_route():
    # Temporaries allocated and freed inside the capture are replayed by the graph: if the pool
    # handed their memory to tensors allocated after the capture, replay would overwrite those.
    out = run_py(
        ENABLE.format(frac=0.9)
        + """
import gc
x = torch.randn(1 << 20, device="cuda")

def f(x):
    acc = torch.zeros_like(x)
    for i in range(8):
        t = x * (i + 1)          # temporary, freed inside the captured region
        acc = acc + t.sin()
    return acc

s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(3):
        f(x)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = f(x)
after = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(40)]
ok = True
for trial in range(3):
    x.copy_(torch.randn(1 << 20, device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    ok = ok and torch.allclose(y, f(x), rtol=1e-4, atol=1e-4)
ok_after = all(bool((a == 7.0).all()) for a in after)
q_before = allocator.memory_stats()["quarantined_bytes"]
del g, y
gc.collect()
q_after = allocator.memory_stats()["quarantined_bytes"]
print(json.dumps({"ok": ok, "ok_after": ok_after, "q_before": q_before, "q_after": q_after,
                  "capture_allocs": allocator.memory_stats()["capture_allocs"]}))
"""
    )
    assert out["ok"] and out["ok_after"]
    assert out["capture_allocs"] > 0 and out["q_before"] > 0 and out["q_after"] == 0


def test_compile_reduce_overhead_under_global_route():
    out = run_py(
        ENABLE.format(frac=0.9)
        + """
import torch._inductor.config as ic
def fn(a, b):
    return (a @ b).relu() + a.sum()
cf = torch.compile(fn, mode="reduce-overhead")
ok = True
for i in range(5):
    a = torch.randn(256, 256, device="cuda"); b = torch.randn(256, 256, device="cuda")
    r = cf(a, b).clone()
    keep = [torch.full((256, 256), 3.0, device="cuda") for _ in range(4)]
    ok = ok and torch.allclose(r, fn(a, b), rtol=1e-3, atol=1e-3)
    ok = ok and all(bool((k == 3.0).all()) for k in keep)
print(json.dumps({"ok": ok, "trees": ic.triton.cudagraph_trees}))
"""
    )
    assert out["ok"] and out["trees"] is False


def test_inductor_reduce_overhead_static_cache_generate_after_enable():
    """A user's own Inductor compile (CompileConfig(): mode reduce-overhead) of HF's static-cache
    decode after enable(): Inductor's non-tree CUDA graphs go through oxygen's runner, and the
    tokens equal the uncompiled static-cache call's (float32: no near-ties)."""
    out = run_py(
        """
import json, torch, oxygen_torch
oxygen_torch.enable()
import oxygen_torch.compile as oc
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                  max_position_embeddings=512)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).cuda().eval()
ids = torch.randint(0, 1000, (4, 37), device="cuda")
kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
          do_sample=False, pad_token_id=0, cache_implementation="static")
with torch.no_grad():
    ref = model.generate(ids, disable_compile=True, **kw)
    got = [model.generate(ids, compile_config=CompileConfig(), **kw) for _ in range(2)]
print(json.dumps({"ref": ref.tolist(), "got": [g.tolist() for g in got],
                  "graphs": oc.stats()["cuda_graphs"]}))
"""
    )
    assert out["got"][0] == out["ref"] and out["got"][1] == out["ref"]
    assert out["graphs"].get("captured", 0) >= 1 and out["graphs"].get("replayed", 0) >= 20


def test_oom_under_global_route_is_an_error_not_a_crash():
    out = run_py(
        ENABLE.format(frac=0.02)
        + """
msg = ""
total = torch.cuda.get_device_properties(0).total_memory
try:
    # 3 %: more than may be mapped (2 %), within the address range reserved (twice that)
    torch.empty(total * 3 // 100, dtype=torch.uint8, device="cuda")
except RuntimeError as e:
    msg = str(e)
x = torch.ones(1 << 20, device="cuda")
print(json.dumps({"msg": msg, "sum": float(x.sum()), "ooms": allocator.memory_stats()["num_ooms"]}))
"""
    )
    assert "out of memory" in out["msg"] and "mapped" in out["msg"]
    assert out["sum"] == float(1 << 20) and out["ooms"] == 1


def test_mempool_route_after_cuda_init():
    from oxygen_torch import pool as allocator
    from oxygen_torch.pool import native as _native

    torch.zeros(1, device="cuda")
    with allocator.pool():
        x = torch.randn(4096, 4096, device="cuda")
    h = _native.lib().oxygen_global_pool(0)
    assert h
    base = int(_native.lib().oxygen_pool_base(h))
    s = allocator.memory_stats(0)
    assert base <= x.data_ptr() < base + s["pool_va_bytes"]
    assert s["allocated_bytes"] >= x.numel() * 4
    y = x * 2
    assert torch.equal(y / 2, x)
    assert torch.cuda.memory_allocated() >= 0  # PyTorch's own stats keep working


def test_record_stream_under_global_route_delays_reuse_until_the_side_stream_passes():
    out = run_py(
        ENABLE.format(frac=0.05)
        + """
side = torch.cuda.Stream()
x = torch.ones(8 << 20, device="cuda")  # 32 MiB
ptr = x.data_ptr()
with torch.cuda.stream(side):
    torch.cuda._sleep(200_000_000)  # the side stream is busy well past the free below
    y = x * 2
x.record_stream(side)
del x
held = allocator.memory_stats()["deferred_bytes"]
z = torch.empty(8 << 20, device="cuda")  # same size, same stream: must not take x's block
reused = z.data_ptr() == ptr
torch.cuda.synchronize()
torch.cuda.empty_cache()
print(json.dumps({"held": held, "reused": reused, "sum": float(y.sum()),
                  "after": allocator.memory_stats()["deferred_bytes"]}))
"""
    )
    assert out["held"] >= 32 * MiB and not out["reused"]
    assert out["sum"] == 2.0 * (8 << 20) and out["after"] == 0
