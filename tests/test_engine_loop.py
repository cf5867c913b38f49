"""The engine owns the loop (scheduler.engine): generate() calls become engine requests, one
thread steps every row at once. On CPU, tiny random models of several architectures: every
greedy call's output equals stock generate()'s, sampled calls are reproducible by seed whatever
runs beside them, streamers see the returned tokens in order on the caller's thread."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest
import torch
import transformers as T
from test_engine import in_threads
from test_hf_generate import tiny
from tiny_tokenizer import tiny_tokenizer

import oxygen_torch
from oxygen_torch.config import load_config
from oxygen_torch.engine.sampling import Sampler
from oxygen_torch.integrations.hf import PagedKVCache, engine_runner, front, merged_graphs
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool_stats

ENGINE = load_config(scheduler={"engine": True})


def engines(model):
    return list(engine_runner._engines.get(model, {}).values())


def blocks_in_use() -> int:
    return sum(p["blocks_used"] for p in pool_stats())


def call(seed: int, vocab: int = 128) -> dict:
    """A call's own arguments: batch 1-3 with left padding, prompt lengths, max/min lengths,
    EOS ids differ from call to call."""
    g = torch.Generator().manual_seed(seed)
    rows, width = 1 + seed % 3, 4 + (7 * seed) % 13
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, rows):  # left padding of different widths (row 0 keeps all)
        pad = int(torch.randint(0, width - 1, (1,), generator=g))
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    if seed % 4 == 1:
        kw["max_length"] = width + 3 + seed % 6
    else:
        kw["max_new_tokens"] = 3 + seed % 9
    if seed % 3 == 2:
        kw["eos_token_id"] = [int(ids[0, -1]), 7]  # may stop early where generated
    if seed % 5 == 3:
        kw["min_new_tokens"] = 2
    return kw


def stock_then_engine(model, kws: list[dict]):
    """Each call on stock transformers one after the other, then all at once from threads on the
    engine: (stock outputs, engine outputs)."""
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, ENGINE)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    return ref, [out[i] for i in range(len(kws))]


def failing_compile(monkeypatch) -> list:
    """fuse.compiled raises at once ("no compile here"); the list counts its tries."""
    from oxygen_torch.integrations.hf import fuse

    tried = []

    @contextlib.contextmanager
    def failing(*a, **k):
        tried.append(1)
        raise RuntimeError("no compile here")
        yield  # (a generator: the context manager's shape)

    monkeypatch.setattr(fuse, "compiled", failing)
    return tried


def arriving(model, kws: list[dict], gap_s: float) -> dict:
    """The calls from threads, the i-th started i * gap_s after the first: {i: output}."""

    def one(i, kw):
        time.sleep(gap_s * i)
        return _generate(model, kw)

    out, errors = in_threads(one, [(i, kw) for i, kw in enumerate(kws)])
    assert not errors, errors
    return out


def _generate(model, kw):
    with torch.no_grad():
        return model.generate(**kw)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma3"])
@pytest.mark.parametrize("calls", [1, 5, 16])
def test_concurrent_greedy_calls_equal_stock(oxygen, arch, calls):
    model = tiny(arch)
    seeds = torch.randint(0, 10_000, (calls,)).tolist()
    kws = [call(s) for s in seeds]
    front.REASONS.clear()  # (what earlier tests sent to the per-call path)
    ref, got = stock_then_engine(model, kws)
    for i, (r, o) in enumerate(zip(ref, got)):
        assert torch.equal(o, r), (arch, seeds[i], kws[i])
    (eng,) = engines(model)
    st = eng.snapshot()
    assert st["forwards"] == st["steps"] > 0  # one forward a step, every call's rows in it
    assert not front.REASONS, front.REASONS
    assert blocks_in_use() == 0  # every row's blocks came back


def test_no_per_call_python_per_step(oxygen, monkeypatch):
    """Engine calls never enter transformers' decoding loop: the loop is the engine's."""
    model = tiny("llama")
    kws = [call(s) for s in range(8)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]

    def refuse(*a, **k):
        raise AssertionError("transformers' own decoding loop ran")

    monkeypatch.setattr(T.GenerationMixin, "_sample", refuse)
    hf.apply(model, ENGINE)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    assert all(torch.equal(out[i], r) for i, r in enumerate(ref))
    (eng,) = engines(model)
    rows = eng.snapshot()["rows_per_step"]
    assert rows > 1.5, rows  # steps served several calls' rows at once


@pytest.mark.parametrize(
    "arch, whole",
    [("llama", True), ("qwen3", True), ("mistral", True), ("gemma3", True), ("llama", False)],
)
def test_decode_graphs_capture_the_forward_fused_and_equal_stock(oxygen, monkeypatch, arch, whole):
    """The engine's decode steps replay graphs captured from the forward compiled whole by
    backend "oxygen" (kv.decode_graph_compile; off: the RMSNorm / MLP / rotary modules
    compiled), as a single call's decode graphs do: on CPU through the stand-in replays
    (kv.cpu_decode_graphs "fuse"). 8 concurrent calls of 1-3 rows pass through several rows
    buckets, each captured at once (whole: one compile, then sizes compiled symbolic); every
    call's tokens and its float32 logits at every step equal stock's."""
    from oxygen_torch.engine import gc_watch

    monkeypatch.setattr(merged_graphs, "CAPTURE_AFTER", 0)
    refrozen = []  # each compile's objects frozen after it (engine/gc_watch.py refreeze)
    monkeypatch.setattr(gc_watch, "refreeze", refrozen.append)
    model = tiny(arch)
    seeds = torch.randint(0, 10_000, (8,)).tolist()
    kws = [dict(call(s), return_dict_in_generate=True, output_logits=True) for s in seeds]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    kv = {"cpu_decode_graphs": "fuse", "decode_graph_compile": whole}
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i].sequences, r.sequences), (arch, seeds[i])
        for a, b in zip(out[i].logits, r.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    assert st["replays"] > 0 and st["failed"] == 0, st
    assert st["compiled" if whole else "fused"] == st["graphs"] >= 2, st
    # (the steps with prompt tokens replay graphs too, kv.mixed_graphs: their logits above)
    mixed = oxygen_torch.decode_graph_stats(model)["mixed"]
    assert mixed["captures"] >= 1 and mixed["failed"] == 0, mixed
    captures = st["captures"] + mixed["captures"]
    assert refrozen == ["a merged decode graph's compile"] * captures, (refrozen, st, mixed)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_steps_run_the_compiled_forward_and_equal_stock(oxygen, arch):
    """kv.prefill_compile: the engine's steps that carry prompt tokens run the forward compiled
    whole by backend "oxygen" with dynamic shapes (on CPU: kv.cpu_decode_graphs "fuse", decode
    graphs off so the decode steps stay eager and every compile counted is the prefill's). One
    call compiles it; then 8 calls of 1-3 rows arriving 15 ms apart make steps of several token
    counts, prompts beside decoding rows: every call's tokens and its float32 logits at every
    step equal stock's, every step with prompt tokens ran compiled, and those token counts
    compiled nothing more (the sizes are symbolic)."""
    seeds = torch.randint(0, 10_000, (9,)).tolist()
    model = tiny(arch)
    kws = []
    for s in seeds:
        kw = dict(call(s), return_dict_in_generate=True, output_logits=True, max_new_tokens=20)
        kw.pop("max_length", None)
        kw.pop("eos_token_id", None)  # (every call decodes its 20 tokens: they overlap)
        kws.append(kw)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    kv = {"cpu_decode_graphs": "fuse", "prefill_compile": True, "decode_graphs": False}
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    first = _generate(model, kws[0])  # (the compile)
    (eng,) = engines(model)
    assert eng.runner.prefill_compiled == 1
    steps_before = len(eng.stats.timeline)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    out = arriving(model, kws[1:], 0.015)
    for got, r, seed in zip([first] + [out[i] for i in range(8)], ref, seeds):
        assert torch.equal(got.sequences, r.sequences), (arch, seed)
        for a, b in zip(got.logits, r.logits):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    prefill = [(e[1], e[2]) for e in list(eng.stats.timeline)[steps_before:] if e[2] > e[1]]
    assert len({tokens for _, tokens in prefill}) >= 2, prefill
    assert eng.runner.prefill_compiled == 1 + len(prefill), (eng.runner.prefill_compiled, prefill)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before <= 1


def test_a_prefill_compile_that_fails_warns_once_and_the_steps_run_eagerly(
    oxygen, monkeypatch, caplog
):
    """kv.prefill_compile whose compile fails (here: raises at once): one warning naming the
    setting, the steps with prompt tokens run eagerly from then on (the compile is not tried
    again), and every call's tokens equal stock's."""
    tried = failing_compile(monkeypatch)
    model = tiny("llama")
    kws = [call(s) for s in torch.randint(0, 10_000, (6,)).tolist()]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    kv = {"cpu_decode_graphs": "fuse", "prefill_compile": True, "decode_graphs": False}
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    assert all(torch.equal(out[i], r) for i, r in enumerate(ref))
    said = [r.getMessage() for r in caplog.records if "kv.prefill_compile" in r.getMessage()]
    assert len(said) == 1 and "no compile here" in said[0], said
    assert tried == [1]
    (eng,) = engines(model)
    assert eng.runner.prefill_compiled == 0


def test_a_whole_forward_compile_that_fails_is_tried_once_then_modules_fused(
    oxygen, monkeypatch, caplog
):
    """The whole-forward compile of the engine's decode graphs fails (here: raises at once):
    the first capture falls back to the module fusion with one warning, and later rows buckets
    do not try the compile again; every call's tokens equal stock's."""
    monkeypatch.setattr(merged_graphs, "CAPTURE_AFTER", 0)
    tried = failing_compile(monkeypatch)
    model = tiny("llama")
    kws = [call(s) for s in torch.randint(0, 10_000, (6,)).tolist()]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    # (decode graphs only: the mixed steps' graphs, kv.mixed_graphs, and the prefill steps'
    # forward, kv.prefill_compile, try the whole-forward compile once more on their own)
    kv = {"cpu_decode_graphs": "fuse", "mixed_graphs": 0, "prefill_compile": False}
    hf.apply(model, load_config(scheduler={"engine": True}, kv=kv))
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    assert all(torch.equal(out[i], r) for i, r in enumerate(ref))
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    assert st["fused"] == st["graphs"] >= 2 and st["compiled"] == 0, st
    assert len(tried) == 1, tried
    assert sum("fusion (compiled) failed" in r.getMessage() for r in caplog.records) == 1


def test_eos_held_back_before_min_new_tokens_as_stock_with_raw_logits_untouched(
    oxygen, monkeypatch
):
    """Greedy calls whose EOS is the argmax before their min_new_tokens: stock suppresses it,
    and so does the engine, in the logits themselves (no sampler, no float32 copy) when no row
    of the step keeps anything; a call beside them that keeps its raw logits (output_logits)
    gets them as stock's, its EOS not masked."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    kws = []
    for rows in (1, 2, 3):
        ids = torch.randint(3, 128, (rows, 7), generator=g)
        with torch.no_grad():
            first = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False)[0, -1]
        kws.append(dict(input_ids=ids, eos_token_id=int(first), min_new_tokens=4,
                        max_new_tokens=9, do_sample=False))  # fmt: skip
    kept = dict(kws[0], return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
        ref_kept = model.generate(**kept)
    assert all(int(r[0, 7]) != kw["eos_token_id"] for r, kw in zip(ref, kws))  # held back
    hf.apply(model, ENGINE)
    calls, sampler = [], Sampler.__call__

    def counted(self, logits, rows, *args):
        calls.append(len(rows))
        return sampler(self, logits, rows, *args)

    monkeypatch.setattr(Sampler, "__call__", counted)
    got = [_generate(model, kw) for kw in kws]
    assert not calls, calls  # alone: the logits masked in place
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws + [kept]])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(got[i], r) and torch.equal(out[i], r), i
    assert torch.equal(out[3].sequences, ref_kept.sequences)
    for a, b in zip(out[3].logits, ref_kept.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", ["greedy", "mixed"])  # the loop's own EOS mask; the sampler
def test_the_engine_never_assigns_a_python_value_through_a_tensor_index(oxygen, monkeypatch, rows):
    """`t[rows, cols] = value` with a Python value copies the value from pageable memory on a
    GPU: a wait for the stream inside every step that masks EOS (min_new_tokens) or notes a
    penalised row's tokens (the H200 suite caught it in the sampler). The engine's steps run
    here with both, and no such assignment may come from the engine's modules (they use
    kv.transfer.put_value)."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    kws = [dict(input_ids=torch.randint(3, 128, (1 + i % 2, 6), generator=g), eos_token_id=5,
                min_new_tokens=4, max_new_tokens=7, do_sample=rows == "mixed" and i % 3 == 0,
                top_k=20, repetition_penalty=1.3 if rows == "mixed" and i % 2 else 1.0)
           for i in range(6)]  # fmt: skip
    hf.apply(model, ENGINE)
    seen, setitem = [], torch.Tensor.__setitem__

    def spy(self, index, value):
        parts = index if isinstance(index, tuple) else (index,)
        if isinstance(value, (bool, int, float)) and any(
            isinstance(x, torch.Tensor) for x in parts
        ):
            where = sys._getframe(1).f_code.co_filename
            if f"oxygen_torch{os.sep}engine" in where:
                seen.append(where)
        return setitem(self, index, value)

    monkeypatch.setattr(torch.Tensor, "__setitem__", spy)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    assert all(out[i].shape[1] == kw["input_ids"].shape[1] + 7 for i, kw in enumerate(kws))
    assert not seen, seen


@pytest.mark.parametrize("ending", ["eos", "penalty"])
def test_dict_outputs_scores_and_logits_equal_stock(oxygen, ending):
    """return_dict_in_generate with output_scores / output_logits: the classes, shapes and
    values of stock's (float32): a row that ends early (EOS) while the others go on (its call
    steps on with the pad token, as stock's batch does), or every row with a repetition
    penalty."""
    model = tiny("llama")
    ids = torch.randint(3, 128, (3, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
              return_dict_in_generate=True, output_scores=True, output_logits=True)  # fmt: skip
    with torch.no_grad():
        probe = model.generate(**kw).sequences
    if ending == "eos":  # row 2's third new token, which rows 0 and 1 do not draw
        eos = int(probe[2, 9 + 2])
        assert eos not in probe[:2, 9:].tolist()
        kw["eos_token_id"] = eos
    else:
        kw["repetition_penalty"] = 1.3
    with torch.no_grad():
        ref = model.generate(**kw)
        hf.apply(model, ENGINE)
        got = model.generate(**kw)
    assert type(got) is type(ref) and torch.equal(got.sequences, ref.sequences)
    assert len(got.scores) == len(ref.scores) and len(got.logits) == len(ref.logits)
    for a, b in zip(got.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(got.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert isinstance(got.past_key_values, PagedKVCache)
    assert got.past_key_values.get_seq_length() == ref.past_key_values.get_seq_length()


def test_stop_strings_equal_stock(oxygen):
    model = tiny("llama")
    tok = tiny_tokenizer()
    with torch.no_grad():  # a stop string that a greedy continuation reaches
        probe = model.generate(torch.tensor([[5, 9, 11, 13]]), max_new_tokens=10, do_sample=False)
    word = tok.convert_ids_to_tokens([int(probe[0, 7])])[0]
    kws = [dict(input_ids=torch.tensor([[5, 9, 11, 13]]), max_new_tokens=10, do_sample=False,
                stop_strings=[word, "w999"], tokenizer=tok)]  # fmt: skip
    kws += [call(s) for s in range(3)]
    ref, got = stock_then_engine(model, kws)
    for r, o in zip(ref, got):
        assert torch.equal(o, r)
    assert ref[0].shape[1] <= 4 + 4  # it stopped at the string


class Recorder:
    """A streamer: what put() got, from which thread."""

    def __init__(self):
        self.puts, self.threads, self.ended = [], set(), False

    def put(self, value):
        self.puts.append(value.clone())
        self.threads.add(threading.get_ident())

    def end(self):
        self.ended = True


def test_streamers_see_the_returned_tokens_in_order_on_the_callers_thread(oxygen):
    model = tiny("llama")
    hf.apply(model, ENGINE)
    kws = [call(s) for s in (0, 3, 6, 9)]  # single-row calls and batches
    rec = [Recorder() for _ in kws]
    me = {}

    def run(i):
        me[i] = threading.get_ident()
        return _generate(model, dict(kws[i], streamer=rec[i]))

    out, errors = in_threads(run, [(i,) for i in range(len(kws))])
    assert not errors, errors
    for i, kw in enumerate(kws):
        r = rec[i]
        assert r.ended and r.threads == {me[i]}
        assert torch.equal(r.puts[0], kw["input_ids"])  # the prompt first, as stock
        steps = torch.stack([p.view(-1) for p in r.puts[1:]], 1)
        assert torch.equal(steps, out[i][:, kw["input_ids"].shape[1] :])


class EngineSide:
    """A streamer that asks to be run on the engine's thread (the server's engine process)."""

    oxygen_engine_thread = True

    def __init__(self):
        self.puts, self.columns, self.threads, self.ended = [], [], set(), False

    def put(self, value):  # (the prompt, on the caller's thread)
        self.puts.append(value.clone())

    def oxygen_put_ids(self, columns):
        self.columns += columns
        self.threads.add(threading.current_thread().name)

    def end(self):
        self.ended = True


def test_an_engine_thread_streamer_is_run_there_and_its_caller_sleeps(oxygen, monkeypatch):
    import time

    from oxygen_torch.engine.request import Group

    model = tiny("llama")
    hf.apply(model, ENGINE)
    kws = [dict(call(s), max_new_tokens=16 + s) for s in (0, 3, 6)]  # one row and batches
    rec = [EngineSide() for _ in kws]
    looks, wait = {}, Group.wait

    def counted(self, seen, timeout):
        looks[threading.get_ident()] = looks.get(threading.get_ident(), 0) + 1
        return wait(self, seen, timeout)

    monkeypatch.setattr(Group, "wait", counted)
    me = {}

    def run(i):
        me[i] = threading.get_ident()
        return _generate(model, dict(kws[i], streamer=rec[i]))

    began = time.monotonic()
    out, errors = in_threads(run, [(i,) for i in range(len(kws))])
    took = time.monotonic() - began
    assert not errors, errors
    for i, kw in enumerate(kws):
        r, width = rec[i], kw["input_ids"].shape[1]
        assert r.ended and torch.equal(r.puts[0], kw["input_ids"]) and len(r.puts) == 1
        assert torch.equal(torch.tensor(r.columns).t(), out[i][:, width:])
        assert r.threads and all(n.startswith("oxygen-") for n in r.threads), r.threads
        # woken at its end, not a step (a look every 2 s at most besides)
        assert looks[me[i]] <= 2 + took / 2, (looks[me[i]], out[i].shape)


def test_sampling_is_reproducible_by_seed_whatever_runs_beside(oxygen):
    model = tiny("llama")
    hf.apply(model, ENGINE)
    kw = dict(input_ids=torch.tensor([[5, 9, 11, 13, 17]]), max_new_tokens=12, do_sample=True,
              temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.2)  # fmt: skip

    def sampled(seed):
        with oxygen_torch.task(seed=seed), torch.no_grad():
            return model.generate(**kw)

    alone = sampled(1234)
    others = [(call(s),) for s in range(6)]
    out, errors = in_threads(
        lambda i: sampled(1234) if i == 3 else _generate(model, others[i][0]),
        [(i,) for i in range(6)],
    )
    assert not errors, errors
    assert torch.equal(out[3], alone)
    assert not torch.equal(sampled(99), alone)  # another seed, other tokens
    torch.manual_seed(7)
    a = _generate(model, kw)
    torch.manual_seed(7)
    assert torch.equal(_generate(model, kw), a)  # a call alone after torch.manual_seed


def test_the_topk_sampling_path_draws_the_torch_processors_tokens(oxygen, monkeypatch):
    """scheduler.sampling_kernel "topk" (its draw under the interpreter here) in the engine:
    temperature, top-k and the repetition penalty (no top-p, whose cut may round to the other
    side) give the tokens the PyTorch processors give for the same seeds, beside a call that
    wants its scores (output_scores: those equal too; a step holding it takes the processors)
    and one that does not."""
    from oxygen_torch.engine import sampling

    monkeypatch.setattr(sampling, "_kernel_ok", lambda t: True)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20,
              repetition_penalty=1.3, return_dict_in_generate=True)  # fmt: skip
    prompts = [torch.tensor([[5, 9, 11, 13, 17]]), torch.tensor([[3, 4, 60, 2]])]

    def run(kernel):
        model = tiny("llama")
        hf.apply(model, load_config(scheduler={"engine": True, "sampling_kernel": kernel}))

        def one(i):
            with oxygen_torch.task(seed=100 + i), torch.no_grad():
                return model.generate(input_ids=prompts[i], output_scores=i == 0, **kw)

        out, errors = in_threads(one, [(0,), (1,)])
        assert not errors, errors
        return out

    topk, plain = run("topk"), run("torch")
    for i in range(2):
        assert torch.equal(topk[i].sequences, plain[i].sequences), i
    assert topk[1].scores is None and len(topk[0].scores) == 8
    for a, b in zip(topk[0].scores, plain[0].scores):  # (the steps' batches may differ)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw, reason",
    [
        (dict(num_beams=2), "num_beams"),
        (dict(output_hidden_states=True), "output_hidden_states"),
        (dict(no_repeat_ngram_size=2), "no_repeat_ngram_size"),
        (
            dict(logits_processor=T.LogitsProcessorList([T.TemperatureLogitsWarper(0.5)])),
            "logits_processor",
        ),
    ],
)
def test_unsupported_settings_take_the_per_call_path_counted(oxygen, kw, reason):
    model = tiny("llama")
    base = dict(input_ids=torch.tensor([[5, 9, 11, 13]]), max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**base, **kw)
        hf.apply(model, ENGINE)
        front.REASONS.clear()
        got = model.generate(**base, **kw)
    got_seq = got if isinstance(got, torch.Tensor) else got.sequences
    ref_seq = ref if isinstance(ref, torch.Tensor) else ref.sequences
    assert torch.equal(got_seq, ref_seq)
    assert any(reason in r for r in front.REASONS), front.REASONS
    assert oxygen_torch.engine_stats()["per_call"] == dict(front.REASONS)


class Boom(Exception):
    pass


class RaisingStreamer(Recorder):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc

    def put(self, value):
        super().put(value)
        if len(self.puts) == 3:
            raise self.exc("the caller's streamer")


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt])
def test_a_raising_or_interrupted_caller_ends_only_its_call_and_its_blocks_come_back(oxygen, exc):
    """A streamer that raises, or a caller interrupted (KeyboardInterrupt reaching its thread
    while it waits), ends that call at the engine's next step; the others finish."""
    model = tiny("llama")
    kws = [call(s) for s in range(6)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, ENGINE)
    bad = dict(input_ids=torch.tensor([[5, 9, 11]]), max_new_tokens=40, do_sample=False,
               streamer=RaisingStreamer(exc))  # fmt: skip
    out, errors = in_threads(
        lambda i: _generate(model, bad if i == 6 else kws[i]), [(i,) for i in range(7)]
    )
    assert set(errors) == {6} and isinstance(errors[6], exc)
    assert all(torch.equal(out[i], ref[i]) for i in range(6))
    (eng,) = engines(model)
    for _ in range(100):  # the engine drops the cancelled call at its next step
        if blocks_in_use() == 0 and not eng.running:
            break
        threading.Event().wait(0.02)
    assert blocks_in_use() == 0


def test_an_engine_thread_that_dies_fails_every_waiting_call_and_none_hangs(oxygen, monkeypatch):
    model = tiny("llama")
    hf.apply(model, ENGINE)
    _generate(model, call(0))  # the engine exists
    (eng,) = engines(model)
    forward = eng.runner.forward

    def dies(*a, **k):
        raise SystemExit("the engine thread's forward")  # (not an Exception: the thread ends)

    monkeypatch.setattr(eng.runner, "forward", dies)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(call(s),) for s in range(5)],
                             timeout=60)  # fmt: skip
    assert len(errors) == 5 and all(isinstance(e, SystemExit) for e in errors.values())
    monkeypatch.setattr(eng.runner, "forward", forward)
    kw = call(1)
    with torch.no_grad():  # a new call after the failure: a new thread serves it
        again = model.generate(**kw)
    assert again.shape[0] == kw["input_ids"].shape[0]
    assert blocks_in_use() == 0


def test_a_high_call_into_a_full_engine_starts_within_a_bound_and_low_calls_finish(oxygen):
    """max_step_seqs 4, four low-priority calls decoding: a high-priority call arriving takes a
    low row's place at once (preempted, recomputed later) and draws its first token within 3
    steps; every low call still ends with its stock tokens. (The high call comes once every low
    call has 5 tokens, and the low calls are long enough not to end before it, however slowly
    its thread starts on a loaded machine.)"""
    model = tiny("llama")
    low = [dict(input_ids=torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(s)),
                max_new_tokens=150, do_sample=False) for s in range(4)]  # fmt: skip
    high = dict(input_ids=torch.tensor([[5, 9, 11, 13]]), max_new_tokens=5, do_sample=False)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in low] + [model.generate(**high)]
    hf.apply(model, load_config(scheduler={"engine": True, "max_step_seqs": 4}))
    _generate(model, high)  # the engine exists
    (eng,) = engines(model)
    started = threading.Event()

    def run(i):
        if i < 4:
            with oxygen_torch.task(priority="low"):
                return _generate(model, dict(low[i], streamer=marks[i]))
        assert started.wait(60)
        with oxygen_torch.task(priority="high"):
            return _generate(model, dict(high, streamer=first))

    decoding, lock = [0], threading.Lock()

    class Running(Recorder):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 6:  # this low call has 5 tokens
                with lock:
                    decoding[0] += 1
                    if decoding[0] == 4:  # every low call decodes: the engine is full
                        started.set()

    marks, first, submitted, drawn = [Running() for _ in range(4)], Recorder(), [0], [None]
    submit, complete = eng.submit, eng._complete

    def counted(group):  # the steps so far when the high call reaches the engine
        if group.requests[0].task.priority_class == "high":
            submitted[0] = eng.stats.steps
        submit(group)

    def delivered(f):  # ... and when its first token is read (the engine's count, not when
        complete(f)  # its caller's thread wakes: on a loaded machine a step or two later)
        if drawn[0] is None and any(
            row.req.task.priority_class == "high" and row.req.out for row in f.kept
        ):
            drawn[0] = eng.stats.steps

    eng.submit, eng._complete = counted, delivered
    out, errors = in_threads(run, [(i,) for i in range(5)])
    assert not errors, errors
    assert all(torch.equal(out[i], ref[i]) for i in range(5))
    assert drawn[0] - submitted[0] <= 3, (submitted, drawn)
    assert eng.stats.preemptions >= 1


def _prompts_beside_a_decode(model, sched: dict, levels: tuple[str, str], new: int) -> list:
    """A call of 5 prompt tokens and `new` new ones (priority levels[0]) decodes when three calls
    with 40-token prompts (priority levels[1]) arrive after its third token, on an engine with
    `sched`; every call's tokens must equal stock's. Returns each step's (whether the first call
    is in it, the later calls' prompt tokens in it)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    first = dict(input_ids=torch.randint(3, 128, (1, 5), generator=g), max_new_tokens=new,
                 min_new_tokens=new, do_sample=False)  # fmt: skip
    later = [dict(input_ids=torch.randint(3, 128, (1, 40), generator=g), max_new_tokens=4,
                  do_sample=False) for _ in range(3)]  # fmt: skip
    with torch.no_grad():
        ref = [model.generate(**first)] + [model.generate(**kw) for kw in later]
    hf.apply(model, load_config(scheduler={"engine": True, **sched}))
    _generate(model, dict(first, max_new_tokens=2, min_new_tokens=2))  # the engine exists
    (eng,) = engines(model)
    steps, launch = [], eng._launch

    def recorded(rows):
        first_in = any(len(row.req.prompt) == 5 for row in rows)
        prompt = sum(row.n for row in rows if row.ids is not None and len(row.req.prompt) == 40)
        steps.append((first_in, prompt))
        return launch(rows)

    eng._launch = recorded
    going = threading.Event()

    class Going(Recorder):
        def put(self, value):
            super().put(value)
            if len(self.puts) == 4:  # the first call has 3 new tokens: the others come
                going.set()

    def run(i):
        if i == 0:
            with oxygen_torch.task(priority=levels[0]):
                return _generate(model, dict(first, streamer=Going()))
        assert going.wait(60)
        with oxygen_torch.task(priority=levels[1]):
            return _generate(model, later[i - 1])

    out, errors = in_threads(run, [(i,) for i in range(4)])
    assert not errors, errors
    assert all(torch.equal(out[i], ref[i]) for i in range(4))
    return steps


@pytest.mark.parametrize("cap", [8, 0])
def test_lower_prompts_beside_a_higher_call_share_the_cap_of_a_step(oxygen, cap):
    """scheduler.lower_prefill_tokens: three low-priority calls with 40-token prompts arrive
    while a high-priority call decodes: in every step that serves the high call, the low
    calls' prompt chunks take at most `cap` tokens together, and they still progress beside it
    (0: no cap, a whole prompt joins a step). Every call's tokens equal stock's."""
    steps = _prompts_beside_a_decode(
        tiny("llama"), {"lower_prefill_tokens": cap}, ("high", "low"), 60
    )
    beside = [n for high_in, n in steps if high_in and n]
    if cap:
        assert beside and max(beside) <= cap, steps
    else:
        assert max(beside, default=0) > 8, steps


@pytest.mark.parametrize("cap", [6, 0])
@pytest.mark.parametrize("level", ["normal", "high"])
def test_prompts_beside_top_level_decodes_share_the_decode_cap(oxygen, cap, level):
    """scheduler.decode_prefill_tokens: a call decodes (priority `level`) when three calls of
    the same level with 40-token prompts arrive: in every step that serves the decoding call,
    the prompts' chunks take at most `cap` tokens together (0: no cap, a whole prompt joins a
    step), and the prompts still progress. lower_prefill_tokens is off, so only this cap acts.
    Every call's tokens equal stock's."""
    sched = {"decode_prefill_tokens": cap, "lower_prefill_tokens": 0}
    steps = _prompts_beside_a_decode(tiny("llama"), sched, (level, level), 50)
    beside = [n for decoding, n in steps if decoding and n]
    if cap:
        assert len(beside) >= 120 // cap and max(beside) <= cap, steps
    else:
        assert max(beside, default=0) > 8, steps


def test_engine_stats_sum_two_models_and_keep_the_longest_waits(oxygen):
    """engine_stats() over two models' engines: counts summed, each "_max_s" the longest one
    (not a sum of the longest waits)."""
    a, b = tiny("llama"), tiny("qwen3")
    for m, seed in ((a, 0), (b, 1)):
        hf.apply(m, ENGINE)
        in_threads(lambda kw, m=m: _generate(m, kw), [(call(seed + 2 * i),) for i in range(2)])
    (ea,), (eb,) = engines(a), engines(b)
    # (longer than any real wait: other tests' engines, alive or not, cannot hold the longest)
    ea.stats.door_max_s, eb.stats.door_max_s = 1000.25, 1000.5  # (a sum would be 2000.75)
    ea.stats.burst_wait_max_s, eb.stats.burst_wait_max_s = 1000.125, 1000.0625
    total = oxygen_torch.engine_stats()
    assert total["door_max_s"] == 1000.5 and total["burst_wait_max_s"] == 1000.125, total
    assert total["steps"] >= ea.stats.steps + eb.stats.steps > 0
    mine = {k: oxygen_torch.engine_stats(m) for k, m in (("a", a), ("b", b))}
    assert mine["a"]["door_max_s"] == 1000.25 and mine["b"]["door_max_s"] == 1000.5
    assert mine["a"]["doors"] == mine["b"]["doors"] == 2


def test_engine_steps_and_tokens_reach_the_metrics(oxygen):
    from oxygen_torch.engine.stats import METRICS

    before = METRICS.snapshot()
    model = tiny("llama")
    hf.apply(model, ENGINE)
    kws = [call(s) for s in range(4)]
    with oxygen_torch.task(priority="high"):
        out = _generate(model, kws[0])
    in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws[1:]])
    after = METRICS.snapshot()
    (eng,) = engines(model)
    snap = eng.snapshot()
    steps = snap["steps"]
    assert after["counters"]["steps"] - before["counters"]["steps"] == steps
    # each call's front door (generate() called -> rows submitted) is timed once
    assert snap["doors"] == len(kws) and 0 < eng.stats.door_max_s <= snap["door_s"]
    assert snap["door_max_s"] == eng.stats.door_max_s
    # each step's line: its choosing's CPU and its wait at the door within the choosing's wall;
    # its launch's CPU and OS run-queue wait within the launch's wall, its blocks and preemptions
    for line in eng.stats.timeline:
        assert len(line) == 15, line
        choose, picked, door_wait = line[3], line[10], line[11]
        assert 0 <= door_wait <= choose and 0 <= picked <= choose + 0.01, line
        launch, cpu, runq, blocks, preempted = line[4], line[8], line[12], line[13], line[14]
        assert 0 <= cpu <= launch + 0.01 and (runq is None or 0 <= runq <= launch + 0.01), line
        assert isinstance(blocks, int) and isinstance(preempted, int) and blocks >= 0, line
    host = after["step_time"]["host"]
    assert sum(host[1]) - sum(before["step_time"]["host"][1]) == steps
    new = out.shape[1] - kws[0]["input_ids"].shape[1]
    high = after["ttft"]["high"][1]
    assert sum(high) - sum(before["ttft"].get("high", ([], [0], 0))[1]) == out.shape[0]
    if new > 1:  # its later tokens: one TPOT observation each row and token
        got = sum(after["tpot"]["high"][1]) - sum(before["tpot"].get("high", ([], [0], 0))[1])
        assert got == out.shape[0] * (new - 1)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefix_cache_gives_later_calls_their_shared_prefix(oxygen, arch):
    """kv.prefix_cache: a call whose prompt starts with an earlier call's prompt and answer
    (a chat's next turn) computes only the rest; its tokens equal stock's."""
    model = tiny(arch)
    g = torch.Generator().manual_seed(8)
    first = torch.randint(3, 128, (1, 37), generator=g)
    kw = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        ref1 = model.generate(first, **kw)
        turn = torch.cat([ref1, torch.randint(3, 128, (1, 5), generator=g)], 1)
        ref2 = model.generate(turn, **kw)
        hf.apply(model, load_config(scheduler={"engine": True}, kv={"prefix_cache": True}))
        got1 = model.generate(first, **kw)
        (eng,) = engines(model)
        before = eng.snapshot()["tokens"]
        got2 = model.generate(turn, **kw)
    assert torch.equal(got1, ref1) and torch.equal(got2, ref2)
    computed = eng.snapshot()["tokens"] - before
    # the 43 tokens of the first call's prompt and answer, in whole 16-token blocks, came
    # from the cache: the second computes the rest of its 48-token prompt and 5 decodes
    assert computed == 48 - 32 + 5, computed


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rows_that_end_at_one_step_go_into_the_prefix_cache_in_one_insert(oxygen, arch,
                                                                          monkeypatch):  # fmt: skip
    """kv.prefix_cache: the rows that end at one step (a call's rows, threads' calls of one
    length) give their blocks to the cache in one insert_many, not one insert a row, before
    their callers wake; their tokens equal stock's, and a next turn of each finds its whole
    blocks there."""
    from oxygen_torch.kv.prefix import PrefixCache

    model = tiny(arch)
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    rows = int(torch.randint(3, 7, (1,), generator=g))
    x = torch.randint(3, 128, (rows, 40), generator=g)
    kw = dict(max_new_tokens=9, min_new_tokens=9, do_sample=False)
    with torch.no_grad():
        ref = model.generate(x, **kw)
        hf.apply(model, load_config(scheduler={"engine": True}, kv={"prefix_cache": True}))
        batches, insert_many = [], PrefixCache.insert_many

        def counted(self, items):
            batches.append(len(items))
            return insert_many(self, items)

        monkeypatch.setattr(PrefixCache, "insert_many", counted)
        got = model.generate(x, **kw)
        assert torch.equal(got, ref)
        assert batches == [rows], batches  # one insert for the call's rows, at their end
        (eng,) = engines(model)
        before = eng.snapshot()["tokens"]
        turn = torch.cat([got[:1], torch.randint(3, 128, (1, 4), generator=g)], 1)
        model.generate(turn, max_new_tokens=1, do_sample=False)
    # the first row's 49 tokens in whole 16-token blocks (48) came from the cache
    assert eng.snapshot()["tokens"] - before == turn.shape[1] - 48


@pytest.mark.parametrize("arena", [64 << 20, 8 << 20])
def test_steps_count_the_prefix_caches_blocks_only_when_free_ones_may_not_do(
    oxygen, monkeypatch, arena
):
    """kv.prefix_cache on: counting the blocks the cache would give back walks its hot nodes,
    so a step asks only when the free blocks might not cover what it can take. A roomy pool:
    never in the burst's steps; a pool of 31 blocks of 128 tokens the cache and the rows fill:
    asked, and every call still ends with stock's tokens; the cache cleared, every block is
    back."""
    from oxygen_torch.kv.prefix import PrefixCache

    model = tiny("llama")
    g = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    kws = [dict(input_ids=torch.randint(3, 128, (1 + i % 2, 100 + 5 * i), generator=g),
                max_new_tokens=30 + 9 * (i % 3), do_sample=False) for i in range(10)]  # fmt: skip
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    cfg = load_config(scheduler={"engine": True}, kv={"block_tokens": 128, "arena_bytes": arena,
                      "prefix_cache": True})  # fmt: skip
    hf.apply(model, cfg)
    for kw in kws[:3]:  # the cache holds these calls' blocks
        _generate(model, kw)
    asked, count = [], PrefixCache.reclaimable

    def counted(self):
        asked.append(1)
        return count(self)

    monkeypatch.setattr(PrefixCache, "reclaimable", counted)
    (eng,) = engines(model)
    steps = eng.snapshot()["steps"]
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    assert all(torch.equal(out[i], r) for i, r in enumerate(ref))
    steps = eng.snapshot()["steps"] - steps
    if arena == 64 << 20:
        assert not asked, (len(asked), steps)
    else:
        assert asked  # (blocks short: the cache's share counted, evicted for the rows)
    eng.kvs.pool.prefix.clear()  # the cache's blocks back: then none is held
    assert blocks_in_use() == 0


def _burst_past_the_pool(seed: int, tier: int):
    """12 calls of 1-2 rows that each end at 2 blocks a row, 36 rows' worth of 31 blocks of 128
    tokens, run at once on the engine with a CPU tier of `tier` bytes: (the engine, its
    snapshot) after checking every call's tokens equal stock's."""
    model = tiny("llama")
    g = torch.Generator().manual_seed(seed)
    kws = [dict(input_ids=torch.randint(3, 128, (1 + i % 2, 100 + 5 * i), generator=g),
                max_new_tokens=40 + 9 * (i % 3), do_sample=False) for i in range(12)]  # fmt: skip
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    cfg = load_config(scheduler={"engine": True}, kv={"block_tokens": 128, "arena_bytes": 8 << 20},
                      pool={"cpu_tier_bytes": tier})  # fmt: skip
    hf.apply(model, cfg)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    assert all(torch.equal(out[i], r) for i, r in enumerate(ref))
    (eng,) = engines(model)
    return eng, eng.snapshot()


@pytest.mark.parametrize("tier", [0, 64 << 20])
def test_a_burst_larger_than_the_kv_pool_completes_by_preemption(oxygen, tier):
    """The burst past the pool: rows are preempted (their KV to the CPU tier and back, or
    recomputed when there is none) and every call ends with stock's tokens; every block comes
    back."""
    _, st = _burst_past_the_pool(21, tier)
    assert st["preemptions"] > 0, st
    assert (st["swaps"] > 0) == bool(tier), st
    assert blocks_in_use() == 0


def test_the_first_preemption_does_not_wait_for_the_tier_to_be_made(oxygen, monkeypatch):
    """The burst past the pool with a CPU tier whose making takes 0.6 s (as pinning 4 GiB takes
    ~1.3 s on an H100, where the engine's first preemption stalled every running call that
    long): the engine's steps never wait for it (no choice of rows takes 0.3 s); the rows
    preempted before it is made are recomputed, later ones may swap; every call ends with
    stock's tokens and every block comes back. warm_up() would have made it up front
    (test_engine_warm.py)."""
    from test_kv_tier import SlowTier

    from oxygen_torch.kv import pool as pool_mod

    made = SlowTier(monkeypatch, 0.6).made
    monkeypatch.setattr(pool_mod.KVPool, "_pins", lambda self: True)
    eng, st = _burst_past_the_pool(int(torch.randint(0, 10_000, (1,))), 64 << 20)
    assert st["preemptions"] > st["swaps"], st  # (the first ones before the tier: recomputed)
    assert made == ["oxygen-cpu-tier"], made
    assert max(e[3] for e in eng.stats.timeline) < 0.3
    eng.kvs.pool.wait_tier_ahead(5)
    assert eng.kvs.pool.tier is not None
    assert blocks_in_use() == 0


def test_a_prefill_row_preempted_for_the_decodes_does_not_join_the_step(oxygen):
    """Two rows of one call that do not fit the pool together: the first decodes while the
    second's prefill waits for blocks; the first's next block preempts the second (swapped to
    the CPU tier). That row was still among the step's prefill candidates: it joined the step
    anyway, its swap-in took the block the decode had been counted, and the call failed with
    KVCacheFull (found through the server). Now it waits: the call ends with stock's tokens
    and every block comes back."""
    # 16 KV heads of 64 in float32: 4 KiB a token a layer, so the smallest arena (a 2 MiB page
    # per layer's K and V) holds 512 tokens: two rows of 280 + 30 do not fit together
    from test_hf_generate import COMMON

    torch.manual_seed(0)
    conf = {**COMMON, "num_attention_heads": 16, "num_key_value_heads": 16,
            "max_position_embeddings": 512}  # fmt: skip
    model = T.LlamaForCausalLM(T.LlamaConfig(**conf, attn_implementation="sdpa")).eval()
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 280), generator=g)
    kw = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
    cfg = load_config(scheduler={"engine": True},
                      kv={"arena_bytes": 8 << 20, "prefill_chunk_tokens": 64})  # fmt: skip
    hf.apply(model, cfg)
    with torch.no_grad():
        got = model.generate(ids, **kw)
    assert torch.equal(got, ref)
    (eng,) = engines(model)
    assert eng.snapshot()["preemptions"] > 0
    assert blocks_in_use() == 0


def test_an_error_in_a_step_reaches_only_the_call_that_fails_alone(oxygen, monkeypatch):
    """A step of several calls that raises is run again one call a step: only the call whose
    rows make it fail gets the error, the others end with stock's tokens."""
    model = tiny("llama")
    kws = [call(s) for s in range(9)]
    for kw in kws:
        kw["input_ids"] = kw["input_ids"].clamp(max=126)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, ENGINE)
    _generate(model, kws[0])  # the engine exists
    (eng,) = engines(model)
    forward = eng.runner.forward

    def marked(rows, ids, pos):
        if bool((ids == 127).any()):
            raise Boom("the marked call's rows")
        return forward(rows, ids, pos)

    monkeypatch.setattr(eng.runner, "forward", marked)
    bad = dict(input_ids=torch.tensor([[5, 127, 9, 11]]), max_new_tokens=5, do_sample=False)
    out, errors = in_threads(
        lambda i: _generate(model, bad if i == 9 else kws[i]), [(i,) for i in range(10)]
    )
    assert set(errors) == {9} and isinstance(errors[9], Boom), errors
    assert all(torch.equal(out[i], ref[i]) for i in range(9))
    assert blocks_in_use() == 0


SMALL = {"block_tokens": 256, "arena_bytes": 8 << 20}  # 15 blocks


def test_a_call_with_more_rows_than_the_pool_holds_runs_them_as_blocks_come_back(oxygen):
    """20 rows of one block each on 15 blocks, rows ending apart (an EOS): the rows wait for
    the blocks earlier rows give back; with return_dict_in_generate the call's ended rows give
    their blocks to its waiting ones, so it returns no cache (it would wait for itself)."""
    model = tiny("qwen3")
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(3, 128, (20, 9), generator=g)
    mask = torch.ones_like(ids)
    for r in range(20):
        mask[r, : r % 6] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        probe = model.generate(**kw)
    kw["eos_token_id"] = int(probe[3, 9 + 2])  # row 3 ends early, others later or never
    with torch.no_grad():
        ref = model.generate(**kw)
        hf.apply(model, load_config(scheduler={"engine": True}, kv=SMALL))
        out, errors = in_threads(
            lambda: model.generate(**kw, return_dict_in_generate=True), [()], timeout=120
        )
    assert not errors, errors
    assert torch.equal(out[0].sequences, ref) and out[0].past_key_values is None
    (pool,) = [p for p in pool_stats() if p["block_tokens"] == 256]
    assert pool["peak_blocks_used"] <= pool["blocks_total"] == 15 and pool["blocks_used"] == 0


def test_scores_of_a_call_larger_than_the_pool_are_refused_naming_the_setting(oxygen):
    model = tiny("llama")
    hf.apply(model, load_config(scheduler={"engine": True}, kv=SMALL))
    ids = torch.randint(3, 128, (20, 8))
    kw = dict(input_ids=ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True,
              output_scores=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"output_scores.*kv\.arena_bytes"), torch.no_grad():
        model.generate(**kw)
    with torch.no_grad():  # what fits runs as asked
        out = model.generate(**{**kw, "input_ids": ids[:4]})
    assert len(out.scores) == 3 and out.scores[0].shape == (4, 128)


def test_a_tasks_cancel_event_ends_its_calls_at_the_next_step(oxygen):
    """oxygen_torch.task(cancel=event): setting the event ends the call (Cancelled) with no
    streamer to raise from; its blocks come back, the other calls finish with stock's tokens."""
    model = tiny("llama")
    kws = [call(s) for s in range(4)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, ENGINE)
    stop = threading.Event()
    long = dict(input_ids=torch.tensor([[5, 9, 11]]), max_new_tokens=200, do_sample=False)

    def run(i):
        if i < 4:
            return _generate(model, kws[i])
        with oxygen_torch.task(cancel=stop):
            return _generate(model, long)

    def cancel_soon():  # once the engine has stepped 10 times (bounded: 60 s)
        for _ in range(12_000):
            eng = engines(model)
            if eng and eng[0].stats.steps >= 10:
                break
            threading.Event().wait(0.005)
        stop.set()

    helper = threading.Thread(target=cancel_soon)
    helper.start()
    out, errors = in_threads(run, [(i,) for i in range(5)])
    helper.join(30)
    assert set(errors) == {4} and isinstance(errors[4], oxygen_torch.Cancelled), errors
    assert all(torch.equal(out[i], ref[i]) for i in range(4))
    for _ in range(100):
        if blocks_in_use() == 0:
            break
        threading.Event().wait(0.02)
    assert blocks_in_use() == 0


def test_metrics_labels_are_three_classes_whatever_the_levels():
    from oxygen_torch.engine.task import parse

    labels = {parse(priority=p).priority_class
              for p in (-5, 0, 1, 2, 3, 10**6, "low", "normal", "high")}  # fmt: skip
    assert labels == {"low", "normal", "high"}


def test_a_row_larger_than_the_whole_pool_fails_clearly_and_alone(oxygen):
    """A call whose prompt and new tokens could never fit the whole KV pool gets a
    KVBudgetError naming kv.arena_bytes; a call beside it ends with stock's tokens."""
    from oxygen_torch.engine import KVBudgetError

    model = tiny("llama")
    good = call(4)
    with torch.no_grad():
        ref = model.generate(**good)
    hf.apply(model, load_config(scheduler={"engine": True}, kv=SMALL))  # 15 blocks of 256
    huge = dict(input_ids=torch.randint(3, 128, (1, 100)), max_new_tokens=4000, do_sample=False)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(huge,), (good,)])
    assert set(errors) == {0} and isinstance(errors[0], KVBudgetError), errors
    assert "kv.arena_bytes" in str(errors[0]) and "15" in str(errors[0])
    assert torch.equal(out[1], ref)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_bursts_on_window_models_never_reach_a_caller_as_kv_full(oxygen, arch):
    """Three bursts of 10 calls on a sliding-window (Mistral) and a hybrid (Gemma3) model, more
    KV than the 15-block pool: every call ends with stock's tokens, none sees KVCacheFull (the
    engine admits and preempts every row)."""
    model = tiny(arch)
    g = torch.Generator().manual_seed(33)
    bursts = [[dict(input_ids=torch.randint(3, 128, (1 + i % 2, 230 + 7 * i), generator=g),
                    max_new_tokens=30 + 5 * (i % 4), do_sample=False) for i in range(10)]
              for _ in range(3)]  # fmt: skip
    with torch.no_grad():
        refs = [[model.generate(**kw) for kw in kws] for kws in bursts]
    cfg = load_config(scheduler={"engine": True}, kv=SMALL, pool={"cpu_tier_bytes": 0})
    hf.apply(model, cfg)
    for kws, ref in zip(bursts, refs):
        out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
        assert not errors, errors
        assert all(torch.equal(out[i], r) for i, r in enumerate(ref))
    assert blocks_in_use() == 0
    (eng,) = engines(model)
    assert eng.snapshot()["preemptions"] > 0 or arch == "mistral"  # (Mistral's window frees)


def test_disable_while_engine_calls_run_ends_them_clearly(oxygen):
    """disable() while calls wait on the engine: each call finishes with stock's tokens or
    raises one RuntimeError naming disable(); no call hangs, no block stays used."""
    model = tiny("llama")
    kws = [dict(input_ids=torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(s)),
                max_new_tokens=60, do_sample=False) for s in range(6)]  # fmt: skip
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, ENGINE)
    _generate(model, call(0))  # the engine exists
    (eng,) = engines(model)
    base = eng.stats.steps

    def disable_soon():
        for _ in range(12_000):  # once the calls have stepped a little (bounded: 60 s)
            if eng.stats.steps >= base + 8 and eng.running:
                break
            threading.Event().wait(0.005)
        hf.disable_hf()  # (what oxygen_torch.disable() runs for transformers)

    helper = threading.Thread(target=disable_soon)
    helper.start()
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws], timeout=120)
    helper.join(60)
    for i in range(len(kws)):
        if i in errors:
            assert isinstance(errors[i], RuntimeError) and "disable()" in str(errors[i])
        else:
            assert torch.equal(out[i], ref[i])
    assert errors  # (60 tokens each: the disable came while they ran)
    assert blocks_in_use() == 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(do_sample=True, temperature=0.0),
        dict(repetition_penalty=0.0),
        dict(do_sample=True, top_p=1.5),
    ],  # fmt: skip
)
def test_settings_the_engine_refuses_behave_as_stock(oxygen, bad):
    """Values the engine does not take (temperature 0 with sampling, a penalty of 0, top_k < 0)
    run stock's own loop after enable(): stock's error, word for word, or stock's tokens from
    the same global seed; never a run with a value taken for another."""
    model = tiny("llama")
    kw = dict(input_ids=torch.randint(3, 128, (1, 5)), max_new_tokens=3, **bad)

    def outcome():
        torch.manual_seed(11)
        try:
            with torch.no_grad():
                return model.generate(**kw)
        except ValueError as err:
            return str(err)

    stock = outcome()
    hf.apply(model, ENGINE)
    ours = outcome()
    assert ours == stock if isinstance(stock, str) else torch.equal(ours, stock)


def test_a_model_that_goes_takes_its_engine_thread_and_kv_pool_with_it(oxygen):
    """The engine holds its model weakly but its KV pool strongly: once the model is collected
    its thread ends (not STOP_AFTER_IDLE_S later) and release_pools() frees the pool."""
    import gc

    from oxygen_torch.kv import pool as kv_pool
    from oxygen_torch.kv.pool import release_pools

    model = tiny("qwen3")
    hf.apply(model, ENGINE)
    _generate(model, call(5))
    (eng,) = engines(model)
    thread = eng._thread
    assert thread is not None and thread.is_alive()
    del model, eng
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()
    gc.collect()
    release_pools()
    assert pool_stats() == [] and len(kv_pool._open) == 0
    # a later model of the same shape gets a fresh pool and engine, and the right tokens
    again = tiny("qwen3")
    with torch.no_grad():
        ref = again.generate(**call(5))
    hf.apply(again, ENGINE)
    assert torch.equal(_generate(again, call(5)), ref)


def test_a_lower_stream_is_woken_less_while_a_higher_call_is_live(oxygen, monkeypatch):
    """scheduler.lower_stream_interval_ms 100: while a high-priority call streams, a
    low-priority one's caller is woken at most every 100 ms (the steps' tokens together, in
    order), the high one's every step; both get stock's tokens."""
    import time

    model = tiny("llama")
    kws = {p: dict(input_ids=torch.randint(3, 128, (1, 5 + i)), max_new_tokens=96,
                   do_sample=False) for i, p in enumerate(("high", "low"))}  # fmt: skip
    with torch.no_grad():
        ref = {p: model.generate(**kw) for p, kw in kws.items()}
    hf.apply(model, load_config(scheduler={"engine": True, "lower_stream_interval_ms": 100}))
    _generate(model, dict(kws["high"], max_new_tokens=2))  # (the engine made)
    wakes, stream = {}, front._stream  # streamer -> [(when, columns put)]

    def looked(streamer, group, pad, sent, final=False):
        upto = stream(streamer, group, pad, sent, final)
        if upto > sent:
            wakes.setdefault(id(streamer), []).append((time.monotonic(), upto - sent))
        return upto

    monkeypatch.setattr(front, "_stream", looked)
    rec = {p: Recorder() for p in kws}

    def run(p):
        with oxygen_torch.task(priority=p):
            return _generate(model, dict(kws[p], streamer=rec[p]))

    out, errors = in_threads(run, [("high",), ("low",)])
    assert not errors, errors
    for i, (p, kw) in enumerate(kws.items()):
        got = out[i]
        assert torch.equal(got, ref[p])
        steps = torch.stack([x.view(-1) for x in rec[p].puts[1:]], 1)
        assert torch.equal(steps, got[:, kw["input_ids"].shape[1] :])
    high, low = wakes[id(rec["high"])], wakes[id(rec["low"])]
    assert sum(n for _, n in high) == sum(n for _, n in low) == 96
    # the high call's end (its last wake): the low one's wakes before it are >= 100 ms apart
    # (the delivery that ends the high call wakes the low one at once: 30 ms of margin)
    end = high[-1][0]
    gaps = [b[0] - a[0] for a, b in zip(low[1:], low[2:]) if b[0] < end - 0.03]
    assert all(g > 0.09 for g in gaps), gaps
    during = [w for w in low if w[0] < end]
    assert len(high) > 2 * len(during), (len(high), len(during))


def test_a_stream_is_woken_at_most_every_stream_interval_ms(oxygen, monkeypatch):
    """scheduler.stream_interval_ms 80: a streaming call's first token comes at once (a wake
    of its own), later ones in wakes about 80 ms apart, each holding the steps since the last
    (one put a step, in order); the tokens are stock's, and the end comes with the last."""
    import time

    model = tiny("llama")
    ids = torch.randint(3, 128, (2, 6))
    kw = dict(input_ids=ids, max_new_tokens=48, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**kw)
    hf.apply(model, load_config(scheduler={"engine": True, "stream_interval_ms": 80}))
    _generate(model, dict(kw, max_new_tokens=2))  # (the engine made: its first steps' costs)
    wakes, stream = [], front._stream  # wakes: (when, columns put) of each look at the tokens

    def looked(streamer, group, pad, sent, final=False):
        upto = stream(streamer, group, pad, sent, final)
        if upto > sent:
            wakes.append((time.monotonic(), upto - sent))
        return upto

    monkeypatch.setattr(front, "_stream", looked)
    rec = Recorder()
    began = time.monotonic()
    out = _generate(model, dict(kw, streamer=rec))
    took = time.monotonic() - began
    assert torch.equal(out, ref)
    assert rec.ended and torch.equal(rec.puts[0], ids)
    assert torch.equal(torch.stack([p.view(-1) for p in rec.puts[1:]], 1), out[:, 6:])
    sizes = [n for _, n in wakes]
    # the first token: at once (the caller may wake a step or two after it on a loaded machine;
    # an 80 ms wait would hold ~36 of this tiny model's steps)
    assert sizes[0] <= 4, sizes
    assert len(wakes) >= 2 and sum(sizes) == 48
    assert len(wakes) <= 2 + took / 0.08, (sizes, took)  # (each wake after the first: 80 ms on)
    gaps = sorted(b[0] - a[0] for a, b in zip(wakes, wakes[1:]))
    assert gaps[len(gaps) // 2] > 0.06, gaps  # (a late wake shortens the gap after it)


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_fresh_prompts_attend_their_own_kv_in_the_engine(oxygen, arch, monkeypatch):
    """kv.fresh_prefill in the engine: a step of fresh prompts only (a batch with left padding:
    runs of equal and unequal lengths once packed) attends its own K/V under "dense" and reads
    the blocks under "paged"; tokens and logits agree with each other and with stock, and the
    counts say which path each layer's prefill took. A step with a cached prefix (prompts cut
    over steps of 32 tokens: a row's later chunk) stays paged under either. Under "auto" the
    rule is told the step's shortest row and its runs of one length (the SDPA calls a layer)."""
    from oxygen_torch.kv import fresh

    asked, choose = [], fresh.choose

    def told(setting, **kw):
        asked.append((setting, kw["columns"], kw["runs"]))
        return choose(setting, **kw)

    monkeypatch.setattr(fresh, "choose", told)
    model = tiny(arch, seed=5)
    g = torch.Generator().manual_seed(int(torch.randint(0, 10_000, (1,))))
    ids = torch.randint(3, 128, (4, 21), generator=g)
    mask = torch.ones_like(ids)
    for r, pad in enumerate((0, 6, 6, 2)):  # packed rows of 21, 15, 15, 19 tokens
        mask[r, :pad] = 0
        ids[r, :pad] = 0
    kw = dict(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=5,
              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        ref = model.generate(**kw)
        got = {}
        for setting in ("dense", "paged"):
            hf.apply(model, load_config(scheduler={"engine": True}, fresh_prefill=setting))
            oxygen_torch.compile.reset_stats()
            got[setting] = model.generate(**kw)
            paths = oxygen_torch.compile.stats()["prefill_attention"]
            assert paths == {
                "dense": layers if setting == "dense" else 0,
                "paged": 0 if setting == "dense" else layers,
                "why": {f"kv.fresh_prefill={setting}": layers},
            }, paths
            hf.apply(model, load_config(scheduler={"engine": True, "max_step_tokens": 32},
                                        fresh_prefill=setting))  # fmt: skip
            oxygen_torch.compile.reset_stats()
            chunked = model.generate(**kw)
            paths = oxygen_torch.compile.stats()["prefill_attention"]
            assert paths["why"].get("cached prefix", 0) >= layers, paths
            assert torch.equal(chunked.sequences, ref.sequences)
        hf.apply(model, load_config(scheduler={"engine": True}, fresh_prefill="auto"))
        asked.clear()
        got["auto"] = model.generate(**kw)  # (CPU: auto's table takes dense)
        assert asked and set(asked) == {("auto", 15, 3)}, asked  # rows 21, 15, 15, 19
    for setting, out in got.items():
        assert torch.equal(out.sequences, ref.sequences), setting
        for a, r in zip(out.logits, ref.logits):
            assert (a - r).abs().max() / r.abs().max() < 1e-5, setting
