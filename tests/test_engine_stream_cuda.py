"""scheduler.engine_stream: the engine's steps on a CUDA stream of their own (kv/engine_streams.py).
Concurrent calls equal stock, the output cache continues as stock's does, a call on the
per-call path shares the KV pool with the engine, and a caller's device read no longer waits for
the steps the engine has queued."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_engine import in_threads
from test_engine_loop import call, engines
from test_engine_loop_cuda import _generate
from test_hf_generate import tiny

from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import engine_streams, pool_stats

pytestmark = pytest.mark.cuda
STREAM = load_config(
    scheduler={"engine": True, "decode_graphs": True, "engine_stream": True},
    kv={"debug_checks": False},
)


def _cuda(kw):
    kw = dict(kw)
    kw["input_ids"], kw["attention_mask"] = kw["input_ids"].cuda(), kw["attention_mask"].cuda()
    return kw


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_calls_on_an_engine_stream_equal_stock(oxygen, arch):
    model = tiny(arch).cuda()
    kws = [_cuda(call(s)) for s in range(12)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, STREAM)
    out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
    assert not errors, errors
    agree = [float((out[i] == r).float().mean()) if out[i].shape == r.shape else 0.0
             for i, r in enumerate(ref)]  # fmt: skip
    assert sum(agree) / len(agree) >= 0.98, agree
    (eng,) = engines(model)
    assert eng.snapshot()["steps"] > 0
    assert engine_streams.any_for(torch.device("cuda", torch.cuda.current_device()))
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


def test_the_output_cache_continues_on_the_callers_stream_as_stocks_does(oxygen):
    """return_dict_in_generate: the call's cache (blocks the engine's stream wrote) goes on
    in a second generate() (the per-call path: a cache passed in) from the caller's stream,
    while other calls keep the engine busy; tokens equal stock's two calls."""
    model = tiny("llama").cuda()
    kw = _cuda(call(4))
    more = dict(max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        first = model.generate(**kw, return_dict_in_generate=True)
        mask = torch.cat([kw["attention_mask"], torch.ones_like(first.sequences[:, kw[
            "input_ids"].shape[1]:])], dim=1)  # fmt: skip
        ref = model.generate(first.sequences, attention_mask=mask,
                             past_key_values=first.past_key_values, **more)  # fmt: skip
    hf.apply(model, STREAM)
    busy = [_cuda(call(s)) for s in range(20, 28)]
    stop = threading.Event()

    def keep_busy():
        while not stop.is_set():
            _generate(model, busy[int(time.monotonic() * 1e3) % len(busy)])

    t = threading.Thread(target=keep_busy)
    t.start()
    try:
        with torch.no_grad():
            out = model.generate(**kw, return_dict_in_generate=True)
            got = model.generate(out.sequences, attention_mask=mask,
                                 past_key_values=out.past_key_values, **more)  # fmt: skip
    finally:
        stop.set()
        t.join(60)
    assert torch.equal(out.sequences, first.sequences)
    assert torch.equal(got, ref)


def test_a_callers_device_read_does_not_wait_for_the_engines_queued_step(oxygen, monkeypatch):
    """A step made slow on the GPU (a 0.5 s spin queued by the forward): on the engine's own
    stream a caller's copy to the host returns long before the step ends; the step's call still
    gets its tokens."""
    model = tiny("llama").cuda()
    hf.apply(model, STREAM)
    _generate(model, _cuda(call(1)))  # (the engine and its stream exist)
    (eng,) = engines(model)
    forward = eng.runner.forward
    slow = threading.Event()

    def slow_forward(rows, ids, pos):
        out = forward(rows, ids, pos)
        if not slow.is_set():
            slow.set()
            torch.cuda._sleep(int(0.5 * 1.5e9))  # ~0.5 s at ~1.5 GHz, on the engine's stream
        return out

    monkeypatch.setattr(eng.runner, "forward", slow_forward)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("out", _generate(model, _cuda(call(2)))))
    t.start()
    assert slow.wait(30)
    x = torch.arange(1000, device="cuda")  # the caller's stream: the default one
    t0 = time.perf_counter()
    assert int(x.sum().cpu()) == 499500
    took = time.perf_counter() - t0
    t.join(60)
    assert "out" in done
    assert took < 0.2, took  # (on the engine's shared stream it waited ~0.5 s)
