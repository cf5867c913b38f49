"""The interpreter's collection pauses as the engine sees them (engine/gc_watch.py): counted in
engine_stats() and in each step's timeline entry; scheduler.gc_freeze freezes the heap once."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import torch
from test_engine_loop import ENGINE, call, engines
from test_hf_generate import tiny

import oxygen_torch
from oxygen_torch.engine import gc_watch
from oxygen_torch.integrations.hf import integration as hf


def test_a_collection_during_a_step_is_counted_in_its_entry_and_in_engine_stats(oxygen):
    model = tiny("llama")
    kw = call(3)
    with torch.no_grad():
        ref = model.generate(**kw)
    hf.apply(model, ENGINE)
    with torch.no_grad():
        model.generate(**call(1))  # (the engine exists)
    (eng,) = engines(model)
    forward, collected = eng.runner.forward, []

    def forward_that_collects(rows, ids, pos):
        if not collected:
            collected.append(gc.collect())  # a full collection inside the step's launch
        return forward(rows, ids, pos)

    eng.runner.forward = forward_that_collects
    before = oxygen_torch.engine_stats(model)
    n = len(eng.stats.timeline)
    with torch.no_grad():
        got = model.generate(**kw)
    after = oxygen_torch.engine_stats(model)
    assert torch.equal(got, ref)
    assert after["gc_full"] >= before["gc_full"] + 1
    assert after["gc_s"] > before["gc_s"]
    entries = list(eng.stats.timeline)[n:]
    assert len(entries[0]) == 15 and entries[0][9] > 0  # the collecting step's pause
    assert entries[0][9] <= after["gc_s"] - before["gc_s"] + 1e-9


def test_freeze_once_collects_then_freezes_the_heap_once_per_process():
    # in a process of its own: a freeze lasts for the process
    code = textwrap.dedent(
        """
        import gc
        from oxygen_torch.engine import gc_watch
        gc_watch.install()
        class Node:  # cyclic garbage made before the freeze is collected, not frozen
            pass
        a, b = Node(), Node()
        a.b, b.a = b, a
        del a, b
        keep = [[i] for i in range(1000)]  # live objects: frozen
        assert gc.get_freeze_count() == 0
        assert gc_watch.freeze_once() is True
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen
        assert not any(type(o).__name__ == "Node" for o in gc.get_objects())
        assert gc_watch.freeze_once() is False and gc.get_freeze_count() == frozen
        assert gc_watch.full >= 1  # the freeze's own collection was counted
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_refreeze_after_a_compile_freezes_what_was_made_since_once_frozen():
    # in a process of its own: a freeze lasts for the process
    code = textwrap.dedent(
        """
        import gc
        from oxygen_torch.engine import gc_watch
        gc_watch.install()
        assert gc_watch.refreeze("a compile") is False  # never frozen: nothing done
        assert gc.get_freeze_count() == 0
        assert gc_watch.freeze_once() is True
        frozen = gc.get_freeze_count()
        class Node:
            pass
        a, b = Node(), Node()  # cyclic garbage made since the freeze: collected, not frozen
        a.b, b.a = b, a
        del a, b
        made = [[i] for i in range(5000)]  # a compile's long-lived objects: frozen
        assert gc_watch.refreeze("a compile") is True
        assert gc.get_freeze_count() >= frozen + 5000, (gc.get_freeze_count(), frozen)
        live = {id(o) for o in gc.get_objects()}
        assert not any(id(x) in live for x in made[:100])
        assert not any(type(o).__name__ == "Node" for o in gc.get_objects())
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_an_engine_on_the_cpu_does_not_freeze(oxygen, monkeypatch):
    calls = []
    monkeypatch.setattr(gc_watch, "freeze_once", lambda: calls.append(1))
    model = hf.apply(tiny("qwen3"), ENGINE)
    with torch.no_grad():
        model.generate(**call(2))
    assert engines(model) and not calls


def test_collection_pauses_are_served_as_counters(oxygen):
    from prometheus_client.parser import text_string_to_metric_families

    from oxygen_torch.tools import metrics

    model = hf.apply(tiny("llama"), ENGINE)
    with torch.no_grad():
        model.generate(**call(1))  # (an engine, so the watch is on)

    def read():
        fams = {f.name: f for f in text_string_to_metric_families(metrics.scrape())}
        return {n: fams[n].samples[0].value for n in ("oxygen:gc_pause_seconds",
                                                      "oxygen:gc_full_collections")}  # fmt: skip

    before = read()
    gc.collect()
    after = read()
    assert after["oxygen:gc_full_collections"] == before["oxygen:gc_full_collections"] + 1
    assert after["oxygen:gc_pause_seconds"] > before["oxygen:gc_pause_seconds"]
