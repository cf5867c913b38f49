"""The model families oxygen attends for besides the seven the other files test in depth
(integration.SUPPORTED_MODEL_TYPES): for each, a tiny random-weight float32 model of that
family's own transformers classes, three greedy generate() calls at once after apply() (left
padding, prompts of different lengths, a sliding window of 8 where the family has one), every
call's tokens equal stock's, on oxygen attention, through the engine (no call on the per-call
path). Families whose configs have no num_key_value_heads (GPT-2, OPT, GPT-NeoX, Persimmon)
have one KV head a query head."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_engine import in_threads
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import oxygen_torch
from oxygen_torch.integrations.hf import integration as hf

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MHA = dict(num_key_value_heads=None, head_dim=None)  # (the config's own: none)
# family -> config fields over COMMON (None: the field left out)
FAMILIES = {
    "phi3": {}, "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(MOE, shared_expert_intermediate_size=32), "qwen3_moe": MOE,
    "olmo": {}, "olmo2": {}, "olmo3": {}, "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "granite": {}, "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "stablelm": {}, "gpt_neox": MHA, "persimmon": MHA, "opt": MHA, "gpt2": MHA,
    "cohere": {}, "cohere2": {}, "phi": {}, "starcoder2": {}, "exaone4": {}, "smollm3": {},
    "glm": {}, "glm4": {}, "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2,
                                            moe_intermediate_size=32, first_k_dense_replace=1),
    "ernie4_5": {}, "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32),
    "seed_oss": {}, "arcee": {}, "apertus": {}, "nemotron": {}, "bitnet": {},
    "ministral": {}, "helium": {},
}  # fmt: skip


def tiny_family(family: str, seed: int = 0, window: int | None = 8, **fields):
    """A tiny random float32 model of `family`: COMMON, then the family's FAMILIES entry, then
    `fields` (None: the field left out); a sliding window of `window` where the config has one
    (None: the config's own)."""
    extra = {**COMMON, **FAMILIES.get(family, {}), **fields}
    config = CONFIG_MAPPING[family](**{k: v for k, v in extra.items() if v is not None})
    has_window = getattr(config, "sliding_window", None) is not None or family == "starcoder2"
    if window is not None and has_window:
        config.sliding_window = window  # (shorter than the prompts: the window cuts)
    torch.manual_seed(seed)
    model = getattr(T, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])(config).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def calls(seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    kws = []
    for i in range(3):
        rows, n = 1 + i % 2, 9 + 4 * i + seed % 3
        ids = torch.randint(3, 128, (rows, n), generator=g)
        mask = torch.ones_like(ids)
        if rows > 1:
            mask[0, : 2 + i] = ids[0, : 2 + i] = 0
        kws.append(dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False))
    return kws


def test_every_family_here_is_in_the_supported_list():
    assert set(FAMILIES) <= set(hf.SUPPORTED_MODEL_TYPES)
    seven = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text"}
    assert set(hf.SUPPORTED_MODEL_TYPES) - set(FAMILIES) == seven  # (the other files test them)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_concurrent_calls_of_a_family_give_stock_tokens(oxygen, family):
    seed = sorted(FAMILIES).index(family)
    model = tiny_family(family, seed)
    kws = calls(seed)
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model)
    assert hf.uses_oxygen(model), family
    per_call = dict(oxygen_torch.engine_stats()["per_call"])  # (every model's, since the start)
    out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
    assert not errors, {i: repr(e) for i, e in errors.items()}
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), (family, i)
    st = oxygen_torch.engine_stats(model)
    assert st["steps"] > 0 and st["per_call"] == per_call, st  # no call of these ran alone


@pytest.mark.parametrize(
    "family, extra, reason",
    [
        ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2), "model type 'gpt_oss'"),
        (
            "deepseek_v3",
            dict(
                n_routed_experts=4,
                num_experts_per_tok=2,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                head_dim=None,
                num_key_value_heads=4,
            ),
            "model type 'deepseek_v3'",
        ),
        ("gemma2", dict(attn_logit_softcapping=50.0), "attention logit soft-capping"),
    ],
)
def test_a_family_left_out_keeps_stock_attention_and_says_why_once(
    oxygen, caplog, family, extra, reason
):
    """apply() leaves the model as it is, warns once naming what is unsupported, and its
    generate() calls (two, at once) give stock's tokens."""
    model = tiny_family(family, 3, None, **extra)
    kws = calls(3)[:2]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    with caplog.at_level("WARNING", logger="oxygen_torch"):
        hf.apply(model)
        hf.apply(model)
    said = [r.getMessage() for r in caplog.records if "keeps stock attention" in r.getMessage()]
    assert len(said) == 1 and reason in said[0], said
    assert not hf.uses_oxygen(model)
    out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
    assert not errors, {i: repr(e) for i, e in errors.items()}
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), (family, i)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "family, head_dim",
    [("phi3", 96), ("gpt2", 64), ("gpt_neox", 80), ("mixtral", 128), ("starcoder2", 64)]
    + [("opt", 64), ("cohere", 128)],
)
def test_a_family_on_the_gpu_gives_stock_tokens(oxygen, family, head_dim):
    """The same on CUDA in float32 (kernel precision fp32_safe; the paged kernels, the decode
    graphs): head sizes of the families' real checkpoints (Phi-3 96, GPT-NeoX 80), KV heads one a
    query head where the config has none; three calls at once, stock's tokens."""
    from oxygen_torch.config import load_config

    shape = dict(hidden_size=4 * head_dim, vocab_size=256)  # 4 query heads
    if FAMILIES[family] is not MHA:
        shape["head_dim"] = head_dim
    model = tiny_family(family, 5, 16, **shape).cuda()
    kws = [
        {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        for kw in calls(7)
    ]
    with torch.no_grad():
        ref = [model.generate(**kw) for kw in kws]
    hf.apply(model, load_config(kernel=dict(precision="fp32_safe")))
    assert hf.uses_oxygen(model)
    out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
    assert not errors, {i: repr(e) for i, e in errors.items()}
    for i, r in enumerate(ref):
        assert torch.equal(out[i], r), (family, i)
    assert oxygen_torch.engine_stats(model)["steps"] > 0
