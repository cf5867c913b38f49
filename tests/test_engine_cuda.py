"""The multi-task engine on the GPU: concurrent generate() calls merged on the paged cache agree
with the same calls run alone (float32: the paged prefill and decode kernels)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from test_engine import call_kw, in_threads, schedulers

from oxygen_torch.integrations.hf import integration as hf

# the per-call path (scheduler.engine=false): tests/test_engine_loop.py tests the engine's
pytestmark = [pytest.mark.cuda, pytest.mark.per_call]

SMALL = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, head_dim=64, vocab_size=128, max_position_embeddings=512,
)  # fmt: skip


def test_merged_calls_on_the_gpu_agree_with_each_call_alone():
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**SMALL)).cuda().eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    hf.apply(model)
    try:
        kws = []
        for s in range(8):
            kw = call_kw(s)
            kw["input_ids"], kw["attention_mask"] = (
                kw["input_ids"].cuda(),
                kw["attention_mask"].cuda(),
            )
            kws.append(kw)
        with torch.no_grad():
            ref = [model.generate(**kw) for kw in kws]
        out, errors = in_threads(lambda kw: model.generate(**kw), [(kw,) for kw in kws])
        assert not errors, errors
        same = sum(torch.equal(out[i], ref[i]) for i in range(len(kws)))
        tokens = sum((out[i] == ref[i]).float().mean().item() for i in range(len(kws))) / len(kws)
        print(
            f"\nmerged vs alone on the GPU: {same}/{len(kws)} calls equal, "
            f"token agreement {tokens:.4f}"
        )
        assert tokens >= 0.9
        (sched,) = schedulers(model)
        assert max(sched.stats.batch_sizes) > 3
    finally:
        hf.disable_hf()
