"""kv.mixed_graphs: the engine's steps with prompt tokens replayed from graphs by (tokens, rows)
bucket (integrations/hf/mixed_graphs.py). On CPU through the graph path's stand-in
(kv.cpu_decode_graphs "rerun": a "replay" runs the captured forward again on the graph's
buffers), so what these tests check is the bookkeeping a replay depends on: the packed step
copied into the buffers (table, lengths, cumulative counts, slots, positions, kept indices,
ids), the padding tokens and rows kept out of every call's KV and logits, each core left as its
eager step leaves it."""

from __future__ import annotations

import gc

import pytest
import torch
from test_engine_graphs import failing_capture
from test_engine_loop import arriving, call, engines
from test_hf_generate import tiny

import oxygen_torch
from oxygen_torch import _patching
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import merged_graphs, mixed_graphs
from oxygen_torch.kv import pool_stats


@pytest.fixture
def switched():
    _patching.forget_warnings()
    yield
    hf.disable_hf()


def overlapping(seeds, new: int = 12) -> list[dict]:
    """Calls of 1-3 rows with left padding that all decode `new` tokens (so they overlap)."""
    kws = []
    for s in seeds:
        kw = dict(call(s), return_dict_in_generate=True, output_logits=True, max_new_tokens=new)
        kw.pop("max_length", None)
        kw.pop("eos_token_id", None)
        kws.append(kw)
    return kws


def mixed_steps(model) -> list[tuple[int, int]]:
    (eng,) = engines(model)
    return [(e[1], e[2]) for e in eng.stats.timeline if e[2] > e[1]]


def on(limit: int = 512, **kv) -> object:
    """The engine with kv.mixed_graphs `limit` (0: off) through the CPU stand-in."""
    return load_config(
        scheduler={"engine": True}, kv={"cpu_decode_graphs": "rerun", "mixed_graphs": limit, **kv}
    )


def equal_stock(out, ref, what) -> None:
    for i, r in enumerate(ref):
        assert torch.equal(out[i].sequences, r.sequences), (what, i)
        for a, b in zip(out[i].logits, r.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_buckets():
    assert [mixed_graphs.token_bucket(n) for n in (1, 15, 16, 17, 300, 2048)] == [
        16, 16, 16, 32, 512, 2048,
    ]  # fmt: skip
    # one more row than the real ones: the padding tokens' sequence
    assert [mixed_graphs.rows_bucket(n) for n in (1, 3, 4, 255, 256)] == [2, 4, 8, 256, 320]


def test_warm_up_steps_hit_their_buckets_exactly(switched):
    """kv.mixed_graphs 100 (not a power of two) and the prefix cache on (identical prompts
    would share blocks and shrink the steps): the warm-up's calls make steps of 100, 64, 32 and
    16 tokens (the limit, then each bucket's top) over as many rows as tokens, at most 8; each
    is captured in its bucket and reported as captured."""
    model = tiny("llama")
    hf.apply(model, on(100, prefix_cache=True))
    got = oxygen_torch.warm_up(model, max_rows=8, max_length=128)
    assert got["mixed_buckets"] == [(16, 12), (32, 12), (64, 12), (128, 12)], got
    assert got["mixed_captured"] == 4, got
    tokens = sorted({t for _, t in mixed_steps(model)}, reverse=True)
    assert tokens[:4] == [100, 64, 32, 16], tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
def test_steps_with_prompt_tokens_replay_graphs_and_equal_stock(switched, arch):
    """9 calls arriving 15 ms apart: steps of prompts beside decoding rows, of several token
    counts, go through mixed-step graphs; every call's tokens and float32 logits at every step
    equal stock's, and no KV block is left held."""
    seeds = torch.randint(0, 10_000, (9,)).tolist()
    model = tiny(arch)
    kws = overlapping(seeds)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, on())
    out = arriving(model, kws, 0.015)
    equal_stock(out, ref, arch)
    st = oxygen_torch.decode_graph_stats(model)["mixed"]
    steps = mixed_steps(model)
    assert len(steps) >= 2, steps
    assert st["failed"] == 0 and st["captures"] >= 1, st
    if arch != "gemma3":  # (its rows narrow their sliding windows: those steps stay eager)
        assert st["captures"] + st["replays"] == len(steps), (st, steps)
    del out  # (the outputs' caches hold their blocks)
    gc.collect()
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


def test_warm_up_captures_every_rows_buckets_own_decode_graph(switched):
    """With kv.mixed_graphs the warm-up's first calls are its largest (32 rows): their decode
    step captures bucket 32's graph, which every smaller decode step could replay padded. The
    rows pass still captures each bucket's own graph: a padded replay is taken only until its
    signature was asked for CAPTURE_AFTER times, so a bucket left to it captures mid-traffic
    (on the H100's arrival trace: 5 captures of ~150 ms, each a stall for every row)."""
    model = tiny("llama")
    hf.apply(model, on(256, block_tokens=16))
    got = oxygen_torch.warm_up(model, max_rows=32, max_length=128)
    assert got["rows_buckets"] == [1, 2, 4, 8, 12, 16, 24, 32], got
    (eng,) = engines(model)
    rows = sorted({key[0] for key in eng.runner.graphs.graphs})
    assert rows == got["rows_buckets"], (rows, got)
    assert oxygen_torch.decode_graph_stats(model)["merged"]["captures"] == len(rows)


def test_after_warm_up_every_step_replays_a_captured_graph(switched, monkeypatch):
    """warm_up with kv.mixed_graphs 256: one graph a tokens bucket (16 to 256) at the most rows
    such a step can have; then the calls' steps with prompt tokens replay those (padded) and
    capture none, and their tokens equal stock's."""
    monkeypatch.setattr(merged_graphs, "CAPTURE_AFTER", 10_000)
    seeds = torch.randint(0, 10_000, (8,)).tolist()
    model = tiny("llama")
    kws = overlapping(seeds)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, on(256, block_tokens=16))
    got = oxygen_torch.warm_up(model, max_rows=32, max_length=128)
    # (tokens, rows) buckets: each as many rows as tokens, at most 32, + 1 for the padding
    want = [(16, 24), (32, 48), (64, 48), (128, 48), (256, 48)]
    assert got["mixed_buckets"] == want and got["mixed_captured"] == 5, got
    before = oxygen_torch.decode_graph_stats(model)["mixed"]
    steps = len(mixed_steps(model))
    out = arriving(model, kws, 0.015)
    equal_stock(out, ref, "warmed")
    st = oxygen_torch.decode_graph_stats(model)["mixed"]
    steps = len(mixed_steps(model)) - steps
    assert st["captures"] == 5 and steps >= 2, (st, steps)
    assert st["replays"] - before["replays"] == steps, (st, before, steps)
    assert st["padded"] - before["padded"] >= 1, (st, before)


def test_off_over_the_limit_and_a_failed_capture_is_eager_with_one_warning(switched, monkeypatch):
    seeds = torch.randint(0, 10_000, (6,)).tolist()
    kws = overlapping(seeds, new=6)
    ref_model = tiny("llama")
    with torch.no_grad():
        ref = [ref_model.generate(**kw) for kw in kws]
    # off (the default): no mixed graph; a limit of 16 tokens: only the steps of 16 or fewer
    for limit in (0, 16):
        model = hf.apply(tiny("llama"), on(limit))
        equal_stock(arriving(model, kws, 0.01), ref, "eager")
        st = oxygen_torch.decode_graph_stats(model)["mixed"]
        small = sum(t <= limit for _, t in mixed_steps(model))
        assert st["captures"] + st["replays"] == small, (limit, st, mixed_steps(model))

    # the warm-up runs, the capture raises (as a capture-illegal op)
    monkeypatch.setattr(merged_graphs, "GraphRunner", failing_capture(merged_graphs.GraphRunner))
    seen = []
    monkeypatch.setattr(_patching, "warn_once", lambda msg: seen.append(msg))
    model = hf.apply(tiny("llama"), on())
    out = arriving(model, kws, 0.01)
    equal_stock(out, ref, "failed captures")
    st = oxygen_torch.decode_graph_stats(model)["mixed"]
    assert 1 <= st["failed"] <= mixed_graphs.MAX_FAILED, st  # (then no capture is tried)
    assert st["replays"] == 0 and st["graphs"] == 0, st
    assert any("CUDA-graph capture failed" in m for m in seen), seen
    del out
    gc.collect()
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


@pytest.mark.parametrize("bad", [8, -1, 16385])
def test_the_setting_is_checked(bad):
    with pytest.raises(ValueError, match="kv.mixed_graphs"):
        load_config(kv={"mixed_graphs": bad})
