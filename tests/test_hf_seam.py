"""The seam to transformers: per-call decisions under threads, layouts oxygen does not know, models
left on stock attention, per-model configuration, and disable() putting back every attribute."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
import transformers as T
from test_hf_integration import llama
from transformers import DynamicCache, PreTrainedModel, StaticCache

import oxygen_torch
from oxygen_torch import _patching
from oxygen_torch.compile import inductor
from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import PagedKVCache, compat
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.pool import route


def prompt(seed, b=2, n=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (b, n), generator=g)
    mask = torch.ones_like(ids)
    mask[0, : seed % 4] = 0  # left padding, different per seed
    return ids, mask


def greedy(model, ids, mask, new=6, **kw):
    with torch.no_grad():
        return model.generate(
            ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
            return_dict_in_generate=True, **kw,
        )  # fmt: skip


@pytest.fixture
def enabled():
    _patching.forget_warnings()
    hf.enable_hf(load_config())
    yield
    hf.disable_hf()


# --- threads on one model ----------------------------------------------------------------------

KINDS = ("paged", "dynamic", "static")


def _call(model, kind, ids, mask):
    if kind == "dynamic":
        name = compat.cache_arg(type(model))  # cache= from transformers 5.24, else past_key_values=
        return greedy(model, ids, mask, **{name: DynamicCache(config=model.config)})
    if kind == "static":
        return greedy(model, ids, mask, cache_implementation="static")
    return greedy(model, ids, mask)


def test_threads_on_one_model_each_get_the_cache_and_attention_they_asked_for(enabled):
    """Before the seam, a call with its own cache switched the shared config to sdpa for itself:
    the paged thread then raised (sdpa given an OxygenMask) or silently got a DynamicCache."""
    model = llama()
    stock = llama(attn_implementation="sdpa")
    seeds = list(range(6))
    ref = {s: greedy(stock, *prompt(s)).sequences for s in seeds}
    want = {"paged": PagedKVCache, "dynamic": DynamicCache, "static": StaticCache}
    errors, done = [], []
    barrier = threading.Barrier(6)

    def worker(t):
        kind = KINDS[t % 3]
        barrier.wait()
        for r in range(8):
            s = seeds[(t + r) % len(seeds)]
            try:
                out = _call(model, kind, *prompt(s))
                got = compat.output_cache(out)
                assert isinstance(got, want[kind]), (kind, type(got).__name__)
                assert torch.equal(out.sequences, ref[s]), (kind, s)
                done.append(kind)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(f"{kind} seed {s}: {err!r}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors[:5]
    assert len(done) == 48
    assert model.config._attn_implementation == "oxygen"  # nothing was switched for a call


# --- layouts oxygen does not know ---------------------------------------------------------------


def test_a_forward_without_a_known_cache_argument_warns_once_and_runs_stock(
    enabled, monkeypatch, caplog
):
    monkeypatch.setattr(compat, "CACHE_ARGS", ("kv_state",))  # a future rename, planted
    compat.cache_arg.cache_clear()
    try:
        model = llama()
        ref = greedy(llama(attn_implementation="sdpa"), *prompt(1))
        with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
            outs = [greedy(model, *prompt(1)) for _ in range(2)]
    finally:
        compat.cache_arg.cache_clear()
    msgs = [r.getMessage() for r in caplog.records if "takes none of kv_state" in r.getMessage()]
    assert len(msgs) == 1 and f"transformers {T.__version__}" in msgs[0], msgs
    for out in outs:
        assert isinstance(out.past_key_values, DynamicCache)  # (both versions answer this name)
        assert torch.equal(out.sequences, ref.sequences)


def test_a_missing_entry_point_warns_naming_the_version_and_the_fix(monkeypatch, caplog):
    _patching.forget_warnings()
    monkeypatch.delattr(PreTrainedModel, "get_correct_attn_implementation")
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        hf.enable_hf(load_config())
    try:
        text = caplog.text
        assert f"transformers {T.__version__} has no" in text
        assert "PreTrainedModel.get_correct_attn_implementation" in text
        assert "oxygen_torch.apply()" in text
        assert not hf.is_enabled()  # new models are not switched: said, not silent
    finally:
        hf.disable_hf()


def test_a_model_not_on_oxygen_says_so_once_and_names_apply(caplog):
    _patching.forget_warnings()
    before = llama()  # created before enable(): stock attention
    hf.enable_hf(load_config())
    try:
        with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
            greedy(before, *prompt(2))
            greedy(before, *prompt(3))
        msgs = [r.getMessage() for r in caplog.records if "not oxygen's" in r.getMessage()]
        assert len(msgs) == 1 and "oxygen_torch.apply(model)" in msgs[0], msgs
        out = greedy(hf.apply(before), *prompt(2))
        assert isinstance(compat.output_cache(out), PagedKVCache)
    finally:
        hf.disable_hf()


# --- configuration per model --------------------------------------------------------------------


def test_apply_with_overrides_configures_that_model_only():
    oxygen_torch.enable(block_tokens=32)
    try:
        a, b = llama(seed=1), llama(seed=2)
        oxygen_torch.apply(a, block_tokens=64)
        ca = compat.output_cache(greedy(a, *prompt(4)))
        cb = compat.output_cache(greedy(b, *prompt(4)))
        assert ca._core.block_tokens == 64 and cb._core.block_tokens == 32
    finally:
        oxygen_torch.disable()


def test_pool_route_reads_the_configuration_sources_enable_reads(monkeypatch):
    """`with oxygen_torch.pool():` before any enable() takes OXYGEN_CONF as enable() would."""
    seen = []
    monkeypatch.setenv("OXYGEN_CONF", "pool.hysteresis_ms:7.5")
    monkeypatch.setattr(route._route, "configured", False)
    monkeypatch.setattr(route, "_configure", seen.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(route, "_pluggable", lambda: type("P", (), {"allocator": lambda s: 0})())
    monkeypatch.setattr(torch.cuda, "MemPool", lambda allocator: object())
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda mp, device: _null())
    with oxygen_torch.pool():
        pass
    route._route.pools.clear()
    assert [c.hysteresis_ms for c in seen] == [7.5]


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# --- disable() puts back every attribute ---------------------------------------------------------


def _targets():
    """(owner, name) of every attribute or registry entry enable() and a generate() replace."""
    model = llama()
    oxygen_torch.enable()
    route._patch_torch()  # the allocator's patches (on a GPU enable() installs them itself)
    inductor.attach()
    try:
        hf.apply(model)
        greedy(model, *prompt(5))
        found = [(p.owner, p.name, p.item) for p in _patching.applied()]
    finally:
        inductor.detach()
        route._unpatch_torch()
        oxygen_torch.disable()
    return model, found


_ABSENT = object()


def _value(owner, name, item):
    """What owner.name is (for a class: its own entry, so an inherited attribute stays so)."""
    if item:
        return owner.get(name, _ABSENT)
    if isinstance(owner, type):
        return owner.__dict__.get(name, _ABSENT)
    return getattr(owner, name, _ABSENT)


def test_disable_puts_back_every_patched_attribute():
    model, targets = _targets()
    groups = {"allocator", "compile", "transformers"}
    assert {getattr(o, "__name__", "") for o, *_ in targets} >= {"GenerationMixin", "CUDAGraph"}
    assert len(targets) >= 12, targets
    snapshot = [(o, n, i, _value(o, n, i)) for o, n, i in targets]
    oxygen_torch.enable()
    route._patch_torch()
    inductor.attach()
    hf.apply(model)
    greedy(model, *prompt(6))
    assert {p.group for p in _patching.applied()} >= groups
    assert any(_value(o, n, i) is not v for o, n, i, v in snapshot)  # something was replaced
    inductor.detach()
    route._unpatch_torch()
    oxygen_torch.disable()
    changed = [f"{o!r}.{n}" for o, n, i, v in snapshot if _value(o, n, i) is not v]
    assert not changed, changed
    assert not _patching.applied()
    assert type(model).__call__ is torch.nn.Module.__call__ and "oxygen" not in str(
        T.AttentionInterface._global_mapping.keys()
    )
