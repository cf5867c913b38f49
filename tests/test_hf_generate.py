"""generate() on oxygen attention + PagedKVCache equals stock transformers (SDPA, DynamicCache).

Tiny random-weight models in float32 on CPU (the float64 references run the attention there).
Each test builds the stock answer first, then switches the same model with apply().
"""

import os

import pytest
import torch
import transformers as T

from oxygen_torch.config import load_config
from oxygen_torch.integrations.hf import PagedKVCache, engine_runner
from oxygen_torch.integrations.hf import integration as hf
from oxygen_torch.integrations.hf.generate import prefill_chunk

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=128,
    max_position_embeddings=256,
)
ARCHS = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    # window 8 < prompt 13 + 12 new tokens: the window really cuts
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {"sliding_window": 8}),
    "qwen2": (
        T.Qwen2Config,
        T.Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {}),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, {}),
    "gemma2": (
        T.Gemma2Config,
        T.Gemma2ForCausalLM,
        {"attn_logit_softcapping": None, "sliding_window": 8},
    ),
    "gemma3": (
        T.Gemma3TextConfig,
        T.Gemma3ForCausalLM,
        {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    ),
}


def tiny(arch="llama", seed=0, **overrides):
    """A tiny random model of `arch`; `overrides` go over its config's fields."""
    conf_cls, model_cls, extra = ARCHS[arch]
    extra = {**extra, **overrides}
    torch.manual_seed(seed)
    stock = "sdpa" if model_cls._supports_sdpa else "eager"  # transformers 5.24: gemma2 eager
    model = model_cls(conf_cls(**{**COMMON, **extra}, attn_implementation=stock)).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def batch(b=3, n=13, seed=1, pads=(4, 2, 0)):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (b, n), generator=g)
    mask = torch.ones_like(ids)
    for i, p in enumerate(pads[:b]):
        mask[i, :p] = 0
        ids[i, :p] = 0
    return ids, mask


@pytest.fixture(params=["eager", "graphs"])
def oxygen(request, monkeypatch):
    """Every test twice: decode steps run eagerly, and through the decode-graph bookkeeping
    (kv.cpu_decode_graphs=rerun: on CPU its stand-in for a CUDA graph re-runs the forward on the
    graph's buffers). The setting goes through OXYGEN_CONF, so that every configuration a test
    builds has it, load_config()'s default and the explicit ones alike."""
    if request.param == "graphs":
        given = os.environ.get("OXYGEN_CONF", "")
        entries = [given, "kv.cpu_decode_graphs:rerun"]
        monkeypatch.setenv("OXYGEN_CONF", ",".join(filter(None, entries)))
    yield hf
    hf.disable_hf()


def both(model, fn, cfg=None):
    """fn(model) on stock attention, then on oxygen (apply); returns (stock, oxygen)."""
    with torch.no_grad():
        ref = fn(model)
        hf.apply(model, cfg)
        assert model.config._attn_implementation == "oxygen"
        got = fn(model)
    return ref, got


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_and_logits_with_left_padding(arch, oxygen):
    model = tiny(arch)
    ids, mask = batch()

    def run(m):
        out = m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
        )
        cache = PagedKVCache(config=m.config) if hf.uses_oxygen(m) else None
        logits = m(ids, attention_mask=mask, past_key_values=cache).logits
        return out, logits

    (ref, ref_logits), (got, logits) = both(model, run)
    assert isinstance(got.past_key_values, PagedKVCache)
    assert torch.equal(got.sequences, ref.sequences)
    real = mask.bool()
    err = (logits - ref_logits)[real].abs().max() / ref_logits[real].abs().max()
    assert err < 1e-5, f"{arch}: relative logit error {err:.2e}"


def test_beam_search_with_several_returned(oxygen):
    model = tiny()
    ids, mask = batch(b=2, pads=(3, 0))

    def run(m):
        return m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=10,
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            length_penalty=1.0,
        )

    ref, got = both(model, run)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_sampling_with_fixed_seed_and_num_return_sequences(arch, oxygen):
    model = tiny(arch)
    ids, mask = batch(b=2, pads=(5, 0))

    def run(m):
        torch.manual_seed(123)
        return m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            do_sample=True,
            top_k=20,
            temperature=0.9,
            num_return_sequences=3,
        )

    ref, got = both(model, run, load_config(scheduler={"engine": True}))
    # oxygen draws each row from its own generator (seeded from torch's RNG at the call), so
    # its samples are not stock's; the same seed gives the same tokens again
    with torch.no_grad():
        again = run(model)
    assert got.shape == ref.shape == (6, 25) and torch.equal(got, again)
    assert torch.equal(got[:, :13], ref[:, :13])  # the prompts, padding kept
    # with top_k=20 every drawn token is among the 20 best after the prompt's step (row 0)
    assert len({tuple(r) for r in got[:, 13:].tolist()}) > 1  # rows of a prompt differ


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_continue_from_returned_past_key_values(arch, oxygen):
    model = tiny(arch)
    ids, mask = batch(b=2, pads=(2, 0))
    extra = torch.randint(1, 128, (2, 4), generator=torch.Generator().manual_seed(5))

    def run(m):
        first = m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=5,
            do_sample=False,
            return_dict_in_generate=True,
        )
        ids2 = torch.cat([first.sequences, extra], 1)
        mask2 = torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], 1)
        return m.generate(
            ids2,
            attention_mask=mask2,
            past_key_values=first.past_key_values,
            max_new_tokens=6,
            do_sample=False,
        )

    ref, got = both(model, run)
    assert torch.equal(got, ref)


def test_max_length_stops(oxygen):
    model = tiny()
    ids, mask = batch(b=2, pads=(1, 0))
    ref, got = both(
        model, lambda m: m.generate(ids, attention_mask=mask, max_length=17, do_sample=False)
    )
    assert got.shape == (2, 17) and torch.equal(got, ref)


def test_crop_then_continue(oxygen):
    model = tiny()
    ids, mask = batch(b=2, pads=(0, 0))

    def run(m):
        out = m.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=False,
            return_dict_in_generate=True,
        )
        cache = out.past_key_values
        n = cache.get_seq_length()
        cache.crop(-3)
        assert cache.get_seq_length() == n - 3
        seq = out.sequences[:, : n - 3 + 1]
        return m.generate(
            seq,
            attention_mask=torch.ones_like(seq),
            past_key_values=cache,
            max_new_tokens=5,
            do_sample=False,
        )

    ref, got = both(model, run)
    assert torch.equal(got, ref)


def test_assisted_decoding_crops_the_paged_cache(oxygen):
    model, assistant = tiny(seed=0), tiny(seed=7)
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(3))

    def run(m):
        return m.generate(ids, assistant_model=assistant, max_new_tokens=12, do_sample=False)

    ref, got = both(model, run)
    plain = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, ref) and torch.equal(got, plain)


def input_shapes(model) -> list[tuple[int, int]]:
    """The input_ids shape of every forward the model runs from now on (cleared by the caller)."""
    shapes = []
    model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple((kw.get("input_ids") if a == () else a[0]).shape)),
        with_kwargs=True,
    )
    return shapes


def test_prefill_chunk_rule():
    assert prefill_chunk(16, 512, 16, 16384) is None  # 8192 tokens: one pass
    assert prefill_chunk(64, 4096, 16, 16384) == 256
    assert prefill_chunk(4096, 64, 16, 16384) == 16  # never shorter than a KV block
    assert prefill_chunk(4096, 16, 16, 16384) is None  # one block long already
    assert prefill_chunk(64, 4096, 16, 0) is None  # 0: never chunk


@pytest.mark.parametrize("arch", list(ARCHS))
def test_long_prompt_prefills_in_chunks_with_the_same_tokens(arch, oxygen):
    """Every supported architecture: 3 x 40 prompt tokens over kv.prefill_chunk_tokens=48 are
    prefilled in chunks of 16 positions (three forwards before the first new token), with left
    padding and sliding windows crossing the chunk edges; the tokens equal stock's one-pass
    prefill."""
    model = tiny(arch)
    ids, mask = batch(b=3, n=40, pads=(21, 5, 0))
    # (kv.mixed_graphs 0: the eager forward's steps are what this counts; in the "graphs" runs
    # the steps with prompt tokens would replay mixed-step graphs, their tokens padded to a
    # bucket: tests/test_engine_mixed_graphs.py)
    kv = {"prefill_chunk_tokens": 48, "mixed_graphs": 0}
    cfg = load_config(scheduler={"engine": True}, kv=kv)
    shapes = []

    def record(m, step, ids, *rest):
        shapes.append(tuple(ids.shape))
        return forward(m, step, ids, *rest)

    def run(m):
        shapes.clear()
        return m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          return_dict_in_generate=True)  # fmt: skip

    forward = engine_runner._forward
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_runner, "_forward", record)
        ref = run(model)
        hf.apply(model, cfg)
        got = run(model)
    # the engine packs every row's real tokens into one row of at most 48 tokens a step: the
    # prompts' 19 + 35 + 40 (a chunk of row 1 in the first step beside row 0, the rest in the
    # second beside row 0's first decode), then 5 decode tokens a row (steps of decodes only
    # replay a decode graph in the "graphs" runs: not an eager forward)
    assert all(b == 1 and n <= 48 for b, n in shapes), shapes
    assert [n for _, n in shapes[:2]] == [48, 1 + 6 + 40], shapes
    if cfg.kv.cpu_decode_graphs == "off":
        assert sum(n for _, n in shapes) == 19 + 35 + 40 + 3 * 5, shapes
    assert isinstance(got.past_key_values, PagedKVCache)
    assert torch.equal(got.sequences, ref.sequences)
    assert model.generation_config.prefill_chunk_size is None  # the call's own config only


def test_beam_search_and_returned_sequences_with_chunked_prefill(oxygen):
    """Beams expand the batch before the prefill (2 prompts x 3 beams x 40 tokens > 48): the
    chunked prefill of the expanded batch gives stock's beams and sampled sequences."""
    model = tiny()
    ids, mask = batch(b=2, n=40, pads=(7, 0))
    cfg = load_config(prefill_chunk_tokens=48, scheduler={"engine": True})
    shapes = input_shapes(model)
    beams = dict(max_new_tokens=6, do_sample=False, num_beams=3, num_return_sequences=2)
    sampled = dict(max_new_tokens=6, do_sample=True, num_return_sequences=3)

    def run(m):
        torch.manual_seed(3)
        return [m.generate(ids, attention_mask=mask, **kw) for kw in (beams, sampled)]

    with torch.no_grad():
        ref = run(model)
        hf.apply(model, cfg)
        shapes.clear()
        got = run(model)
    assert shapes[:3] == [(6, 16), (6, 16), (6, 8)], shapes[:4]  # 6 beam rows, in chunks
    assert got[0].shape == (4, 46) and torch.equal(got[0], ref[0])
    # sampled rows run on the engine: each row draws from its own generator (not stock's)
    assert got[1].shape == (6, 46) and torch.equal(got[1][:, :40], ref[1][:, :40])


def test_fp8_kv_cache_generate_stays_close_to_stock(oxygen):
    """kv.kv_dtype=fp8_e4m3: K/V stored as e4m3 codes + block scales; the logits stay within
    e4m3's rounding of stock's, and the greedy tokens agree."""
    from oxygen_torch.kv import pool_stats

    model = tiny()
    ids, mask = batch()
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False)
    kw.update(output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        oxygen.apply(model, load_config(kv={"kv_dtype": "fp8_e4m3"}))
        got = model.generate(ids, **kw)
    assert any(p["dtype"] == "float8_e4m3fn" for p in pool_stats())
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got.logits, ref.logits))
    assert 1e-4 < err < 0.06, err  # quantised (not bitwise stock), within e4m3's 1/16
    agree = (got.sequences[:, 13:] == ref.sequences[:, 13:]).float().mean().item()
    assert agree >= 0.9, agree
