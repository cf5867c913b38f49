"""Fresh prefill (kv.fresh_prefill): a prefill with no cached prefix attends its own K/V through
SDPA (dense) and equals the paged path -- the CPU gathered SDPA and the paged Triton prefill in
the interpreter -- and the float64 reference, on fresh random inputs; the auto table; the stats;
the setting's validation."""

from __future__ import annotations

import pytest
import torch
from oxygen_torch.triton_kernels import PrecisionMode, paged_prefill
from oxygen_torch.triton_kernels.reference import dense_attention_ref

from oxygen_torch.config import load_config
from oxygen_torch.kv import fresh
from oxygen_torch.kv.core import PagedKVCore

CASES = [
    # (batch, q_heads, kv_heads, q_len, padding per row, window)
    pytest.param(3, 4, 2, 23, None, None, id="gqa-nopad"),
    pytest.param(3, 4, 4, 19, [5, 0, 18], None, id="mha-leftpad"),
    pytest.param(2, 6, 2, 37, [9, 0], 7, id="gqa3-leftpad-window7"),
    pytest.param(2, 4, 1, 21, None, 30, id="mqa-window-wider-than-prompt"),
    pytest.param(2, 4, 2, 18, "holes", None, id="gqa-holes-full-attention"),
]


def _real(b, q_len, pads, gen):
    real = torch.ones(b, q_len, dtype=torch.bool)
    if pads == "holes":  # padding between real tokens: only full-attention layers allow it
        real[0, 3:6] = False
        real[1, -4:] = False
    elif pads is not None:
        for i, p in enumerate(pads):
            real[i, :p] = False
    return real


def _reference(q, k, v, real, scale, window):
    """float64, per sequence over its real tokens only (the paged cache stores no padding)."""
    out = torch.zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=torch.float64)
    for i in range(q.shape[0]):
        keep = real[i]
        o = dense_attention_ref(
            q[i][:, keep][None], k[i][:, keep][None], v[i][:, keep][None],
            causal=True, scale=scale, sliding_window=window,
        )  # fmt: skip
        out[i, keep] = o[0].transpose(0, 1).to(torch.float64)
    return out


def _run_plan(core):
    return core._plan  # the step's plan, shared by its layers


def _run(setting, q, k, v, real, scale, window, layers=2):
    """Each layer's output of one prefill step on a fresh core with that setting."""
    core = PagedKVCore(layers, block_tokens=16, backing="torch", fresh_prefill=setting)
    outs, plans = [], []
    for layer in range(layers):
        plan = core.write(layer, k[layer], v[layer], lambda: None if real.all() else real)
        out = core.attend(layer, q[layer], plan, scale=scale, sliding_window=window,
                          k=k[layer], v=v[layer])  # fmt: skip
        outs.append(out)
        plans.append(plan)
    return core, outs, plans


@pytest.mark.parametrize("b,hq,hkv,q_len,pads,window", CASES)
def test_fresh_prefill_dense_equals_paged_and_the_float64_reference(b, hq, hkv, q_len, pads,
                                                                     window):  # fmt: skip
    gen = torch.Generator().manual_seed(hq * 100 + q_len)
    d, layers, scale = 64, 2, 0.11
    q = torch.randn(layers, b, hq, q_len, d, generator=gen)
    k = torch.randn(layers, b, hkv, q_len, d, generator=gen)
    v = torch.randn(layers, b, hkv, q_len, d, generator=gen)
    real = _real(b, q_len, pads, gen)
    fresh.reset()
    dense_core, dense, _ = _run("dense", q, k, v, real, scale, window)
    assert fresh.stats()["dense"] == layers and fresh.stats()["paged"] == 0
    paged_core, paged, plans = _run("paged", q, k, v, real, scale, window)
    assert fresh.stats()["paged"] == layers
    assert fresh.stats()["why"] == {"kv.fresh_prefill=dense": 2, "kv.fresh_prefill=paged": 2}
    for layer in range(layers):
        ref = _reference(q[layer], k[layer], v[layer], real, scale, window)
        assert dense[layer].shape == (b, q_len, hq, d)
        torch.testing.assert_close(dense[layer].double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense[layer], paged[layer], rtol=1e-5, atol=1e-5)
        assert not dense[layer][~real].any()  # padding rows are zeros on both paths
        # the GPU's paged path: the Triton prefill (interpreter) over the blocks kv_append wrote
        st, plan = paged_core.pool.storage, plans[layer]
        qr = q[layer].transpose(1, 2)[real]  # [T_real, Hq, D], packed as the cache stores them
        tri = paged_prefill(qr, st.k[layer], st.v[layer], paged_core.table, plan.cu_seqlens_q,
                            paged_core.seq_lens, scale=scale, sliding_window=window)  # fmt: skip
        torch.testing.assert_close(dense[layer][real], tri, rtol=2e-5, atol=2e-5)
    # kv_append wrote the real tokens' K/V on both paths: the decode steps after read them
    for core, plan in ((dense_core, _run_plan(dense_core)), (paged_core, plans[-1])):
        slots = plan.slot_mapping.long()
        stored = core.pool.storage.k[layers - 1].flatten(0, 1)[slots[slots >= 0]]
        assert torch.equal(stored, k[layers - 1].transpose(1, 2)[real])
    dense_core.release()
    paged_core.release()


def test_a_step_over_a_cached_prefix_stays_paged():
    """A second multi-token step (a chunk after the first, a continued prompt) reads the cache:
    the dense setting does not apply to it, and it still equals the reference."""
    gen = torch.Generator().manual_seed(5)
    b, hq, hkv, d = 2, 4, 2, 64
    core = PagedKVCore(1, block_tokens=16, backing="torch", fresh_prefill="dense")
    ks, vs = [], []
    fresh.reset()
    for q_len in (20, 9):
        q = torch.randn(b, hq, q_len, d, generator=gen)
        k, v = torch.randn(b, hkv, q_len, d, generator=gen), torch.randn(b, hkv, q_len, d)
        plan = core.write(0, k, v)
        out = core.attend(0, q, plan, scale=None, sliding_window=None, k=k, v=v)
        ks.append(k)
        vs.append(v)
        ref = dense_attention_ref(q, torch.cat(ks, 2), torch.cat(vs, 2), causal=True)
        torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-5, atol=1e-5)
    assert fresh.stats() == {
        "dense": 1, "paged": 1, "why": {"kv.fresh_prefill=dense": 1, "cached prefix": 1}
    }  # fmt: skip
    core.release()


def test_fp32_safe_dense_attends_in_float32():
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(1, 4, 30, 64, generator=gen).half()
    k, v = (torch.randn(1, 2, 30, 64, generator=gen).half() for _ in range(2))
    out = fresh.dense_attention(q, k, v, real=None, scale=None, sliding_window=None,
                                precision=PrecisionMode.FP32_SAFE)  # fmt: skip
    ref = dense_attention_ref(q.double(), k.double(), v.double(), causal=True).transpose(1, 2)
    assert out.dtype == torch.float16
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-3  # fp32 arithmetic, one rounding to fp16 at the end (2^-11 relative)


def _choose(**kw):
    base = dict(fresh=True, device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=128,
                columns=4096, padded=False, window=None, kv_dtype="auto",
                precision=PrecisionMode.AUTO_MIXED)  # fmt: skip
    return fresh.choose(kw.pop("setting", "auto"), **{**base, **kw})[0]


def test_auto_takes_dense_only_where_measured():
    assert _choose() == "dense"  # the measured cases: bf16, D=128, S=256-16384, no mask
    assert _choose(columns=16384) == "dense"
    assert _choose(columns=1024) == "dense" and _choose(columns=256) == "dense"
    assert _choose(columns=255) == "paged"  # shorter prompts: not measured
    # an engine step of several runs of lengths (an SDPA call each): 4,096 tokens a row first
    assert _choose(columns=1024, runs=2) == "paged"
    assert _choose(columns=4096, runs=9) == "dense"
    assert _choose(dtype=torch.float16) == "paged"
    assert _choose(head_dim=64) == "paged"
    assert _choose(padded=True) == "paged"  # a mask, not is_causal: not measured
    assert _choose(window=4096) == "paged"
    assert _choose(kv_dtype="fp8_e4m3") == "paged"
    assert _choose(precision=PrecisionMode.FP32_SAFE) == "paged"
    assert _choose(fresh=False) == "paged"  # a cached prefix is read through the table
    assert _choose(fresh=False, setting="dense") == "paged"
    assert _choose(columns=16, padded=True, setting="dense") == "dense"
    assert _choose(setting="paged") == "paged"
    cpu = torch.device("cpu")
    assert _choose(device=cpu, columns=7, padded=True, window=3) == "dense"
    assert _choose(device=cpu, kv_dtype="fp8_e4m3") == "paged"


def test_the_setting_is_validated_by_name():
    assert load_config().kv.fresh_prefill == "auto"
    assert load_config(fresh_prefill="Dense").kv.fresh_prefill == "dense"
    with pytest.raises(ValueError, match="kv.fresh_prefill: 'sdpa' is not allowed; allowed: auto"):
        load_config(kv={"fresh_prefill": "sdpa"})
    with pytest.raises(ValueError, match="kv.fresh_prefill: 1 is not a string"):
        load_config(fresh_prefill=1)
    with pytest.raises(ValueError, match="PagedKVCore: fresh_prefill 'on' is not allowed"):
        PagedKVCore(1, fresh_prefill="on")


def test_the_setting_comes_from_oxygen_conf(monkeypatch):
    monkeypatch.setenv("OXYGEN_CONF", "kv.fresh_prefill:paged")
    cfg = load_config()
    assert cfg.kv.fresh_prefill == "paged" and cfg.sources["kv.fresh_prefill"] == "OXYGEN_CONF"
