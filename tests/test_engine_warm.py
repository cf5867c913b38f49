"""oxygen_torch.warm_up(model): every rows bucket's decode graph captured before the calls come,
with tables wide enough for the sequences up to `max_length`, so the calls' steps replay and
capture none. On CPU through the decode-graph path's stand-in (kv.cpu_decode_graphs "rerun":
a "capture" is counted as on a GPU, a "replay" runs the captured forward again)."""

from __future__ import annotations

import pytest
import torch
from test_engine import in_threads
from test_engine_loop import call, engines
from test_hf_generate import tiny

import oxygen_torch
from oxygen_torch import _patching
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf

RERUN = {"cpu_decode_graphs": "rerun"}


@pytest.fixture
def switched():
    """Models a test switches get stock attention back afterwards; warnings are said again."""
    _patching.forget_warnings()
    yield
    hf.disable_hf()


def _generate(model, kw):
    with torch.no_grad():
        return model.generate(**kw)


def long_call(seed: int, length: int, new: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, length), generator=g)
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new)  # fmt: skip


def merged(model) -> dict:
    return oxygen_torch.decode_graph_stats(model)["merged"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_after_warm_up_the_calls_steps_replay_and_capture_nothing(switched, arch):
    """warm_up(max_rows=32, max_length=480): buckets 1..32 captured once each, tables 32 blocks
    wide (480 tokens in 16-token blocks: 30, rounded up to a power of two). Then 10 concurrent
    calls of 1-3 rows (up to 24 rows a step) and one of 440 + 4 tokens (28 blocks: wider than a
    graph's table would be without the warm-up) equal stock and capture no graph; a call of 600
    tokens (38 blocks: past max_length) captures one of its own, and equals stock too."""
    model = tiny(arch, max_position_embeddings=1024)
    seeds = torch.randint(0, 10_000, (10,)).tolist()
    kws = [call(s) for s in seeds] + [long_call(seeds[0], 440)]
    past = long_call(seeds[1], 600)
    ref = [_generate(model, kw) for kw in kws + [past]]
    hf.apply(model, load_config(scheduler={"engine": True}, kv=RERUN))
    got = oxygen_torch.warm_up(model, max_rows=32, max_length=480)
    assert got["rows_buckets"] == [1, 2, 4, 8, 12, 16, 24, 32], got
    assert got["table_blocks"] == 32 and got["max_length"] == 480, got
    st = merged(model)
    assert got["captured"] == st["captures"] == st["graphs"] == 8, (got, st)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    for i, r in enumerate(ref[:-1]):
        assert torch.equal(out[i], r), (arch, i)
    after = merged(model)
    assert after["captures"] == 8 and after["failed"] == 0, after
    assert after["replays"] > st["replays"], after  # (the calls' decode steps replayed)
    assert torch.equal(_generate(model, past), ref[-1])
    assert merged(model)["captures"] == 9  # a table of 64 blocks: not warmed


def test_a_limit_between_buckets_warms_the_bucket_above_it(switched):
    """scheduler.max_step_seqs 10: the default max_rows is 10; a step of 10 rows replays bucket
    12, which the warm-up's last call (10 rows) captures. The default max_length is the model's
    max_position_embeddings (1024: 64 blocks)."""
    model = tiny("llama", max_position_embeddings=1024)
    hf.apply(model, load_config(scheduler={"engine": True, "max_step_seqs": 10}, kv=RERUN))
    got = oxygen_torch.warm_up(model)
    assert got["rows_buckets"] == [1, 2, 4, 8, 12] and got["captured"] == 5, got
    assert got["max_length"] == 1024 and got["table_blocks"] == 64, got
    assert oxygen_torch.engine_stats(model)["running"] == 0


def test_warm_up_refuses_what_it_cannot_do_naming_it(switched):
    stock = tiny("llama")
    with pytest.raises(RuntimeError, match="does not attend through oxygen"):
        oxygen_torch.warm_up(stock)
    off = tiny("llama")
    hf.apply(off, load_config(scheduler={"engine": False}))
    with pytest.raises(RuntimeError, match="scheduler.engine"):
        oxygen_torch.warm_up(off)
    hooked = tiny("llama")
    hf.apply(hooked, load_config(scheduler={"engine": True}))
    hooked.register_forward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="per-call path, not the engine .forward hooks"):
        oxygen_torch.warm_up(hooked)
    model = tiny("llama")  # max_position_embeddings 256
    hf.apply(model, load_config(scheduler={"engine": True, "max_step_seqs": 64}, kv=RERUN))
    for bad, kind, text in [
        (dict(max_rows=0), ValueError, "max_rows 0 is out of range; allowed: 1 to 64"),
        (dict(max_rows=65), ValueError, "max_rows 65"),
        (dict(max_rows="8"), TypeError, "max_rows '8' is not an integer"),
        (dict(max_rows=True), TypeError, "max_rows True"),
        (dict(max_length=1), ValueError, "max_length 1 is out of range; allowed: 2 to 256"),
        (dict(max_length=257), ValueError, "max_position_embeddings"),
        (dict(max_length=2.5), TypeError, "max_length 2.5"),
    ]:
        with pytest.raises(kind, match=text):
            oxygen_torch.warm_up(model, **bad)
    assert merged(model)["captures"] == 0  # nothing ran for a refused call


def test_without_decode_graphs_it_runs_one_and_two_rows_only(switched):
    """On a CPU without the stand-in there is nothing to capture: the KV pool is made (one and
    two rows of one token, two new tokens each) and the engine is idle after."""
    model = tiny("qwen3")
    hf.apply(model, load_config(scheduler={"engine": True}))
    got = oxygen_torch.warm_up(model)
    assert got["decode_graphs"] is False and got["rows_buckets"] == [1, 2], got
    assert got["captured"] == 0 and merged(model)["graphs"] == 0, got
    assert oxygen_torch.kv_stats() and oxygen_torch.engine_stats(model)["tokens"] > 0


def test_warm_up_compiles_the_forward_of_the_steps_no_graph_replays(switched, monkeypatch):
    """kv.prefill_compile (on by default): the steps with more prompt tokens than
    kv.mixed_graphs (32 here) run the forward compiled whole with dynamic shapes. Every
    warm-up step with prompt tokens replays a mixed graph, so warm_up ends with one prompt of 33
    tokens, which compiles it (the CPU stand-in told it compiles here, as on a GPU; decode
    graphs not fused, so that every compile is the prefill's). Calls after it equal stock, and
    nothing compiles again: 60 tokens (the compiled forward, one logit kept, as warm_up's), 20
    (a mixed graph), two rows of 40-48 tokens in one call (two logits kept: a compile that
    specialized the one kept logit of warm_up's step compiled again here, ~25 s on an H100 in
    the loaded trace) and a prompt longer than a step (scheduler.max_step_tokens 128: chunks
    that keep no logit)."""
    from oxygen_torch.integrations.hf import engine_runner

    monkeypatch.setattr(engine_runner.HFRunner, "_compiles_here", lambda self: True)
    model = tiny("llama", max_position_embeddings=1024)
    seeds = torch.randint(0, 10_000, (4,)).tolist()
    two = [long_call(s, int(n)) for s, n in zip(seeds[2:], torch.randint(40, 49, (2,)))]
    width = max(kw["input_ids"].shape[1] for kw in two)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, kw in enumerate(two):  # (left-padded)
        ids[i, width - kw["input_ids"].shape[1] :] = kw["input_ids"][0]
        mask[i, width - kw["input_ids"].shape[1] :] = 1
    kws = [long_call(seeds[0], 60), long_call(seeds[1], 20),
           dict(two[0], input_ids=ids, attention_mask=mask), long_call(seeds[0], 300)]  # fmt: skip
    ref = [_generate(model, kw) for kw in kws]
    kv = dict(RERUN, mixed_graphs=32, decode_graph_fusion=False)
    hf.apply(model, load_config(scheduler={"engine": True, "max_step_tokens": 128}, kv=kv))
    assert load_config().kv.prefill_compile  # (the default)
    got = oxygen_torch.warm_up(model, max_rows=4, max_length=512)
    assert got["prefill_compiled"], got
    (eng,) = engines(model)
    runner = eng.runner
    assert runner.prefill_compiled == 1, runner.prefill_compiled
    assert [e[2] for e in eng.stats.timeline if e[2] > e[1]][-1] == 33  # (its prompt step)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    since = len(eng.stats.timeline)
    for kw, r in zip(kws, ref):
        assert torch.equal(_generate(model, kw), r)
    steps = [(e[1], e[2]) for e in list(eng.stats.timeline)[since:] if e[2] > e[1]]
    both = sum(kw["input_ids"].shape[1] for kw in two)
    assert (2, both) in steps and (1, 128) in steps, steps
    # 60; the two rows; 128 + 128 + 44 (20 replays a mixed graph)
    assert runner.prefill_compiled == 6, (runner.prefill_compiled, steps)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_compile_in_the_traffic_is_told_once_and_not_after_warm_up(switched, monkeypatch, caplog):
    """A step that compiled alone outside warm_up() (here the prefill forward, kv.prefill_compile,
    the CPU stand-in told it compiles; any such step told: STALL_TELL_S 0) is said once, with
    its seconds and the way out (warm_up); a model warmed first says nothing at its calls."""
    from oxygen_torch.integrations.hf import engine_runner

    monkeypatch.setattr(engine_runner.HFRunner, "_compiles_here", lambda self: True)
    monkeypatch.setattr(engine_runner, "STALL_TELL_S", 0.0)
    kv = dict(RERUN, mixed_graphs=32, decode_graph_fusion=False)
    seeds = torch.randint(0, 10_000, (3,)).tolist()

    def told():
        return [r.getMessage() for r in caplog.records if "in the traffic" in r.getMessage()]

    model = tiny("llama", max_position_embeddings=1024)
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        for s in seeds:
            _generate(model, long_call(s, 60))
    (said,) = told()
    assert "kv.prefill_compile" in said and "warm_up(model)" in said and "rows (1)" in said, said
    hf.disable_hf()
    caplog.clear()
    model = tiny("llama", max_position_embeddings=1024)
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        oxygen_torch.warm_up(model, max_rows=2, max_length=256)
        for s in seeds:
            _generate(model, long_call(s, 60))
    assert told() == [], told()


def test_decode_mixed_and_prefill_steps_share_one_compiled_forward(switched):
    """kv.cpu_decode_graphs "fuse" (the CPU compiles as a GPU does): warm_up's mixed graphs of
    three token buckets, decode graphs of rows buckets 1 to 4 and the compiled prefill make two
    compiles of the forward in all: one with its sizes symbolic from the start, which every step
    of two tokens or more runs, and one-row decode's own (each kind had compiled a static and
    then a symbolic forward of its own: five, ~15 s each on an H100). Calls after it (a mixed
    graph's prompt, one over kv.mixed_graphs, two rows) equal stock and compile nothing."""
    torch._dynamo.reset()  # (the compiled forward is shared by a class's models: none yet)
    model = tiny("qwen3", max_position_embeddings=1024)
    seeds = torch.randint(0, 10_000, (3,)).tolist()
    kws = [long_call(seeds[0], 20), long_call(seeds[1], 100), call(seeds[2] * 3 + 1)]
    ref = [_generate(model, kw) for kw in kws]
    hf.apply(model, load_config(scheduler={"engine": True},
                                kv={"cpu_decode_graphs": "fuse", "mixed_graphs": 64}))  # fmt: skip
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    got = oxygen_torch.warm_up(model, max_rows=4, max_length=256)
    assert got["mixed_captured"] == 3 and got["prefill_compiled"], got
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    for kw, r in zip(kws, ref):
        assert torch.equal(_generate(model, kw), r)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2


def test_warm_up_leaves_the_prefill_forward_alone_where_it_is_off(switched, monkeypatch):
    """kv.prefill_compile false: warm_up runs no longer prompt and compiles nothing for it."""
    from oxygen_torch.integrations.hf import engine_runner

    monkeypatch.setattr(engine_runner.HFRunner, "_compiles_here", lambda self: True)
    model = tiny("llama", max_position_embeddings=1024)
    kv = dict(RERUN, mixed_graphs=32, decode_graph_fusion=False, prefill_compile=False)
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    got = oxygen_torch.warm_up(model, max_rows=4, max_length=256)
    assert not got["prefill_compiled"], got
    (eng,) = engines(model)
    assert eng.runner.prefill_compiled == 0
    assert max(e[2] for e in eng.stats.timeline if e[2] > e[1]) <= 32


@pytest.mark.parametrize("tier_bytes", [0, 32 << 20])
def test_warm_up_makes_the_cpu_tier_up_front(switched, monkeypatch, tier_bytes):
    """warm_up() makes the KV pool's CPU tier on its own thread, waiting (a GPU pool's engine
    would make it beside its steps at its first preemption, recomputing until then: told here
    that making it pins memory); pool.cpu_tier_bytes 0: none."""
    import threading

    from test_kv_tier import SlowTier

    from oxygen_torch.kv import pool as pool_mod

    made = SlowTier(monkeypatch, 0.0).made
    monkeypatch.setattr(pool_mod.KVPool, "_pins", lambda self: True)
    model = tiny("llama", max_position_embeddings=1024)
    # (an arena of its own size: a pool of its own, whatever pools other tests left)
    kv = dict(RERUN, arena_bytes=(40 << 20) + tier_bytes)
    cfg = load_config(scheduler={"engine": True}, kv=kv, pool={"cpu_tier_bytes": tier_bytes})
    hf.apply(model, cfg)
    got = oxygen_torch.warm_up(model, max_rows=2, max_length=256)
    (eng,) = engines(model)
    tier = eng.kvs.pool.tier
    if tier_bytes:
        assert tier is not None and made == [threading.current_thread().name], made
        assert got["cpu_tier_bytes"] == tier.num_slots * tier.row_bytes > 0.9 * tier_bytes
    else:
        assert tier is None and not made and got["cpu_tier_bytes"] == 0


def test_warm_up_prepares_the_tiers_moves_for_a_rows_blocks(switched, monkeypatch):
    """With a CPU tier, warm_up() asks it to prepare its moves by the mapped kernel (compiled,
    graphs captured on a GPU) for a row's blocks at max_length and reports the graphs
    captured; on the host backend the tier itself prepares none."""
    from oxygen_torch.kv.tier import CPUTier

    asked = []
    real = CPUTier.warm_moves

    def warm_moves(self, max_blocks):
        asked.append((max_blocks, real(self, max_blocks)))
        return 3

    monkeypatch.setattr(CPUTier, "warm_moves", warm_moves)
    model = tiny("llama", max_position_embeddings=1024)
    kv = dict(RERUN, arena_bytes=(40 << 20) + (16 << 20))
    cfg = load_config(scheduler={"engine": True}, kv=kv, pool={"cpu_tier_bytes": 16 << 20})
    hf.apply(model, cfg)
    got = oxygen_torch.warm_up(model, max_rows=2, max_length=300)
    assert got["tier_graphs"] == 3 and asked == [(got["table_blocks"], 0)], (got, asked)
    assert got["table_blocks"] >= 300 // 16


def test_warm_up_goes_on_without_a_tier_it_cannot_make(switched, monkeypatch, caplog):
    """A CPU tier that cannot be made (here: raises, as pinning past the host's limit would)
    does not fail warm_up: one warning naming it, no tier, and the warm-up's other work done."""
    from oxygen_torch.kv import pool as pool_mod

    def broken(*args, **kwargs):
        raise RuntimeError("no pinned memory here")

    monkeypatch.setattr(pool_mod, "CPUTier", broken)
    _patching.forget_warnings()
    model = tiny("llama", max_position_embeddings=1024)
    kv = dict(RERUN, arena_bytes=56 << 20)  # (a pool of its own)
    cfg = load_config(scheduler={"engine": True}, kv=kv, pool={"cpu_tier_bytes": 32 << 20})
    hf.apply(model, cfg)
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        got = oxygen_torch.warm_up(model, max_rows=2, max_length=256)
    said = [r.getMessage() for r in caplog.records if "CPU tier" in r.getMessage()]
    assert len(said) == 1 and "no pinned memory here" in said[0], said
    assert got["cpu_tier_bytes"] == 0 and got["captured"] == 2, got
