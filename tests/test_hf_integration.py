"""enable_hf / apply / disable_hf: what they switch, what they leave alone, and restoring it."""

import copy
import gc
import logging

import pytest
import torch
import transformers as T
from test_hf_generate import COMMON  # the tiny model shape shared by the HF tests
from transformers import AttentionInterface, DynamicCache, GenerationMixin, StaticCache
from transformers.masking_utils import AttentionMaskInterface

from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import PagedKVCache
from oxygen_torch.integrations.hf import generate as gen
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.kv.storage import KVStorage

STOCK_GENERATE = GenerationMixin.generate
CFG = load_config(kv={"block_tokens": 16, "arena_bytes": 0, "debug_checks": False})


def llama(seed=0, **kw):
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, **kw)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


IDS = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(1))


def greedy(model, **kw):
    with torch.no_grad():
        return model.generate(
            IDS, attention_mask=torch.ones_like(IDS), max_new_tokens=8, do_sample=False, **kw
        )


@pytest.fixture
def enabled():
    from oxygen_torch import _patching

    _patching.forget_warnings()  # (a warning said once in an earlier test is said again here)
    hf.enable_hf(CFG)
    yield
    hf.disable_hf()


def test_models_created_after_enable_use_oxygen_and_paged_cache(enabled):
    model = llama()
    assert model.config._attn_implementation == "oxygen"
    out = greedy(model, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, PagedKVCache)
    assert out.past_key_values._core.block_tokens == 16
    stock = llama(attn_implementation="sdpa")  # an explicit request is respected
    assert stock.config._attn_implementation == "sdpa"
    assert torch.equal(out.sequences, greedy(stock))


def test_unsupported_model_keeps_stock_attention_with_one_warning(enabled, caplog):
    cfg = T.Gemma2Config(**COMMON, attn_logit_softcapping=50.0, sliding_window=8)
    with caplog.at_level(logging.WARNING, logger="oxygen_torch"):
        model = T.Gemma2ForCausalLM(cfg)
        T.Gemma2ForCausalLM(cfg)
    stock = "sdpa" if T.Gemma2ForCausalLM._supports_sdpa else "eager"  # 5.24: eager
    assert model.config._attn_implementation == stock
    msgs = [r.getMessage() for r in caplog.records if "soft-capping" in r.getMessage()]
    assert len(msgs) == 1, msgs


def test_user_dynamic_cache_is_respected(enabled):
    model = llama()
    ref = greedy(llama(attn_implementation="sdpa"))
    cache = DynamicCache(config=model.config)
    out = greedy(model, past_key_values=cache, return_dict_in_generate=True)
    assert out.past_key_values is cache and cache.get_seq_length() == 17
    assert torch.equal(out.sequences, ref)
    assert model.config._attn_implementation == "oxygen"  # restored after the call


def test_static_cache_implementation_is_respected(enabled):
    model = llama()
    ref = greedy(llama(attn_implementation="sdpa"), cache_implementation="static")
    out = greedy(model, cache_implementation="static", return_dict_in_generate=True)
    assert isinstance(out.past_key_values, StaticCache)
    assert torch.equal(out.sequences, ref)


def test_static_cache_decode_compiles_through_the_oxygen_backend(enabled, monkeypatch):
    """generate() with a compileable cache asks transformers to compile with backend "oxygen"
    on a GPU unless the caller set a compile_config (transformers compiles only on GPUs, so the
    call is watched here; the decision itself is checked directly)."""
    from transformers import CompileConfig

    seen = []
    real = gen.oxygen_compile_config
    monkeypatch.setattr(gen, "oxygen_compile_config", lambda *a: seen.append((a, real(*a))) or None)
    model = llama()
    greedy(model, cache_implementation="static")
    (call, cache, device), decided = seen[0]
    assert len(seen) == 1 and cache == "static" and device == "cpu"
    assert decided is None  # nothing compiles on the CPU: left alone

    cc = real(call, cache, "cuda")
    assert cc.backend == "oxygen" and cc.mode == "reduce-overhead"
    static = StaticCache(config=model.config, max_cache_len=32)
    assert real(gen._Call(model, (), {}), static, "cuda").backend == "oxygen"
    mine = CompileConfig(backend="inductor", mode="default")
    assert real(gen._Call(model, (), {"compile_config": mine}), static, "cuda") is None
    assert real(gen._Call(model, (), {"disable_compile": True}), static, "cuda") is None
    assert real(gen._Call(model, (), {}), DynamicCache(), "cuda") is None


def test_output_attentions_falls_back_to_stock(enabled):
    model = llama()
    out = greedy(model, output_attentions=True, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, DynamicCache)
    assert torch.equal(out.sequences, greedy(llama(attn_implementation="sdpa")))


def test_paged_cache_under_stock_attention_stores_and_returns_dense_history():
    model = llama(attn_implementation="sdpa")
    ids = IDS.clone()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
        cache = PagedKVCache(config=model.config, backing="torch")
        got = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, past_key_values=cache
        )
    assert torch.equal(got, ref)


def test_forward_without_cache_on_oxygen_model(enabled):
    model = llama()
    stock = llama(attn_implementation="sdpa")
    mask = torch.ones_like(IDS)
    mask[1, :4] = 0
    with torch.no_grad():
        a = model(IDS, attention_mask=mask, use_cache=False).logits
        b = stock(IDS, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(a, b)


def test_deepcopy_forks_a_prompt_cache(enabled):
    model = llama()
    prompt = IDS[:1]
    with torch.no_grad():
        cache = PagedKVCache(config=model.config)
        model(prompt, past_key_values=cache)
        used = cache._core.pool.manager.num_used
        outs = []
        for tail in ([5, 6], [7, 8, 9]):
            ids = torch.cat([prompt, torch.tensor([tail])], 1)
            fork = copy.deepcopy(cache)
            outs.append(
                model.generate(ids, past_key_values=fork, max_new_tokens=4, do_sample=False)
            )
        assert cache._core.pool.manager.num_used >= used
        stock = llama(attn_implementation="sdpa")
        for out, tail in zip(outs, ([5, 6], [7, 8, 9])):
            ids = torch.cat([prompt, torch.tensor([tail])], 1)
            assert torch.equal(out, stock.generate(ids, max_new_tokens=4, do_sample=False))


def test_blocks_are_freed_when_generate_returns(enabled):
    model = llama()
    greedy(model)
    gc.collect()
    with torch.no_grad():
        cache = PagedKVCache(config=model.config)
        model(IDS, past_key_values=cache)
    manager = cache._core.pool.manager
    del cache
    gc.collect()
    before = manager.num_used
    greedy(model)
    gc.collect()
    assert manager.num_used == before


def test_debug_mode_checks_blocks_before_launches(enabled, monkeypatch):
    calls = []
    orig = KVStorage.check_blocks
    monkeypatch.setattr(KVStorage, "check_blocks", lambda self, t: (calls.append(1), orig(self, t)))
    monkeypatch.setenv("OXYGEN_DEBUG_KV", "1")
    greedy(llama())
    assert calls


def test_disable_restores_stock(enabled):
    model = llama()
    before = llama(attn_implementation="sdpa")
    hf.apply(before)
    assert before.config._attn_implementation == "oxygen"
    hf.disable_hf()
    assert model.config._attn_implementation == "sdpa"
    assert before.config._attn_implementation == "sdpa"
    assert "oxygen" not in AttentionInterface._global_mapping
    assert "oxygen" not in AttentionMaskInterface._global_mapping
    assert GenerationMixin.generate is STOCK_GENERATE
    assert llama().config._attn_implementation == "sdpa"
    out = greedy(model, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, DynamicCache)
