"""The engine's front door remembers what it resolved (front._prepare: stock's
_prepare_generation_config keyed by the state it reads; engine_runner._engine_key: which engine
serves a configuration), so hundreds of calls arriving at once do not spend milliseconds each
under the interpreter lock. What it hands back must be what stock resolves for the state of
the moment: after the model's generation config, a given config or the model's config change,
the next call sees the change."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import transformers as T
from test_hf_generate import tiny

from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import engine_runner, front
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf.batched import _geometry
from oxygen_torch.integrations.hf.cache import PagedKVCache

ENGINE = load_config(scheduler={"engine": True})


def stock(model, given, kw):
    """Stock's resolution on copies (it must not see what the memo did to its arguments)."""
    return model._prepare_generation_config(copy.deepcopy(given), **kw)


def settings(rng: random.Random) -> tuple:
    """(a given GenerationConfig or None, keyword arguments) drawn at random."""
    kw = {}
    if rng.random() < 0.5:
        kw["max_new_tokens"] = rng.randint(1, 40)
    if rng.random() < 0.3:
        kw["min_new_tokens"] = rng.randint(0, 40)
    if rng.random() < 0.4:
        kw["do_sample"] = rng.random() < 0.5
        kw["temperature"] = round(rng.uniform(0.1, 2.0), 3)
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([0, 5, 50])
        kw["top_p"] = rng.choice([0.5, 0.9, 1.0])
    if rng.random() < 0.3:
        kw["eos_token_id"] = rng.choice([3, [3, 7]])
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.choice([1.0, 1.3])
    if rng.random() < 0.3:
        kw["attention_mask"] = torch.ones(1, rng.randint(2, 9), dtype=torch.long)
    given = None
    if rng.random() < 0.4:
        given = T.GenerationConfig(max_new_tokens=rng.randint(2, 9), top_k=rng.choice([3, 9]))
    return given, kw


def counting(model):
    """(the calls made, the model's _prepare_generation_config counting them into it)."""
    calls, prepare = [], model._prepare_generation_config

    def counted(given, **kw):
        calls.append(kw)
        return prepare(given, **kw)

    return calls, counted


def same(a, b) -> None:
    (gc_a, kw_a), (gc_b, kw_b) = a, b
    assert gc_a.to_dict() == gc_b.to_dict()
    assert sorted(kw_a) == sorted(kw_b)
    for k in kw_a:
        if torch.is_tensor(kw_a[k]):
            assert kw_b[k] is kw_a[k]  # the call's own mask, not a remembered one
        else:
            assert kw_a[k] == kw_b[k]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_remembered_resolutions_equal_stocks_as_the_configs_change(arch):
    model = tiny(arch)
    prepare = model._prepare_generation_config
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,))))
    drawn = [settings(rng) for _ in range(12)]
    for round_ in range(3):
        for given, kw in drawn + drawn:  # each setting twice: resolved, then remembered
            got = front._prepare(model, prepare, copy.deepcopy(given), kw)
            same(got, stock(model, given, kw))
            got[0].top_k = 123  # the caller's copy: changing it changes no later call
            if isinstance(got[0].eos_token_id, list):
                got[0].eos_token_id.append(99)  # (its lists too)
        # the model's own generation config changes between rounds: every setting follows it
        model.generation_config.top_p = [0.8, 0.95, 0.7][round_]
        model.generation_config.repetition_penalty = 1.0 + round_ / 10
    for given, kw in drawn:  # a given config changed in place is resolved again
        if given is not None:
            given.max_new_tokens += 5
            same(front._prepare(model, prepare, given, kw), stock(model, given, kw))


def test_the_memo_is_bounded():
    model = tiny("llama")
    for n in range(front._MEMO_SIZE + 20):
        front._prepare(model, model._prepare_generation_config, None, {"top_k": n + 1})
    assert len(front._memo[model]) == front._MEMO_SIZE


def test_plain_settings_are_resolved_once_and_values_without_a_key_every_call():
    model = tiny("llama")
    calls, counted = counting(model)

    mask = torch.ones(1, 5, dtype=torch.long)
    for _ in range(3):  # plain values (and a mask, which is the call's own): resolved once
        kw = {"max_new_tokens": 4, "top_k": 7, "attention_mask": mask.clone()}
        same(front._prepare(model, counted, None, kw), stock(model, None, kw))
    assert len(calls) == 1
    kw = {"max_new_tokens": 4, "eos_token_id": torch.tensor([3])}  # a tensor: no key
    for _ in range(3):
        same(front._prepare(model, counted, None, kw), stock(model, None, kw))
    assert len(calls) == 4


def test_lengths_are_not_in_the_key_and_lengths_stock_refuses_are_refused_as_stock():
    model = tiny("llama")
    calls, counted = counting(model)

    rng = random.Random(int(torch.randint(0, 1 << 30, (1,))))
    for _ in range(20):  # every length its own: resolved once per set of names given
        kw = {"max_new_tokens": rng.randint(1, 500), "top_k": 7}
        if rng.random() < 0.5:
            kw["min_new_tokens"] = rng.randint(0, 500)
        got = front._prepare(model, counted, None, kw)
        same(got, stock(model, None, kw))
    assert len(calls) <= 2
    given = T.GenerationConfig(max_new_tokens=5)
    for n in (3, 11):  # a given config's own length, overridden by the call's
        kw = {"max_new_tokens": n}
        same(front._prepare(model, counted, copy.deepcopy(given), kw), stock(model, given, kw))
    for bad in (0, -3, True, 2.0):  # stock's own error (or its own resolution) for each
        kw = {"max_new_tokens": bad, "top_k": 7}
        try:
            want = stock(model, None, kw)
        except ValueError as err:
            with pytest.raises(ValueError) as ours:
                front._prepare(model, counted, None, kw)
            assert str(ours.value) == str(err)
        else:
            same(front._prepare(model, counted, None, kw), want)


def test_a_config_holding_generation_settings_is_refused_as_stock_after_calls_that_passed(
    oxygen,
):
    model = tiny("llama")
    ids = torch.randint(3, 128, (1, 6))
    hf.apply(model, ENGINE)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)  # resolved and remembered
    model.config.temperature = 0.5  # the legacy way, which stock refuses
    with pytest.raises(ValueError) as stock_err:
        model._prepare_generation_config(None, max_new_tokens=3, do_sample=False)
    front.REASONS.clear()
    with pytest.raises(ValueError) as ours, torch.no_grad():
        model.generate(ids, max_new_tokens=3, do_sample=False)
    assert str(ours.value) == str(stock_err.value)
    assert front.REASONS == {"settings transformers refuses (ValueError)": 1}


def test_a_changed_generation_config_reaches_the_next_engine_call(oxygen):
    model = tiny("qwen3")
    ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        ref = [model.generate(ids, do_sample=False, max_new_tokens=n) for n in (3, 9)]
    hf.apply(model, ENGINE)
    got = []
    for n in (3, 9):
        model.generation_config.max_new_tokens = n
        with torch.no_grad():
            got.append(model.generate(ids, do_sample=False))
    for r, g in zip(ref, got):
        assert torch.equal(r, g)


def test_the_engine_key_is_a_fresh_probes_for_each_configuration_and_dtype(oxygen):
    model = tiny("llama")
    confs = [ENGINE, load_config(scheduler={"engine": True}, kv={"block_tokens": 32}),
             load_config(scheduler={"engine": True, "max_step_seqs": 7}),
             # a kv.* setting the runner reads and the pool does not: an engine of its own
             load_config(scheduler={"engine": True}, kv={"fresh_prefill": "paged"})]  # fmt: skip

    def probe(cfg):
        core = PagedKVCache(config=model.config.get_text_config(decoder=True), cfg=cfg)._core
        return (core.pool_key(*_geometry(model)), core.precision, core.tiles, cfg.scheduler,
                cfg.kv)  # fmt: skip

    for _ in range(2):
        for cfg in confs:
            assert engine_runner._engine_key(model, cfg) == probe(cfg)
    keys = {engine_runner._engine_key(model, cfg) for cfg in confs}
    assert len(keys) == len(confs)
    model.to(torch.float64)  # another dtype: another pool, another engine
    for cfg in confs:
        assert engine_runner._engine_key(model, cfg) == probe(cfg)
        assert engine_runner._engine_key(model, cfg) not in keys


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_configs_remembered_state_follows_every_change(arch):
    """front._state keeps each config's last key beside its values: after any change (a value
    set, one of another type that compares equal, a list or dict changed in place, a nested
    config's value, an attribute added or removed) it gives what a fresh look gives, and with
    no change the same key as before."""
    model = tiny(arch)
    rng = random.Random(int(torch.randint(0, 1 << 30, (1,))))
    gen_cfg, cfg = model.generation_config, model.config
    gen_cfg.eos_token_id = [3, 7]
    cfg.inner = T.PretrainedConfig(depth=2)  # a nested config (as composite models hold)
    changes = [
        lambda: setattr(gen_cfg, "top_k", rng.randint(1, 99)),
        lambda: setattr(gen_cfg, "do_sample", rng.choice([True, 1, False, 0])),  # == each other
        lambda: gen_cfg.eos_token_id.append(rng.randint(0, 99)),
        lambda: setattr(gen_cfg, "custom_field", rng.random()),
        lambda: gen_cfg.__dict__.pop("custom_field", None),
        lambda: cfg.id2label.update({rng.randint(0, 9): "x"}),
        lambda: setattr(cfg, "rope_theta", float(rng.randint(1, 10**6))),
    ]
    changes.append(lambda: setattr(cfg.inner, "depth", rng.randint(1, 9)))
    for obj in (gen_cfg, cfg):
        front._state(obj)  # (kept)
    gen_cfg.do_sample = False
    key = front._state(gen_cfg)
    gen_cfg.do_sample = 0  # equal, of another type: another key
    assert front._state(gen_cfg) != key
    for _ in range(40):
        before = {id(o): front._state(o) for o in (gen_cfg, cfg)}
        rng.choice(changes)()
        for obj in (gen_cfg, cfg):
            fresh = front._state_of(vars(obj))[0]
            assert front._state(obj) == fresh
            assert front._state(obj) == fresh  # (again, from what was kept)
        moved = [before[id(o)] != front._state(o) for o in (gen_cfg, cfg)]
        assert moved == [before[id(o)] != front._state_of(vars(o))[0] for o in (gen_cfg, cfg)]
    assert front._state(gen_cfg) is front._state(gen_cfg)  # unchanged: the kept key itself
