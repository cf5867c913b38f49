"""The engine on the GPU: concurrent generate() calls against stock, decode steps replayed from
CUDA graphs, the Triton draw's distribution at scale, the GPU figures of a step."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels.sampling import sample_rows
from test_engine import in_threads
from test_engine_loop import arriving, call, engines
from test_hf_generate import tiny

from oxygen_torch.config import load_config
from oxygen_torch.engine.sampling import step_seed
from oxygen_torch.integrations.hf import front
from oxygen_torch.integrations.hf import generate as gen
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool_stats

pytestmark = pytest.mark.cuda
GRAPHS = load_config(scheduler={"engine": True, "decode_graphs": True}, kv={"debug_checks": False})


def cuda_calls(n: int, **over) -> list[dict]:
    """test_engine_loop's calls 0..n-1 on the GPU; `over` replaces their lengths (max_length
    dropped)."""
    kws = []
    for s in range(n):
        kw = call(s)
        if over:
            kw.pop("max_length", None)
            kw.update(over)
        kw["input_ids"], kw["attention_mask"] = kw["input_ids"].cuda(), kw["attention_mask"].cuda()
        kws.append(kw)
    return kws


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_concurrent_calls_on_the_gpu_equal_stock_through_decode_graphs(oxygen, arch):
    """float32: 12 calls of 1-3 rows with left padding, EOS and min lengths, from threads; each
    call's tokens agree with stock's (merged and alone runs use other kernel shapes: a rate, as
    in test_tier_cuda.py), and decode steps replay the engine's graphs."""
    model = tiny(arch).cuda()
    kws = cuda_calls(12)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    front.REASONS.clear()  # (what earlier tests sent to the per-call path)
    hf.apply(model, GRAPHS)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    agree = [float((out[i] == r).float().mean()) if out[i].shape == r.shape else 0.0
             for i, r in enumerate(ref)]  # fmt: skip
    assert sum(agree) / len(agree) >= 0.98, agree
    (eng,) = engines(model)
    st = eng.runner.graphs.stats()
    assert st["replays"] > 0 and st["failed"] == 0, st
    snap = eng.snapshot()
    assert snap["gpu_s"] > 0 and 0 <= snap["gpu_idle_s"] < snap["gpu_s"] * 10
    # every step read has its GPU time (and the gap before it) in the timeline, summing to gpu_s
    read = [e for e in eng.stats.timeline if e[6] is not None]
    assert len(read) >= len(eng.stats.timeline) - 1 and all(e[6] > 0 for e in read)
    assert abs(sum(e[6] for e in read) - eng.stats.gpu_s) < 1e-6 * len(read) + 1e-9
    assert not front.REASONS, front.REASONS
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_after_warm_up_the_gpu_captures_no_graph(oxygen, arch):
    """oxygen_torch.warm_up(max_rows=32): buckets 1..32 captured (CUDA graphs, the forward
    compiled whole); then 12 calls of 1-3 rows from threads replay them, capture none, and
    agree with stock (a rate, as above)."""
    import oxygen_torch

    model = tiny(arch, max_position_embeddings=1024).cuda()
    kws = cuda_calls(12)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, GRAPHS)
    got = oxygen_torch.warm_up(model, max_rows=32, max_length=512)
    assert got["decode_graphs"] and got["captured"] == 8 and got["table_blocks"] == 32, got
    (eng,) = engines(model)
    before = eng.runner.graphs.stats()
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    agree = [float((out[i] == r).float().mean()) if out[i].shape == r.shape else 0.0
             for i, r in enumerate(ref)]  # fmt: skip
    assert sum(agree) / len(agree) >= 0.98, agree
    st = eng.runner.graphs.stats()
    assert st["captures"] == before["captures"] == 8 and st["failed"] == 0, st
    assert st["replays"] > before["replays"], st


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_steps_with_prompt_tokens_replay_mixed_graphs_on_the_gpu(oxygen, arch):
    """kv.mixed_graphs 512 on the GPU (float32): 10 calls arriving 20 ms apart make steps of
    prompts beside decoding rows; they replay CUDA graphs of the paged prefill kernel (captured
    from the forward compiled whole), and every call agrees with stock (a rate, as above)."""
    import oxygen_torch

    model = tiny(arch).cuda()
    kws = cuda_calls(10, max_new_tokens=16)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    cfg = load_config(scheduler={"engine": True, "decode_graphs": True},
                      kv={"debug_checks": False, "mixed_graphs": 512})  # fmt: skip
    hf.apply(model, cfg)
    out = arriving(model, kws, 0.02)
    agree = [float((out[i] == r).float().mean()) if out[i].shape == r.shape else 0.0
             for i, r in enumerate(ref)]  # fmt: skip
    assert sum(agree) / len(agree) >= 0.98, agree
    st = oxygen_torch.decode_graph_stats(model)["mixed"]
    assert st["captures"] >= 1 and st["failed"] == 0, st
    (eng,) = engines(model)
    steps = [e for e in eng.stats.timeline if e[2] > e[1]]
    assert st["captures"] + st["replays"] == len(steps), (st, len(steps))
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_steps_through_the_compiled_forward_on_the_gpu(oxygen, arch):
    """kv.prefill_compile on the GPU (float32): one call compiles the forward for the steps with
    prompt tokens, then 10 calls arriving 20 ms apart make such steps of several token counts
    beside decoding rows (replayed from graphs); each call's tokens agree with stock's (a
    rate: other kernel shapes), every such step ran compiled, and no token count compiled
    again."""
    model = tiny(arch).cuda()
    kws = []
    for s in range(11):
        kw = call(s)
        kw.pop("max_length", None)
        kw["max_new_tokens"] = 24
        kw["input_ids"], kw["attention_mask"] = kw["input_ids"].cuda(), kw["attention_mask"].cuda()
        kws.append(kw)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    # (kv.mixed_graphs 0: else the steps with prompt tokens replay mixed-step graphs instead)
    cfg = load_config(scheduler={"engine": True, "decode_graphs": True},
                      kv={"debug_checks": False, "prefill_compile": True,
                          "mixed_graphs": 0})  # fmt: skip
    hf.apply(model, cfg)
    first = _generate(model, kws[0])
    (eng,) = engines(model)
    assert eng.runner.prefill_compiled == 1
    steps_before = len(eng.stats.timeline)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    out = arriving(model, kws[1:], 0.02)
    got = [first] + [out[i] for i in range(10)]
    agree = [float((g == r).float().mean()) if g.shape == r.shape else 0.0
             for g, r in zip(got, ref)]  # fmt: skip
    assert sum(agree) / len(agree) >= 0.98, agree
    prefill = [(e[1], e[2]) for e in list(eng.stats.timeline)[steps_before:] if e[2] > e[1]]
    assert len({tokens for _, tokens in prefill}) >= 2, prefill
    assert eng.runner.prefill_compiled == 1 + len(prefill), (eng.runner.prefill_compiled, prefill)
    # (decode graphs of new rows buckets may compile their sizes symbolic once)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before <= 2


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_compiled_prefill_keeps_any_number_of_logits_in_one_compile_on_the_gpu(oxygen, arch):
    """kv.prefill_compile on the GPU (float32; no decode graphs: every compile is the
    prefill's; scheduler.max_step_tokens 64): one row of 40 tokens compiles the forward (one
    logit kept, as warm_up's step). Then two rows in one call (two kept) and a 300-token prompt
    (its chunks keep none) agree with stock, and nothing compiles again. (A compile that
    specialized the kept count compiled again for each, ~25 s on the H100 mid-trace, and with
    none kept dropped the chunk's K/V writes as dead code on the CPU.)"""
    model = tiny(arch).cuda()
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))

    def prompt(rows, lengths):
        ids = torch.zeros(rows, max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, n in enumerate(lengths):  # (left-padded)
            ids[r, -n:] = torch.randint(3, 128, (n,), generator=g)
            mask[r, -n:] = 1
        return dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=False,
                    max_new_tokens=12)  # fmt: skip

    lengths = torch.randint(20, 32, (2,), generator=g).tolist()  # (one step: at most 64)
    kws = [prompt(1, [40]), prompt(2, lengths), prompt(1, [300])]
    ref = [_generate(model, kw) for kw in kws]
    cfg = load_config(scheduler={"engine": True, "max_step_tokens": 64},
                      kv={"debug_checks": False, "prefill_compile": True, "mixed_graphs": 0,
                          "decode_graphs": False})  # fmt: skip
    hf.apply(model, cfg)
    got = [_generate(model, kws[0])]
    (eng,) = engines(model)
    assert eng.runner.prefill_compiled == 1
    since = len(eng.stats.timeline)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got += [_generate(model, kw) for kw in kws[1:]]
    steps = [(e[1], e[2]) for e in list(eng.stats.timeline)[since:] if e[2] > e[1]]
    assert (2, sum(lengths)) in steps and (1, 64) in steps, steps
    assert eng.runner.prefill_compiled == 1 + len(steps), (eng.runner.prefill_compiled, steps)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    for kw, g_, r in zip(kws, got, ref):
        width = kw["input_ids"].shape[1]
        assert g_.shape == r.shape, (g_.shape, r.shape)
        agree = float((g_[:, width:] == r[:, width:]).float().mean())
        assert agree >= 0.9, (agree, g_[:, width:], r[:, width:])


def _generate(model, kw):
    with torch.no_grad():
        return model.generate(**kw)


def test_the_gpu_draw_follows_the_probabilities_at_scale():
    """200,000 rows of the same 50-token logits, each its own seed: chi-square against the
    softmax; a filtered token never drawn; greedy rows the first maximum."""
    torch.manual_seed(0)
    vocab, n = 50, 200_000
    logits = torch.randn(vocab, device="cuda")
    logits[7] = float("-inf")
    probs = torch.softmax(logits, -1).double()
    seeds = torch.tensor([step_seed(s, 3) for s in range(n)], device="cuda")
    tok = sample_rows(logits.expand(n, vocab).contiguous(), seeds,
                      torch.zeros(n, dtype=torch.bool, device="cuda"))  # fmt: skip
    counts = torch.bincount(tok, minlength=vocab).double()
    assert counts[7] == 0
    keep = probs > 0
    stat = float(((counts[keep] - n * probs[keep]) ** 2 / (n * probs[keep])).sum())
    assert stat < 110, stat  # 48 degrees of freedom: P(> 110) ~ 1e-6
    tied = torch.randn(4, 1000, device="cuda")
    tied[:, 10] = tied[:, 500] = 9.0
    got = sample_rows(tied, seeds[:4], torch.ones(4, dtype=torch.bool, device="cuda"))
    assert got.tolist() == [10, 10, 10, 10]


@pytest.mark.parametrize("masked", [False, True])
def test_the_front_door_reads_a_calls_inputs_from_the_gpu_in_one_sync(oxygen, masked):
    """Every read of a device tensor in the caller's thread waits for the engine's steps queued
    on the stream: the door reads ids and mask in one copy and makes the special tokens on the
    host (stock's preparation syncs per tensor). Counted by torch's sync debug mode."""
    import warnings

    model = tiny("llama").cuda()
    model.generation_config.eos_token_id = [5, 9]
    kw = call(3)
    ids = kw["input_ids"].cuda()
    extra = {"attention_mask": kw["attention_mask"].cuda()} if masked else {}
    args = dict(max_new_tokens=4, do_sample=False, **extra)
    hf.apply(model, GRAPHS)
    front.plan(model, (ids,), args)  # (first: the memo, Triton and torch's lazy setup)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:  # what generate() does before it submits: one read checks and plans the call
            c = gen._Call(model, (ids,), args)
            host = front.read_inputs(c)
            gen.validate(model, c, host[0])
            p = front.plan(model, (ids,), args, c, host)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert isinstance(p, front.Plan), p
    # (the mode's own "prototype feature" notice, given once a process, is not a sync)
    syncs = [w for w in seen if "called a synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert torch.equal(p.host_ids, kw["input_ids"]) and p.ids.device.type == "cuda"


def test_an_engine_on_the_gpu_freezes_the_heap_once(oxygen, monkeypatch):
    """scheduler.gc_freeze (default): the first engine on a GPU collects and freezes the heap
    (engine/gc_watch.py); a model made after it does not freeze it again (only a compiled
    capture's refreeze may add what the compile left), and its calls still run."""
    import gc

    from oxygen_torch.engine import gc_watch

    did = []
    first = gc_watch.freeze_once
    monkeypatch.setattr(gc_watch, "freeze_once", lambda: did.append(first()) or did[-1])
    model = hf.apply(tiny("llama").cuda(), load_config(scheduler={"engine": True}))
    kw = call(5)
    kw["input_ids"], kw["attention_mask"] = kw["input_ids"].cuda(), kw["attention_mask"].cuda()
    _generate(model, kw)
    assert engines(model) and gc.get_freeze_count() > 0 and did
    assert gc_watch._frozen  # (frozen by this engine or an earlier test's: once per process)
    seen = len(did)
    other = hf.apply(tiny("qwen3").cuda(), load_config(scheduler={"engine": True}))
    _generate(other, kw)
    assert engines(other) and len(did) > seen  # the second engine asked...
    assert not any(did[seen:])  # ...and nothing was collected and frozen again for it


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_fresh_prompts_attend_their_own_kv_on_the_gpu(oxygen, arch):
    """bf16 on the GPU: a step of fresh prompts (rows of 21, 15, 15, 19 tokens once packed)
    under kv.fresh_prefill dense runs torch SDPA on the step's own K/V (strided views of the
    packed tensors); its first logits agree with the paged kernel's and stock's within bf16's
    error, and every layer counted the dense path."""
    import oxygen_torch.compile as oc

    model = tiny(arch, seed=5).cuda().to(torch.bfloat16)
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    ids = torch.randint(3, 128, (4, 21), generator=g)
    mask = torch.ones_like(ids)
    for r, pad in enumerate((0, 6, 6, 2)):
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    kw = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), do_sample=False,
              max_new_tokens=2, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        ref = model.generate(**kw).logits[0].float()
        got = {}
        for setting in ("dense", "paged"):
            # (the eager forward's paths: a mixed-step graph, kv.mixed_graphs, has the paged one;
            # kv.prefill_compile's forward is tested on its own above)
            kv = {"fresh_prefill": setting, "mixed_graphs": 0, "prefill_compile": False}
            hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
            oc.reset_stats()
            got[setting] = model.generate(**kw).logits[0].float()
            assert oc.stats()["prefill_attention"][setting] == layers
    scale = ref.abs().max()
    assert (got["dense"] - got["paged"]).abs().max() / scale < 3e-2
    assert (got["dense"] - ref).abs().max() / scale < 3e-2
