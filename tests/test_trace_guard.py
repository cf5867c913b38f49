"""Our compiles and the engines' steps are kept apart (integrations/hf/trace_guard.py): while
torch.compile traces, torch.fx patches torch.nn.Module.__call__ for the whole process, and an
engine step on another thread was traced into the compile and failed (found on the H200)."""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch
from test_engine_loop import call, engines
from test_hf_generate import tiny

from oxygen_torch import context
from oxygen_torch.compile import backend as backend_mod
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import graphs as hf_graphs
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf.trace_guard import TraceGuard
from oxygen_torch.kv import pool_stats


def _started(target) -> threading.Thread:
    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def test_a_compile_waits_for_the_steps_in_flight_and_new_steps_wait_for_it():
    guard, log = TraceGuard(), []
    in_step, release = threading.Event(), threading.Event()

    def step():
        with guard.step():
            in_step.set()
            release.wait(5)
            log.append("step ends")

    def compile_():
        with guard.compile():
            log.append("compile")
            time.sleep(0.05)
            log.append("compile ends")

    def late_step():
        with guard.step():
            log.append("late step")

    first = _started(step)
    assert in_step.wait(5)
    comp = _started(compile_)
    time.sleep(0.05)  # the compile waits for the step in flight ...
    late = _started(late_step)
    time.sleep(0.05)  # ... and a step that comes now waits behind the waiting compile
    assert log == []
    release.set()
    for t in (first, comp, late):
        t.join(5)
    assert log == ["step ends", "compile", "compile ends", "late step"]


def test_steps_share_the_guard_and_a_compile_nests_on_its_thread():
    guard = TraceGuard()
    inside = threading.Barrier(3, timeout=5)

    def step():
        with guard.step():
            inside.wait()  # all three steps at once, or the barrier breaks

    threads = [_started(step) for _ in range(3)]
    for t in threads:
        t.join(5)
    assert not inside.broken
    with guard.compile(), guard.compile(), guard.step():  # its own warm-up's steps pass
        pass
    with guard.step():  # released: steps run again
        pass


def test_a_compile_inside_a_step_is_an_error_not_a_deadlock():
    guard = TraceGuard()
    with guard.step(), pytest.raises(RuntimeError, match="compile inside an engine step"):
        with guard.compile():
            pass
    with guard.compile():  # nothing left held
        pass


def test_tracing_stays_on_while_any_thread_is_inside_it():
    """context.TRACING (which compiled decode steps guard on) is True while any thread is inside
    context.tracing(), whichever order they leave in. Each thread once saved and restored it:
    a thread that left cleared it under another thread's replay, whose guard failed, and the
    recompile without it raised in PagedKVCache.update (CI: "Observed exception", an engine's
    calls failed beside a per-call compile)."""
    entered = [threading.Event() for _ in range(2)]
    leave = [threading.Event() for _ in range(2)]
    seen = {}

    def inside(i):
        with context.tracing():
            entered[i].set()
            leave[i].wait(5)
            seen[i] = context.TRACING

    order = [0, 1] if torch.rand(()) < 0.5 else [1, 0]  # who enters first
    threads = []
    for i in order:
        threads.append(_started(lambda i=i: inside(i)))
        assert entered[i].wait(5)
    first, second = order
    leave[first].set()  # the first in leaves first: the second is still inside
    threads[0].join(5)
    assert context.TRACING
    leave[second].set()
    threads[1].join(5)
    assert seen == {first: True, second: True}
    assert not context.TRACING
    with context.tracing(), context.tracing():  # nested on one thread
        assert context.TRACING
    assert not context.TRACING


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_while_another_thread_traces_is_not_tracing():
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with context.tracing():
            inside.set()
            leave.wait(5)

    t = _started(hold)
    assert inside.wait(5)
    pid = os.fork()
    if pid == 0:  # the child: the tracing thread is not here
        code = 0 if not context.TRACING else 1
        with context.tracing():
            code |= 0 if context.TRACING else 2
        code |= 0 if not context.TRACING else 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert context.TRACING  # the parent's thread is still inside
    leave.set()
    t.join(5)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not context.TRACING


@pytest.fixture
def traced_compile(fresh_compile, monkeypatch):
    """Backend "oxygen" runs its rewritten graph as traced (no Inductor C++ build on CI)."""
    monkeypatch.setattr(backend_mod, "final_compiler", lambda gm, example, patches: gm)


def test_engine_steps_beside_a_decode_graph_compile_on_another_thread(oxygen, traced_compile):
    """One thread keeps the engine stepping while another generate() (a cache passed in: the
    per-call path) compiles its decode graph by backend "oxygen"; the engine's calls and the
    compiled call all equal stock."""
    model = tiny("llama")
    kw = call(4)
    more = dict(max_new_tokens=6, do_sample=False)
    busy = [call(s) for s in range(20, 26)]
    with torch.no_grad():
        first = model.generate(**kw, return_dict_in_generate=True)
        grown = first.sequences[:, kw["input_ids"].shape[1] :]
        mask = torch.cat([kw["attention_mask"], torch.ones_like(grown)], dim=1)
        ref = model.generate(first.sequences, attention_mask=mask,
                             past_key_values=first.past_key_values, **more)  # fmt: skip
        busy_ref = [model.generate(**b) for b in busy]
    cfg = load_config(scheduler={"engine": True}, kv={"cpu_decode_graphs": "fuse"})
    hf.apply(model, cfg)
    stop, errors, wrong, done = threading.Event(), [], [], [0]

    def keep_busy():
        i = 0
        while not stop.is_set():
            try:
                with torch.no_grad():
                    got = model.generate(**busy[i % len(busy)])
            except Exception as err:  # noqa: BLE001 - the test's finding
                errors.append(err)
                return
            if not torch.equal(got, busy_ref[i % len(busy)]):
                wrong.append(i)
            i, done[0] = i + 1, done[0] + 1

    t = _started(keep_busy)
    try:
        with torch.no_grad():
            out = model.generate(**kw, return_dict_in_generate=True)
            got = model.generate(out.sequences, attention_mask=mask,
                                 past_key_values=out.past_key_values, **more)  # fmt: skip
        deadline = time.monotonic() + 10
        while done[0] < 3 and not errors and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert not wrong and done[0] >= 3, (wrong, done)
    assert torch.equal(got, ref)
    assert hf_graphs.stats(model)["compiled"] == 1
    assert engines(model) and engines(model)[0].snapshot()["steps"] > 0
    del out
    gc.collect()
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


@pytest.mark.parametrize("path", ["engine", "per_call"])
def test_a_compile_on_another_thread_leaves_the_paged_forwards_eager(oxygen, path):
    """While another thread is inside a torch.compile (torch >= 2.13 holds
    torch.compiler.is_compiling() True for every thread through it) and inside our tracing
    mark, generate() on the paged cache, through the engine or per call (a cache passed in),
    runs eagerly and equals stock (found in CI: a per-call forward took the compiled branch
    and failed)."""
    model = tiny("llama")
    c = call(int(torch.randint(0, 1000, ()).item()))
    kw = dict(input_ids=c["input_ids"], attention_mask=c["attention_mask"], do_sample=False)
    with torch.no_grad():
        first = model.generate(**kw, max_new_tokens=3, return_dict_in_generate=True)
        grown = first.sequences[:, kw["input_ids"].shape[1] :]
        mask = torch.cat([kw["attention_mask"], torch.ones_like(grown)], dim=1)
        on = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
        if path == "per_call":  # stock goes on from its own cache
            on["past_key_values"] = first.past_key_values
        ref = model.generate(first.sequences, **on)
    hf.apply(model, load_config(scheduler={"engine": path == "engine"}))
    with torch.no_grad():  # (per call: the paged cache to go on from)
        out = model.generate(**kw, max_new_tokens=3, return_dict_in_generate=True)
    assert torch.equal(out.sequences, first.sequences)
    if path == "per_call":
        on["past_key_values"] = out.past_key_values
    in_compile, release = threading.Event(), threading.Event()

    def held_backend(gm, example):
        in_compile.set()
        release.wait(60)
        return gm

    def compile_elsewhere():
        with context.tracing():
            torch.compile(lambda x: x * 2, backend=held_backend, dynamic=False)(torch.ones(3))

    t = _started(compile_elsewhere)
    try:
        assert in_compile.wait(60)
        with torch.no_grad():
            got = model.generate(first.sequences, **on)
    finally:
        release.set()
        t.join(60)
    assert torch.equal(got, ref)
