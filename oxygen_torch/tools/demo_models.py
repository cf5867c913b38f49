"""Random-weight Llama models for the examples, benchmarks and tests (no download).

LLAMA_1B is the Llama-1.1B shape of every anchor in ../shared/anchors; TINY_LLAMA runs on two CPU
cores in seconds. Both are plain data so a caller can change one field.
"""

from __future__ import annotations

import torch

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32000,
)
TINY_LLAMA = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
)


def random_llama(
    shape: dict = LLAMA_1B,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
    max_position_embeddings: int = 8192,
    init_on_device: bool = False,
    family: str = "llama",
    **config_overrides,
):
    """A LlamaForCausalLM with seeded random weights in eval mode, set up for fixed-length
    generation (pad 0, no EOS, so every run does the same work).

    init_on_device builds the weights on the device (seconds instead of a minute on the host for
    the 1.1B shape); the same seed then gives other weights than a host build. family "mistral":
    a MistralForCausalLM of the same shape (pass sliding_window=W for its window); "qwen2": a
    Qwen2ForCausalLM (pass use_sliding_window=True, sliding_window=W and layer_types for a
    hybrid model)."""
    import transformers as T

    families = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM),
        "mistral": (T.MistralConfig, T.MistralForCausalLM),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
    }
    if family not in families:
        raise ValueError(f"random_llama: family {family!r} is not one of {', '.join(families)}")
    config, causal = families[family]
    cfg = config(**shape, max_position_embeddings=max_position_embeddings, **config_overrides)
    torch.manual_seed(0)
    with torch.device(device if init_on_device else "cpu"):
        model = causal(cfg)
    model = model.to(dtype).to(device).eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model
