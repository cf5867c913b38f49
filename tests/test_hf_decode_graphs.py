"""The decode-graph bookkeeping of generate() on the paged cache, on CPU.

There is no CUDA graph on CPU: with kv.cpu_decode_graphs=rerun the stand-in "replays" by running
the forward again on the graph's buffers, so what is checked here is the planning, the buffers,
the keys and the life cycle. tests/test_hf_cuda.py checks real graphs against eager steps on the
GPU, and every test of test_hf_generate.py runs with the stand-in too.
"""

import contextlib
import gc
import logging
import weakref

import pytest
import torch
from test_hf_generate import batch, tiny

import oxygen_torch.compile as oc
from oxygen_torch import _patching
from oxygen_torch.compile import backend as backend_mod
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import compat
from oxygen_torch.integrations.hf import fuse as hf_fuse
from oxygen_torch.integrations.hf import graphs as hf_graphs
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv import pool_stats
from oxygen_torch.kv.core import PagedKVCore

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = pytest.mark.per_call


def on_cpu(mode: str = "rerun", **kv):
    """A configuration whose decode steps on CPU take the graph path as `mode` says
    (kv.cpu_decode_graphs: "rerun", "fuse", or "off" for eager steps), with `kv` besides."""
    return load_config(kv={"cpu_decode_graphs": mode, **kv})


@pytest.fixture
def graphs():
    """The configuration of a test of the decode-graph path on CPU (built for each test, so it
    has the per_call marker's OXYGEN_CONF too)."""
    _patching.forget_warnings()  # each test sees its own warnings
    yield on_cpu("rerun")
    hf.disable_hf()


def _generate(model, n=8, **kw):
    ids, mask = batch()
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, **kw)


def test_one_graph_to_max_length_and_across_calls(graphs, monkeypatch):
    monkeypatch.setattr(hf_graphs, "WIDTH_STEP", 1)  # the width is exactly max_length's blocks
    model = hf.apply(tiny(), graphs)
    # prompt 13 + 19 new = 32 tokens: the last step fills the second 16-token block exactly
    first = _generate(model, n=19)
    st = hf_graphs.stats(model)
    want = {"graphs": 1, "captures": 1, "replays": 17, "failed": 0, "compiled": 0, "fused": 0}
    assert st == want, st
    assert torch.equal(_generate(model, n=19), first)
    assert hf_graphs.stats(model)["captures"] == 1
    key = next(iter(hf_graphs._graphs[model].graphs))
    assert key[:2] == (3, 2)  # batch 3, 2 blocks wide


def test_generate_keeps_no_cache_alive(graphs):
    model = hf.apply(tiny(), graphs)
    caches = []
    original = hf_graphs.DecodeGraph.run

    def run(self, model, forward, core, kw, **options):
        caches.append(weakref.ref(compat.given_cache(kw)))
        return original(self, model, forward, core, kw, **options)

    hf_graphs.DecodeGraph.run = run
    try:
        _generate(model)
        _generate(model)
    finally:
        hf_graphs.DecodeGraph.run = original
    gc.collect()
    assert caches and all(ref() is None for ref in caches)
    assert sum(p["blocks_used"] for p in pool_stats()) == 0


def test_moved_weights_are_captured_again(graphs):
    model = hf.apply(tiny(), graphs)
    ref = _generate(model)
    head = model.lm_head.weight
    head.data = head.data.clone()  # same values, new address: the old graph would read freed memory
    assert torch.equal(_generate(model), ref)
    assert hf_graphs.stats(model)["captures"] == 2


def test_outputs_the_graph_cannot_give_run_eagerly_with_a_warning(graphs, caplog):
    model = hf.apply(tiny(), graphs)
    ids, mask = batch()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=4,
            do_sample=False,
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
    assert len(out.hidden_states) == 4
    assert hf_graphs.stats(model)["captures"] == 0
    assert "decode steps run without CUDA graphs: output_attentions / output_hidden_states" in (
        caplog.text
    )


def test_decode_graphs_off_and_disable(graphs):
    model = hf.apply(tiny(), on_cpu(decode_graphs=False))
    _generate(model)
    assert hf_graphs.stats(model)["captures"] == 0
    hf.apply(model, on_cpu(decode_graphs=True))
    _generate(model)
    assert hf_graphs.stats(model)["graphs"] == 1
    hf.disable_hf()
    assert hf_graphs.stats(model)["graphs"] == 0


@pytest.fixture
def core():
    core = PagedKVCore(2, block_tokens=16)
    yield core
    core.release()  # its blocks back to the shared pool (later tests check the pools are idle)


def test_graph_step_that_outgrows_its_width_is_refused(core):
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 1, 16, 64, generator=g) for _ in range(2))
    for layer in range(2):
        core.write(layer, k, v)
    table, ints = core.begin_graph_step(2)
    assert table.shape == (2, 2) and ints[:2] == [17, 17]
    first = core.seqs.blocks[0]
    assert table[0].tolist() == first and ints[2] == first[1] * 16  # slot of token 17: block 2
    core.end_graph_step()
    for _ in range(15):
        core.begin_graph_step(2)
        core.end_graph_step()
    with pytest.raises(ValueError, match="3 blocks do not fit a decode graph 2 blocks wide"):
        core.begin_graph_step(2)
    assert core.length == 32 and core.seqs.lens == [32, 32] and core.seqs.max_blocks() == 2
    core.write(0, k[:, :, :1], v[:, :, :1])  # the cache goes on eagerly
    assert core.seqs.lens == [33, 33]


def test_fusion_compiles_norms_mlp_and_rotary_for_the_capture_only():
    import transformers.models.qwen3.modeling_qwen3 as qwen3

    model = tiny("qwen3")  # RMSNorm on hidden states and on q/k heads, MLP, rotary
    ids, mask = batch()
    rope = qwen3.apply_rotary_pos_emb
    assert hf_fuse.fusible(model) == [
        "Qwen3MLP",
        "Qwen3RMSNorm",
        "Qwen3RotaryEmbedding",
        "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb",
    ]
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        with hf_fuse.fused(model):
            assert hf_fuse.active() and qwen3.apply_rotary_pos_emb is not rope
            assert "forward" in model.model.norm.__dict__
            got = model(ids, attention_mask=mask).logits
    assert not hf_fuse.active() and qwen3.apply_rotary_pos_emb is rope
    assert not any("forward" in m.__dict__ for m in model.modules())
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < 1e-5 or torch.equal(got, ref), err


def test_a_forward_wrapped_on_the_instance_keeps_it_and_warns(graphs, caplog):
    model = hf.apply(tiny(), graphs)
    inner = model.forward
    calls = []

    def wrapper(*args, **kw):
        calls.append(1)
        return inner(*args, **kw)

    model.forward = wrapper
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        _generate(model, n=4)
    assert len(calls) == 4 and model.forward is wrapper
    assert hf_graphs.stats(model)["captures"] == 0
    assert "the model's forward is replaced on the instance" in caplog.text


# --- the decode step compiled whole by backend "oxygen" ----------------------------------------


@pytest.fixture
def compiled(graphs, monkeypatch, fresh_compile):
    """The configuration of decode graphs fused on CPU too (kv.cpu_decode_graphs=fuse); the
    oxygen backend's rewritten graph runs as traced (Inductor's C++ build would cost CI minutes;
    the GPU tests run Inductor)."""
    monkeypatch.setattr(backend_mod, "final_compiler", lambda gm, example, patches: gm)
    return on_cpu("fuse")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen3", "gemma3"])
def test_compiled_decode_step_equals_eager(compiled, arch, monkeypatch):
    from oxygen_torch.engine import gc_watch

    refrozen = []  # the compile's objects frozen after it (engine/gc_watch.py refreeze)
    monkeypatch.setattr(gc_watch, "refreeze", refrozen.append)
    model = tiny(arch)
    ids, mask = batch()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    with torch.no_grad():
        ref = hf.apply(model, compiled).generate(
            ids, **kw, use_cache=True, output_logits=True, return_dict_in_generate=True
        )
        hf.apply(model, on_cpu("off"))  # eager decode steps from here
        eager = model.generate(ids, **kw, output_logits=True, return_dict_in_generate=True)
    assert torch.equal(ref.sequences, eager.sequences)
    for a, b in zip(ref.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    st = hf_graphs.stats(model)
    assert st["captures"] == 1 and st["compiled"] == 1 and st["fused"] == 0, st
    assert refrozen == ["a decode graph's compile"]
    layers = model.config.num_hidden_layers
    s = oc.stats()  # one graph, every layer's attention an oxygen::paged_step, nothing left
    assert s["graphs_compiled"] == 1, s
    assert s["rewritten_by_pattern"] == {"paged_step": layers} and s["left"] == 0, s


def test_compiled_decode_does_not_recompile_as_the_cache_grows(compiled):
    # the stand-in replays by calling the compiled forward again, so every one of the 64 steps
    # runs through Dynamo's guards: a guard on the cache's length would recompile each step
    model = hf.apply(tiny(), compiled)
    ids, mask = batch()
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
        again = model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=64, do_sample=False)
        hf.apply(model, on_cpu("off"))
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=64, do_sample=False)
    assert torch.equal(got, ref)
    assert again.shape == (2, 13 + 64)
    assert oc.stats()["graphs_compiled"] == 2  # batch 3, then batch 2: one compile each
    assert hf_graphs.stats(model)["replays"] == 2 * 62


def test_a_failed_whole_compile_falls_back_to_module_fusion_with_a_warning(
    compiled, monkeypatch, caplog
):
    @contextlib.contextmanager
    def broken(model, forward, core, options):
        raise RuntimeError("no trace today")
        yield

    monkeypatch.setattr(hf_fuse, "compiled", broken)
    monkeypatch.setattr(hf_fuse, "fused", _fused_without_compiling)
    model = hf.apply(tiny(), compiled)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        got = _generate(model)
    st = hf_graphs.stats(model)
    assert st["compiled"] == 0 and st["fused"] == 1, st
    assert "decode-graph fusion (compiled) failed: RuntimeError('no trace today')" in caplog.text
    hf.apply(model, on_cpu("off"))
    assert torch.equal(got, _generate(model))


@contextlib.contextmanager
def _fused_without_compiling(model, forward, core, options):
    yield forward


def test_a_forward_the_user_compiled_runs_uncompiled_on_the_paged_cache(compiled, caplog):
    model = hf.apply(tiny(), compiled)
    ids, mask = batch()
    with torch.no_grad():
        ref = _generate(model)
        user = torch.compile(model.forward, backend="eager")
        model.forward = user
        with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
            got = _generate(model)
    assert torch.equal(got, ref)
    assert model.forward is user  # put back after the call
    assert "the model's forward is compiled by torch.compile" in caplog.text
    # the decode steps were still captured through backend "oxygen"; nothing else compiled
    assert hf_graphs.stats(model)["compiled"] == 1 and oc.stats()["graphs_compiled"] == 1


def test_model_compile_is_set_aside_for_the_paged_call_only(compiled, caplog):
    model = hf.apply(tiny(), compiled)
    with torch.no_grad():
        ref = _generate(model)
        model.compile(backend="eager")
        impl = model._compiled_call_impl
        with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
            got = _generate(model)
    assert torch.equal(got, ref) and model._compiled_call_impl is impl
    assert "the model's forward is compiled by torch.compile" in caplog.text


def test_paged_step_outside_a_decode_graph_step_is_an_error():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 1, 64, generator=g), torch.randn(2, 2, 1, 64, generator=g)
    with pytest.raises(RuntimeError, match="only inside a decode-graph step"):
        torch.ops.oxygen.paged_step(q, k, k, 0, None, 0)


def test_a_model_with_a_compiled_decode_graph_can_be_collected(compiled):
    model = hf.apply(tiny(), compiled)
    _generate(model)
    assert hf_graphs.stats(model)["compiled"] == 1
    for g in hf_graphs._graphs[model].graphs.values():
        g.runner = None  # the CPU stand-in re-runs the forward, so it holds it; a CUDA graph not
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_compile_config_naming_oxygen_configures_the_paged_call(compiled, monkeypatch, caplog):
    from transformers import CompileConfig

    from oxygen_torch.kv import pool_stats

    seen = []
    monkeypatch.setattr(
        backend_mod, "final_compiler", lambda gm, ex, patches: seen.append(patches) or gm
    )
    model = hf.apply(tiny(), compiled)
    options = {"kv_dtype": "fp8_e4m3", "inductor": {"max_autotune": False}}
    cc = CompileConfig(backend="oxygen", options=options)
    with caplog.at_level(logging.WARNING):
        _generate(model, compile_config=cc)
    assert any(p["dtype"] == "float8_e4m3fn" for p in pool_stats())  # the cache's storage
    assert seen == [{"max_autotune": False}]  # the decode graph's compile got its options
    assert hf_graphs.stats(model)["compiled"] == 1
    assert "compile_config" not in caplog.text  # transformers did not report it skipped
    with pytest.raises(ValueError, match="oxygen backend option 'kv_dtype'"):
        _generate(model, compile_config=CompileConfig(backend="oxygen", options={"kv_dtype": 4}))


def test_compile_config_with_another_backend_warns_on_the_paged_cache(compiled, caplog):
    from transformers import CompileConfig

    model = hf.apply(tiny(), compiled)
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        got = _generate(model, compile_config=CompileConfig())  # inductor
    assert "compile_config backend 'inductor' is not used on the paged cache" in caplog.text
    assert hf_graphs.stats(model)["compiled"] == 1
    hf.apply(model, on_cpu("off"))
    assert torch.equal(got, _generate(model))


def test_two_models_of_a_class_share_one_compile_and_keep_their_weights(compiled):
    a, b = hf.apply(tiny(seed=0), compiled), hf.apply(tiny(seed=5), compiled)
    got = [_generate(m, n=10) for m in (a, b)]
    a, b = hf.apply(a, on_cpu("off")), hf.apply(b, on_cpu("off"))
    ref = [_generate(m, n=10) for m in (a, b)]
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert not torch.equal(ref[0], ref[1])  # different weights, different tokens
    assert oc.stats()["graphs_compiled"] == 1  # the weights are inputs of the one graph


def test_a_failed_step_leaves_no_cache_on_the_thread(graphs, monkeypatch):
    from oxygen_torch import context

    def broken(self, *args):
        raise RuntimeError("warm-up failed")

    monkeypatch.setattr(hf_graphs.DecodeGraph, "_warm_and_capture", broken)
    model = hf.apply(tiny(), graphs)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        _generate(model)
    assert context.current().lent is None
    with pytest.raises(RuntimeError, match="only inside a decode-graph step"):
        context.lent_core()
