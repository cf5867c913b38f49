"""The multi-task engine's merged decode steps through graphs by batch-size bucket, on CPU.

There is no CUDA graph on CPU: with kv.cpu_decode_graphs=rerun the runner's stand-in "replays"
by running the captured forward again on the graph's static buffers, so what these tests check is
the bookkeeping a replay depends on: the packed step copied into the buffers (tables, lengths,
slots, positions, ids), the padding rows of a bucket kept out of every call's KV, the logits
handed back row by row, and each core left as its eager step leaves it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_engine import call_kw, generate, in_threads, llama, prompt, schedulers, together_as_alone
from test_hf_generate import tiny

import oxygen_torch
from oxygen_torch import _patching
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf import merged_graphs

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call

RERUN = {"cpu_decode_graphs": "rerun"}  # decode steps on CPU through the graph path's stand-in
ON = dict(kv=RERUN, scheduler={"decode_graphs": True, "gather_ms": 50})


@pytest.fixture
def rerun():
    """A test whose configurations take the decode-graph path on CPU (RERUN, ON): warnings said
    once are said again for it, and its models get stock attention back afterwards."""
    _patching.forget_warnings()
    yield
    hf.disable_hf()


def test_buckets_cover_every_batch_and_grow_in_steps():
    got = [merged_graphs.bucket(r) for r in range(1, 700)]
    assert all(b >= r for r, b in zip(range(1, 700), got))
    assert got == sorted(got)
    assert {merged_graphs.bucket(r) for r in range(1, 257)} == set(merged_graphs.BUCKETS)
    assert merged_graphs.bucket(257) == 320 and merged_graphs.bucket(640) == 640


def logits_as_alone(model, kws: list[dict]) -> None:
    """Each call alone, then all at once: the same tokens and (to float32 rounding: the packing
    changes reduction orders) the same logits at every step."""
    kws = [dict(kw, return_dict_in_generate=True, output_logits=True) for kw in kws]
    ref = [generate(model, kw) for kw in kws]
    out, errors = in_threads(lambda kw: generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    for i, r in enumerate(ref):
        assert torch.equal(out[i].sequences, r.sequences), f"call {i}"
        for a, b in zip(out[i].logits, r.logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_merged_decode_steps_replay_graphs_and_give_the_logits_of_each_call_alone(rerun, arch):
    model = hf.apply(llama(seed=4, arch=arch), load_config(**ON))
    calls = [call_kw(s) for s in (0, 1, 2, 5, 6, 7)]  # 1-3 rows, beams, an early stop
    logits_as_alone(model, calls)
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    assert st["captures"] >= 1 and st["replays"] >= 1, st
    assert st["failed"] == 0
    assert max(schedulers(model)[0].stats.batch_sizes) > 3


@pytest.mark.parametrize("after", [0, 10_000])
def test_a_bucket_not_captured_replays_a_larger_graph_with_padding(rerun, monkeypatch, after):
    """Calls of 1-3 rows finishing one after the other pass through smaller rows buckets: with
    CAPTURE_AFTER large they replay the captured larger graph (padding rows and a wider table
    kept out of every call), with 0 each bucket gets its own; the logits are each call's alone
    either way."""
    monkeypatch.setattr(merged_graphs, "CAPTURE_AFTER", after)
    model = hf.apply(llama(seed=7), load_config(**ON))
    calls = [call_kw(s) for s in (0, 1, 2, 5)]
    for kw, n in zip(calls, (3, 9, 15, 21)):
        kw["max_new_tokens"] = kw["min_new_tokens"] = n  # ends apart: the rows fall by steps
    logits_as_alone(model, calls)
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    assert st["replays"] >= 1 and st["failed"] == 0, st
    if after:
        assert st["padded"] >= 1 and st["captures"] < len(merged_graphs.BUCKETS), st
    else:
        assert st["padded"] == 0, st


class _Pool:
    """What a graph keeps of a step's KV pool: its device (and a weak reference to it)."""

    def __init__(self):
        self.key = SimpleNamespace(device=torch.device("cpu"))


_CORE = _Pool()  # (a step's cores: the fingerprint is checked once per set of them)


def _step(pool):
    """A reserved step on `pool`, as MergedGraphs.pick reads one."""
    return SimpleNamespace(pool=pool, precision=None, tiles=None, cores=[_CORE])


def _picks(graphs, model, pool, asks):
    """(rows, width) of the graph each (rows, width) ask replays; each new graph counts as
    captured at once (its runner set: the later asks may replay it)."""
    step = _step(pool)
    got = []
    for rows, width in asks:
        g = graphs.pick(model, step, width, rows)
        g.runner = g.runner or object()
        got.append((g.rows, g.width))
    return got


@pytest.mark.parametrize("after", [3, 5])
def test_table_widths_never_capture_alone_and_rows_buckets_pad_until_asked_enough(
    monkeypatch, after
):
    """The merged graphs' choice (MergedGraphs.pick), on a model and pools stood in for: an
    ask with a table narrower than a graph of its rows bucket replays that graph at once; a new
    capture is as wide as the widest graph of its pool so far; a rows bucket with a larger
    graph replays it (the smallest that holds it, rows x width) until asked for more than
    CAPTURE_AFTER times, then gets its own. Another pool's graphs are neither replayed nor
    widened to. A capture that failed at the widened width is not tried again."""
    monkeypatch.setattr(merged_graphs, "CAPTURE_AFTER", after)
    model, graphs = torch.nn.Linear(4, 4), merged_graphs.MergedGraphs(max_graphs=16)
    pool, other = _Pool(), _Pool()
    w = merged_graphs.graphs.WIDTH_STEP
    got = _picks(graphs, model, pool, [(5, w), (5, 4 * w), (6, 2 * w), (7, w)])
    assert got == [(8, w), (8, 4 * w), (8, 4 * w), (8, w)]  # (the last: its own)
    assert graphs.captures == 0 and len(graphs.graphs) == 2  # (captures: play's)
    got = _picks(graphs, model, pool, [(3, 2 * w)] * (after + 1))
    assert got == [(8, 4 * w)] * after + [(4, 4 * w)]  # its own after `after` padded asks
    # the smallest that holds it (rows x width), and a wider one of its own rows bucket
    assert _picks(graphs, model, pool, [(2, w), (4, w)]) == [(8, w), (4, 4 * w)]
    assert graphs.padded == 1 + after + 2
    assert _picks(graphs, model, other, [(3, w), (3, 2 * w)]) == [(4, w), (4, 2 * w)]
    # a rows bucket whose capture at the widened width failed runs eagerly (None), not again
    graphs.failed.add((16, 4 * w, id(pool)))
    assert graphs.pick(model, _step(pool), w, 13) is None
    assert (16, 4 * w, id(pool)) not in graphs.graphs


def test_sliding_window_calls_replay_merged_graphs(rerun):
    model = hf.apply(tiny("mistral"), load_config(**ON))
    kws = []
    for s in range(3):
        ids, mask = prompt(60 + s, rows=2, length=11 + 3 * s)
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False))
    together_as_alone(model, kws, "mistral")
    assert oxygen_torch.decode_graph_stats(model)["merged"]["replays"] >= 1


def failing_capture(real):
    """A GraphRunner class whose warm-up runs and whose capture raises, as an op that may not
    be captured does."""

    class Failing(real):
        def __init__(self, fn, *a, **kw):
            warm = []

            def step(*args):
                if not warm:
                    warm.append(1)
                    return fn(*args)
                raise RuntimeError("operation not permitted when stream is capturing")

            super().__init__(step, *a, **kw)

    return Failing


def test_off_by_default_and_a_failed_capture_runs_eagerly_with_one_warning(rerun, monkeypatch):
    model = hf.apply(llama(seed=5), load_config(kv=RERUN))
    together_as_alone(model, [call_kw(s) for s in range(3)])
    assert (
        oxygen_torch.decode_graph_stats(model)["merged"]["captures"] == 0
    )  # scheduler.decode_graphs is off

    model = hf.apply(llama(seed=6), load_config(**ON))
    # the merged graphs' runner only (single calls keep theirs)
    monkeypatch.setattr(merged_graphs, "GraphRunner", failing_capture(merged_graphs.GraphRunner))
    seen = []
    monkeypatch.setattr(_patching, "warn_once", lambda msg: seen.append(msg))
    together_as_alone(model, [call_kw(s) for s in range(3)])
    st = oxygen_torch.decode_graph_stats(model)["merged"]
    assert st["failed"] >= 1 and st["replays"] == 0
    assert sum("merged decode CUDA-graph capture failed" in m for m in seen) >= 1
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_the_weights_fingerprint_names_every_tensor_and_sees_one_replaced(arch):
    """graphs._fingerprint (checked at each change of the engine's rows: a graph captured on
    moved weights is stale) holds the address of every parameter and buffer, and changes when
    one parameter, one buffer or one submodule is replaced; it stays put otherwise."""
    from oxygen_torch.integrations.hf.graphs import _fingerprint

    model = tiny(arch, seed=int(torch.randint(0, 1000, ())))
    fp = _fingerprint(model)
    assert set(fp) == {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert _fingerprint(model) == fp
    with torch.no_grad():  # written in place: the same addresses
        next(model.parameters()).add_(1.0)
    assert _fingerprint(model) == fp
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    lin = layers[int(torch.randint(0, len(layers), ()))]
    old = lin.weight
    lin.weight = torch.nn.Parameter(old.detach().clone())
    assert _fingerprint(model) != fp
    lin.weight = old
    assert _fingerprint(model) == fp
    holder = next(m for m in model.modules() if m._buffers)
    name = next(iter(holder._buffers))
    buf = holder._buffers[name]
    holder._buffers[name] = buf.clone()
    assert _fingerprint(model) != fp
    holder._buffers[name] = buf
    parent = next(m for m in model.modules() if any(c is lin for c in m._modules.values()))
    key = next(k for k, c in parent._modules.items() if c is lin)
    parent._modules[key] = torch.nn.Linear(lin.in_features, lin.out_features, bias=False)
    assert _fingerprint(model) != fp
