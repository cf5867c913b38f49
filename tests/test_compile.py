"""The oxygen backend's passes, options and stats on CPU.

Graphs go through the real backend (Dynamo, the rewrite, AOTAutograd with the ops' fake kernels
and functionalization) but are executed eagerly instead of by Inductor, whose C++ build costs
10-60 s per graph on a CI CPU; test_compile_inductor.py runs the full Inductor path.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager

import oxygen_torch.compile as oc
from oxygen_torch.compile import backend as backend_mod


@pytest.fixture(autouse=True)
def light(monkeypatch, fresh_compile):
    monkeypatch.setattr(backend_mod, "final_compiler", lambda gm, ex, patches: aot_eager(gm, ex))


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check(module, *inputs, options=None, tol=1e-5, **compile_kw):
    """Compiled (fullgraph) == eager; returns stats()."""
    ref = module(*inputs)
    fn = torch.compile(module, backend="oxygen", fullgraph=True, options=options, **compile_kw)
    out = fn(*inputs)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    return oc.stats()


def _chain(err):
    """err and what it wraps (Dynamo wraps backend errors in BackendCompilerFailed)."""
    out = []
    while err is not None and err not in out:
        out.append(err)
        err = getattr(err, "inner_exception", None) or err.__cause__
    return out


def _assert_all_rewritten(s, n):
    assert s["attention_found"] == n, s
    assert s["rewritten"] == n and s["left"] == 0, s


# --- hand-written attention ----------------------------------------------------------------------


class HandDiv(nn.Module):
    def forward(self, q, k, v, mask):
        s = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        return F.softmax(s + mask, dim=-1) @ v


class HandMul(nn.Module):
    def forward(self, q, k, v, mask):
        s = (q @ k.transpose(-1, -2)) * 0.2
        return torch.matmul(torch.softmax(s, -1), v)


class HandFill(nn.Module):
    def forward(self, q, k, v, mask):
        keep = mask > -0.5
        s = (q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5).masked_fill(~keep, float("-inf"))
        return s.softmax(dim=-1) @ v


class HandHF(nn.Module):
    """transformers' eager_attention_forward: softmax in fp32, back to q's dtype, dropout off."""

    def forward(self, q, k, v, mask):
        w = torch.matmul(q, k.transpose(2, 3)) * 0.25 + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.1, training=self.training)
        return torch.matmul(w, v)


class HandPreScaled(nn.Module):
    def forward(self, q, k, v, mask):
        return torch.softmax((q * 0.3) @ k.transpose(-2, -1), dim=-1) @ v


class HandBaddbmm(nn.Module):
    """3-D [B*H, S, D] like nn.MultiheadAttention's need_weights path, mask via baddbmm."""

    def forward(self, q, k, v, mask):
        q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))
        w = torch.baddbmm(mask, q3 * 0.25, k3.transpose(-2, -1))
        return torch.bmm(torch.softmax(w, dim=-1), v3)


@pytest.mark.parametrize("cls", [HandDiv, HandMul, HandFill, HandHF, HandPreScaled, HandBaddbmm])
def test_hand_written_attention_is_rewritten(cls):
    q, k, v = (_randn(2, 4, 8, 16, seed=i) for i in range(3))
    mask = _randn(8, 8, seed=3)
    s = _check(cls().eval(), q, k, v, mask)
    _assert_all_rewritten(s, 1)
    assert s["rewritten_by_pattern"] == {"matmul_softmax": 1}


def test_softmax_outside_attention_is_not_counted():
    head = nn.Sequential(nn.Linear(16, 4), nn.Softmax(dim=-1))
    s = _check(head, _randn(3, 16, seed=0))
    assert s["attention_found"] == 0 and s["graphs_compiled"] == 1


# --- SDPA ----------------------------------------------------------------------------------------


class Sdpa(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.kw)


SDPA_CASES = [
    pytest.param({"is_causal": True}, 4, 8, None, id="causal"),
    pytest.param({"is_causal": True}, 4, 12, None, id="causal-sq<sk"),
    pytest.param({}, 4, 8, "bool", id="bool-mask"),
    pytest.param({"scale": 0.1}, 4, 8, "add", id="additive-mask-scale"),
    pytest.param({"enable_gqa": True, "is_causal": True}, 2, 8, None, id="gqa"),
    pytest.param({"enable_gqa": True}, 1, 9, "bool", id="mqa-bool"),
]


@pytest.mark.parametrize("kw,hkv,sk,mask", SDPA_CASES)
def test_sdpa_is_rewritten(kw, hkv, sk, mask):
    q = _randn(2, 4, 8, 16, seed=0)
    k, v = _randn(2, hkv, sk, 16, seed=1), _randn(2, hkv, sk, 16, seed=2)
    m = None
    if mask == "bool":
        m = _randn(2, 1, 8, sk, seed=3) > -0.5
        m[..., 0] = True
    elif mask == "add":
        m = _randn(2, 4, 8, sk, seed=3)
    s = _check(Sdpa(**kw), q, k, v, m)
    _assert_all_rewritten(s, 1)
    assert s["rewritten_by_pattern"] == {"sdpa": 1}


def test_aten_sdpa_is_rewritten():
    def f(q, k, v):
        return torch.ops.aten.scaled_dot_product_attention(q, k, v, is_causal=True)

    q, k, v = (_randn(1, 2, 6, 16, seed=i) for i in range(3))
    _assert_all_rewritten(_check(f, q, k, v), 1)


# --- nn.MultiheadAttention -----------------------------------------------------------------------


@pytest.mark.parametrize("masks", ["none", "key_padding", "causal"])
def test_multihead_attention_is_rewritten(masks):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = _randn(2, 6, 32, seed=1)
    kw = {}
    if masks == "key_padding":
        kw["key_padding_mask"] = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    if masks == "causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(6)
        kw["is_causal"] = True

    def f(x):
        return mha(x, x, x, need_weights=False, **kw)[0]

    with torch.no_grad():
        s = _check(f, x)
    _assert_all_rewritten(s, 1)
    assert s["rewritten_by_pattern"] == {"mha": 1}


def test_multihead_attention_with_weights_is_left_and_reported():
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = _randn(2, 6, 32, seed=1)
    with torch.no_grad(), pytest.warns(oc.AttentionLeftWarning, match="need_weights"):
        s = _check(lambda x: mha(x, x, x)[0], x)
    assert s["attention_found"] == 1 and s["left"] == 1
    assert "need_weights" in s["left_reasons"][0]["reason"]


# --- what is left: warn or error -----------------------------------------------------------------


def _dropout_sdpa(q):
    return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


def test_dropout_is_left_with_a_warning():
    q = _randn(1, 2, 4, 16, seed=0)
    with pytest.warns(oc.AttentionLeftWarning, match="dropout_p"):
        torch.compile(_dropout_sdpa, backend="oxygen", fullgraph=True)(q)
    s = oc.stats()
    assert s["left"] == 1 and s["rewritten"] == 0
    assert s["left_reasons"][0]["pattern"] == "sdpa"


def test_hand_written_dropout_in_training_is_left():
    q, k, v = (_randn(2, 4, 8, 16, seed=i) for i in range(3))
    with pytest.warns(oc.AttentionLeftWarning, match="dropout"):
        torch.compile(HandHF().train(), backend="oxygen", fullgraph=True)(q, k, v, 0.0 * q[..., :8])
    assert oc.stats()["left"] == 1


def test_fallback_error_raises():
    q = _randn(1, 2, 4, 16, seed=0)
    fn = torch.compile(_dropout_sdpa, backend="oxygen", options={"fallback": "error"})
    with pytest.raises(Exception) as info:
        fn(q)
    chain = _chain(info.value)
    assert any(isinstance(x, oc.UnsupportedAttentionError) for x in chain), chain
    assert "dropout_p" in str(info.value)


# --- options -------------------------------------------------------------------------------------

BAD_OPTIONS = [
    ({"precision": "fp64"}, "precision"),
    ({"block_m": 24}, "block_m"),
    ({"block_n": 512}, "block_n"),
    ({"attention_type": "linear"}, "attention_type"),
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"fallback": "ignore"}, "fallback"),
    ({"mode": "max-autotune"}, "mode"),
    ({"inductor": {"no_such_knob": 1}}, "inductor"),
    ({"inductor": ["max_autotune"]}, "inductor"),
    ({"tiling": 3}, "tiling"),
]


@pytest.mark.parametrize("options,name", BAD_OPTIONS)
def test_bad_option_raises_value_error_naming_it(options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        oc.make_backend(options)


def test_bad_option_through_torch_compile():
    fn = torch.compile(HandMul(), backend="oxygen", options={"block_m": 24})
    with pytest.raises(Exception) as info:
        fn(*(_randn(1, 2, 4, 16, seed=i) for i in range(4)))
    cause = _chain(info.value)[-1]
    assert isinstance(cause, ValueError) and "option 'block_m'" in str(cause)


def test_options_fix_tiles_in_the_graph():
    seen = []

    def grab(gm, ex, patches):
        attn = torch.ops.oxygen.attention.default
        seen.extend(n.args for n in gm.graph.nodes if n.target is attn)
        return aot_eager(gm, ex)

    backend_mod.final_compiler = grab
    q = _randn(1, 2, 8, 16, seed=0)
    opts = {"precision": "fp16_only", "block_m": 32, "block_n": 64}
    torch.compile(Sdpa(is_causal=True), backend="oxygen", options=opts)(q, q, q)
    assert len(seen) == 1
    assert seen[0][-3:] == (0, 32, 64)  # precision FP16_ONLY, then the tile overrides


def test_register_is_idempotent():
    oc.register()
    oc.register()
    assert "oxygen" in torch._dynamo.list_backends(exclude_tags=())


def test_reduce_overhead_on_cpu_is_noted():
    q = _randn(1, 2, 4, 16, seed=0)
    s = _check(Sdpa(is_causal=True), q, q, q, mode="reduce-overhead")
    _assert_all_rewritten(s, 1)
    assert any("reduce-overhead on CPU" in n for n in s["notes"])


# --- recompilation -------------------------------------------------------------------------------


@pytest.mark.parametrize("mark", [False, True])
def test_decode_steps_do_not_recompile_every_step(mark):
    """64 decode steps over a growing K/V: automatic dynamic shapes (or mark_dynamic) keep the
    number of compilations small, and each compiled graph has its attention rewritten."""
    fn = torch.compile(Sdpa(enable_gqa=True), backend="oxygen", fullgraph=True)
    q = _randn(2, 4, 1, 16, seed=0)
    kv = _randn(2, 2, 64, 16, seed=1)
    for n in range(2, 66):  # sizes 0 and 1 are always specialised by Dynamo: start at 2
        k, v = kv[:, :, :n].contiguous(), kv[:, :, :n] * 0.5  # as a growing cache: concatenated
        if mark:
            torch._dynamo.mark_dynamic(k, 2)
            torch._dynamo.mark_dynamic(v, 2)
        out = fn(q, k, v)
        if n in (2, 3, 33, 65):
            ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    s = oc.stats()
    assert 1 <= s["graphs_compiled"] <= (1 if mark else 3), s
    assert s["rewritten"] == s["graphs_compiled"] and s["left"] == 0


class RepeatKV(nn.Module):
    """transformers' repeat_kv before SDPA (what HF does whenever a mask is passed)."""

    def forward(self, q, k, v, mask):
        def rep(x):
            b, h, s, d = x.shape
            return x[:, :, None, :, :].expand(b, h, 2, s, d).reshape(b, h * 2, s, d)

        return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=mask)


def test_repeat_kv_is_folded_into_gqa():
    seen = []

    def grab(gm, ex, patches):
        attn = torch.ops.oxygen.attention.default
        seen.extend(n for n in gm.graph.nodes if n.target is attn)
        seen.append(sum(n.target == "expand" for n in gm.graph.nodes))
        return aot_eager(gm, ex)

    backend_mod.final_compiler = grab
    q, k, v = _randn(2, 4, 5, 16, seed=0), _randn(2, 2, 5, 16, seed=1), _randn(2, 2, 5, 16, seed=2)
    mask = _randn(2, 1, 5, 5, seed=3) > -0.5
    mask[..., 0] = True
    s = _check(RepeatKV(), q, k, v, mask)
    _assert_all_rewritten(s, 1)
    node, expands = seen
    assert node.args[1].meta["example_value"].shape[1] == 2  # the op reads the 2 KV heads
    assert expands == 0  # and the repeated copies are gone


def test_hf_static_cache_generate_through_the_backend():
    """transformers' own compiled decode (static cache, generation_config.compile_config) with
    backend="oxygen": the same greedy tokens as uncompiled generate, every attention rewritten."""
    from test_compile_inductor import tiny_llama
    from transformers import CompileConfig

    model = tiny_llama()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        config = CompileConfig(backend="oxygen", mode="reduce-overhead", fullgraph=True)
        config._compile_all_devices = True  # transformers compiles on CUDA only unless told
        out = model.generate(ids, cache_implementation="static", compile_config=config, **kw)
    assert torch.equal(out, ref)
    s = oc.stats()
    assert s["graphs_compiled"] >= 1 and s["left"] == 0, s
    assert s["rewritten"] == 2 * s["graphs_compiled"], s  # two layers per compiled graph
