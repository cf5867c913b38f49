"""kernel.fuse_projections: q / k / v and gate / up weights laid out as one buffer each
(integrations/hf/projections.py), and the oxygen backend's pass that runs each such group as one
GEMM (compile/linear_cat.py). On CPU: the op against the linears apart in float64, the pass on
tiny models of several architectures (biases included) against the eager forward, a shared
compile on a model not laid out, save_pretrained / from_pretrained, and the engine's tokens
against stock with the setting on."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from test_engine import in_threads
from test_engine_loop import _generate, call
from test_hf_generate import tiny
from torch import nn
from torch._dynamo.backends.debugging import aot_eager

import oxygen_torch
from oxygen_torch.compile import backend as backend_mod
from oxygen_torch.compile import linear_cat as LC
from oxygen_torch.compile import make_backend
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import engine_runner, projections
from oxygen_torch.integrations.hf import integration as hf


def _rand_rows(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_op_equals_the_linears_apart_adjacent_or_not(seed):
    """oxygen::linear_cat on weights that are rows of one buffer (one GEMM) and on separate
    weights (run apart, counted): both equal cat(F.linear(x, w_i, b_i)) in float64."""
    g = torch.Generator().manual_seed(seed)
    k = int(torch.randint(3, 40, (1,), generator=g))
    ns = torch.randint(1, 30, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
    x = _rand_rows(g, 2, 5, k)
    sep_w = [_rand_rows(g, n, k) for n in ns]
    sep_b = [_rand_rows(g, n) for n in ns]
    ref = torch.cat([F.linear(x, w, b) for w, b in zip(sep_w, sep_b)], dim=-1)
    ref_nob = torch.cat([F.linear(x, w) for w in sep_w], dim=-1)
    buf_w, buf_b = torch.cat(sep_w), torch.cat(sep_b)
    offs = [sum(ns[:i]) for i in range(len(ns))]
    adj_w = [buf_w[o : o + n] for o, n in zip(offs, ns)]
    adj_b = [buf_b[o : o + n] for o, n in zip(offs, ns)]
    assert LC.adjacent(adj_w) and LC.adjacent(adj_b)
    assert not LC.adjacent(sep_w) and not LC.adjacent(adj_w[::-1])
    LC.reset()
    torch.testing.assert_close(torch.ops.oxygen.linear_cat(x, adj_w, adj_b), ref)
    torch.testing.assert_close(torch.ops.oxygen.linear_cat(x, adj_w, []), ref_nob)
    assert LC.stats().get("ran_apart", 0) == 0
    torch.testing.assert_close(torch.ops.oxygen.linear_cat(x, sep_w, sep_b), ref)
    torch.testing.assert_close(torch.ops.oxygen.linear_cat(x, adj_w, sep_b), ref)
    assert LC.stats()["ran_apart"] == 2
    with pytest.raises(ValueError, match="biases for"):
        torch.ops.oxygen.linear_cat(x, adj_w, adj_b[:1])


def test_adjacency_wants_one_storage_in_order_one_width_and_dtype():
    buf = torch.randn(10, 4)
    assert LC.adjacent([buf[:3], buf[3:7], buf[7:]])
    assert not LC.adjacent([buf[:3], buf[4:7]])  # a gap
    assert not LC.adjacent([buf[3:7], buf[:3]])  # out of order
    assert not LC.adjacent([buf[:3], torch.randn(7, 4)])  # two storages
    assert not LC.adjacent([buf[:, :2], buf[:, 2:]])  # not contiguous
    wide = torch.randn(20)
    assert not LC.adjacent([wide[:8].view(2, 4), wide[8:].view(3, 4)[:, :3]])
    assert not LC.adjacent([buf[:3], buf[3:].to(torch.float64)])


@pytest.fixture
def aot(monkeypatch):
    """The backend's passes, then AOTAutograd with eager kernels (no Inductor build on CPU)."""
    monkeypatch.setattr(backend_mod, "final_compiler", lambda gm, ex, patches: aot_eager(gm, ex))
    torch._dynamo.reset()
    oxygen_torch.compile.reset_stats()
    yield
    torch._dynamo.reset()


def _compiled_logits(model, ids):
    fn = torch.compile(type(model).forward, backend=make_backend({}), fullgraph=True)
    with torch.no_grad():
        return fn(model, ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3"])
def test_a_laid_out_model_compiles_each_group_to_one_gemm_with_the_same_logits(aot, arch):
    """make_adjacent keeps every parameter and value; the compiled forward then holds one
    oxygen::linear_cat per q / k / v and per gate / up (qwen2: with q / k / v biases) and its
    logits equal the eager forward's."""
    model = tiny(arch, seed=int(torch.randint(0, 1000, (1,))))
    ids = torch.randint(1, 128, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    done = projections.make_adjacent(model)
    layers = model.config.num_hidden_layers
    assert done == {"joined": 2 * layers}, done
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p, before[n][1]), n
    attn = model.model.layers[0].self_attn
    assert LC.adjacent([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    if attn.q_proj.bias is not None:
        assert LC.adjacent([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    out = _compiled_logits(model, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    st = oxygen_torch.compile.stats()["linear_cat"]
    assert st == {"groups_of_3": layers, "groups_of_2": layers}, st
    assert projections.make_adjacent(model) is done  # once a model


class _Three(nn.Module):
    """Three linears on one input, as q / k / v (no attention: the backend's attention op has
    no backward either)."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 6), nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x):
        return self.q_proj(x).sum(-1) * self.k_proj(x).mean(-1) + self.v_proj(x).square().sum(-1)


def test_a_graph_that_trains_keeps_its_linears_apart(aot):
    """With grad on and weights that want it, the pass leaves the linears (the op has no
    backward): the gradients equal the eager forward's; without grad the same module's
    compile joins them."""
    torch.manual_seed(int(torch.randint(0, 1000, (1,))))
    model = _Three()
    assert projections.make_adjacent(model) == {"joined": 1}
    x = torch.randn(5, 8)
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    fn = torch.compile(type(model).forward, backend=make_backend({}), fullgraph=True)
    fn(model, x).sum().backward()
    assert oxygen_torch.compile.stats()["linear_cat"] == {}
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        want = model(x)
        torch._dynamo.reset()
        got = torch.compile(type(model).forward, backend=make_backend({}), fullgraph=True)(model, x)
    torch.testing.assert_close(got, want)
    assert oxygen_torch.compile.stats()["linear_cat"] == {"groups_of_3": 1}


def test_a_model_not_laid_out_is_compiled_as_written(aot):
    model = tiny("llama", seed=3)
    ids = torch.randint(1, 128, (1, 6))
    with torch.no_grad():
        ref = model(ids).logits
    torch.testing.assert_close(_compiled_logits(model, ids), ref, rtol=1e-5, atol=1e-5)
    assert oxygen_torch.compile.stats()["linear_cat"] == {}


def test_a_shared_compile_on_a_model_not_laid_out_runs_its_linears_apart(aot):
    """A compiled forward serves every model of its class: one compiled on a laid-out model and
    called on another whose weights are separate still gives that model's logits (the op checks
    adjacency when it runs, and counts the calls that ran apart)."""
    laid, plain = tiny("llama", seed=4), tiny("llama", seed=5)
    projections.make_adjacent(laid)
    ids = torch.randint(1, 128, (2, 5))
    with torch.no_grad():
        ref = plain(ids).logits
    fn = torch.compile(type(laid).forward, backend=make_backend({}), fullgraph=True)
    with torch.no_grad():
        fn(laid, ids)
        out = fn(plain, ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert oxygen_torch.compile.stats()["linear_cat"]["ran_apart"] >= 4


def test_a_laid_out_model_saves_and_loads_as_before(tmp_path):
    """transformers' save_pretrained (safetensors) takes weights that share one buffer without
    overlapping; the loaded model has the same weights and logits."""
    model = tiny("qwen2", seed=6)
    projections.make_adjacent(model)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    got = dict(loaded.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p, rtol=0, atol=0)
    ids = torch.randint(1, 128, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


class _MyLinear(nn.Linear):
    pass


def test_groups_that_are_not_plain_linears_are_left_and_counted():
    model = tiny("llama", seed=7)
    attn = model.model.layers[0].self_attn
    old = attn.k_proj
    attn.k_proj = _MyLinear(old.in_features, old.out_features, bias=False)
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight.data = mlp.up_proj.weight.data.double()
    ptrs = (attn.q_proj.weight.data_ptr(), mlp.gate_proj.weight.data_ptr())
    done = projections.make_adjacent(model)
    assert done == {
        "joined": 2,
        "not plain nn.Linear layers": 1,
        "weights of different dtypes or devices": 1,
    }, done
    assert (attn.q_proj.weight.data_ptr(), mlp.gate_proj.weight.data_ptr()) == ptrs


def _engine_on_a_model_not_laid_out(arch, kws, device="cpu"):
    """Calls through the engine's compiled forward on another model of `arch`, with
    kernel.fuse_projections off: its graphs join nothing."""
    other = tiny(arch, seed=int(torch.randint(0, 1000, (1,)))).to(device)
    cfg = load_config(
        scheduler={"engine": True, "decode_graphs": device == "cuda"},
        kv={"cpu_decode_graphs": "fuse", "debug_checks": False},
    )  # fmt: skip
    hf.apply(other, cfg)
    try:
        _, errors = in_threads(lambda kw: _generate(other, kw), [(kw,) for kw in kws])
        assert not errors, errors
        assert projections.report(other) is None and projections.layout(other) == "as loaded"
    finally:
        hf.disable_hf()


@pytest.mark.parametrize("arch", ["qwen2"])  # (q / k / v biases, a sliding window)
def test_the_engine_with_fused_projections_gives_stock_tokens(arch):
    """kernel.fuse_projections on: the model's first engine lays its weights out; 6 concurrent
    greedy calls through the compiled decode graphs (CPU stand-in, kv.cpu_decode_graphs "fuse")
    give stock's tokens, and the compiled forward ran its groups as one GEMM each, though a
    model of the same class, not laid out, ran through the engine's compiled forward first (the
    compiled functions are per layout: on the GPU one compiled first was reused, groups apart)."""
    model = tiny(arch, seed=int(torch.randint(0, 1000, (1,))))
    seeds = torch.randint(0, 10_000, (6,)).tolist()
    kws = [call(s) for s in seeds]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    _engine_on_a_model_not_laid_out(arch, kws[:2])
    oxygen_torch.compile.reset_stats()
    cfg = load_config(
        scheduler={"engine": True}, kernel={"fuse_projections": True},
        kv={"cpu_decode_graphs": "fuse"},
    )  # fmt: skip
    hf.apply(model, cfg)
    try:
        out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
        assert not errors, errors
        for i, r in enumerate(ref):
            assert torch.equal(out[i], r), (arch, seeds[i])
        assert projections.report(model) == {"joined": 2 * model.config.num_hidden_layers}
        st = oxygen_torch.compile.stats()["linear_cat"]
        assert st.get("groups_of_3", 0) >= 2 and st.get("ran_apart", 0) == 0, st
    finally:
        hf.disable_hf()


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_projections_on_the_gpu_give_stock_tokens_through_decode_graphs(arch):
    """The same on the GPU (float32): the engine's decode graphs captured from a forward whose
    groups are one cuBLAS GEMM each; 8 calls from threads agree with stock's tokens (merged and
    alone runs use other kernel shapes: a rate, as test_engine_loop_cuda.py's)."""
    model = tiny(arch, seed=11).cuda()
    kws = []
    for s in range(8):
        kw = call(s)
        kw["input_ids"], kw["attention_mask"] = kw["input_ids"].cuda(), kw["attention_mask"].cuda()
        kws.append(kw)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    _engine_on_a_model_not_laid_out(arch, kws[:2], "cuda")
    oxygen_torch.compile.reset_stats()
    cfg = load_config(
        scheduler={"engine": True, "decode_graphs": True}, kernel={"fuse_projections": True},
        kv={"debug_checks": False},
    )  # fmt: skip
    hf.apply(model, cfg)
    try:
        out, errors = in_threads(lambda kw: _generate(model, kw), [(kw,) for kw in kws])
        assert not errors, errors
        agree = [float((out[i] == r).float().mean()) if out[i].shape == r.shape else 0.0
                 for i, r in enumerate(ref)]  # fmt: skip
        assert sum(agree) / len(agree) >= 0.98, agree
        assert projections.report(model) == {"joined": 2 * model.config.num_hidden_layers}
        st = oxygen_torch.compile.stats()["linear_cat"]
        assert st.get("groups_of_3", 0) >= 2 and st.get("ran_apart", 0) == 0, st
    finally:
        hf.disable_hf()


def test_a_model_whose_single_call_graphs_exist_is_left_apart(caplog):
    """Decode graphs captured by a call alone (the per-call path) read the model's weights where
    they are: a first engine made after them leaves the layout alone (they would read freed
    tensors), and its calls still give stock's tokens."""
    from oxygen_torch import _patching
    from oxygen_torch.integrations.hf import graphs

    model = tiny("llama", seed=8)
    kws = [call(s) for s in (1, 2)]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, load_config(scheduler={"engine": False}, kv={"cpu_decode_graphs": "rerun"}))
    try:
        with torch.no_grad():
            assert torch.equal(model.generate(**kws[0]), ref[0])
        assert graphs._graphs[model].graphs  # captured by that call
        ptr = model.model.layers[0].self_attn.k_proj.weight.data_ptr()
        cfg = load_config(
            scheduler={"engine": True}, kernel={"fuse_projections": True},
            kv={"cpu_decode_graphs": "rerun"},
        )  # fmt: skip
        hf.apply(model, cfg)
        with torch.no_grad():
            assert torch.equal(model.generate(**kws[1]), ref[1])
        assert engine_runner._engines.get(model), "the second call ran on an engine"
        assert projections.report(model) is None
        assert model.model.layers[0].self_attn.k_proj.weight.data_ptr() == ptr
        # told why at its first engine: a later call does not also say "made with it off"
        _patching.forget_warnings()
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="oxygen_torch"):
            assert torch.equal(model.generate(**kws[0]), ref[0])
        assert not [r for r in caplog.records if "setting off" in r.getMessage()]
    finally:
        hf.disable_hf()


def test_the_setting_turned_on_after_a_models_first_engine_is_said_not_applied(caplog):
    """kernel.fuse_projections on for a model whose first engine was made with it off: the
    weights stay where that engine's graphs read them, the calls give stock's tokens, and a
    warning says the setting was not applied (no silent no-op). (A model left apart at its first
    engine for another reason is not told this too: the test above.)"""
    from oxygen_torch import _patching

    model = tiny("llama", seed=int(torch.randint(0, 1000, (1,))))
    kws = [call(s) for s in torch.randint(0, 10_000, (2,)).tolist()]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    _patching.forget_warnings()
    graphs_kv = {"cpu_decode_graphs": "rerun"}
    hf.apply(model, load_config(scheduler={"engine": True}, kv=graphs_kv))
    try:
        with torch.no_grad():
            assert torch.equal(model.generate(**kws[0]), ref[0])
        ptr = model.model.layers[0].self_attn.k_proj.weight.data_ptr()
        on = load_config(
            scheduler={"engine": True}, kernel={"fuse_projections": True}, kv=graphs_kv
        )
        hf.apply(model, on)
        with torch.no_grad(), caplog.at_level(logging.WARNING, logger="oxygen_torch"):
            assert torch.equal(model.generate(**kws[1]), ref[1])
        said = [r.getMessage() for r in caplog.records if "fuse_projections" in r.getMessage()]
        assert len(said) == 1 and "first engine was made with the setting off" in said[0], said
        assert projections.report(model) is None
        assert model.model.layers[0].self_attn.k_proj.weight.data_ptr() == ptr
    finally:
        hf.disable_hf()
