"""What the integration knows of transformers' layout, in one place (5.17 to the newest 5.x).

- The generation cache's name: ``past_key_values`` up to 5.23; 5.24 renamed it ``cache`` in
  ``model_kwargs``, in model forwards and in outputs (the old name still works, deprecated). The
  name a model takes is read from its forward's signature, per class.
- The mask function a mask is built from: causal, sliding (causal and a window overlay) or custom
  (packed sequences, bidirectional, overlays). The mask interface is not told which, so the
  function's closure is read; an unknown structure counts as custom (the paged path then refuses
  it with an error that names it: never a silent wrong mask).
- Whether generate()'s repetition penalty skips a row's left padding (it does from some release
  after 5.17, before 5.24: the processor is given each row's padding length); read once from
  generate's own processor builder.
- Private entry points the integration needs but cannot find are reported by
  ``_patching.require`` (one warning naming the transformers version); that part runs stock.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import transformers
from transformers.masking_utils import causal_mask_function

CACHE_ARGS = ("cache", "past_key_values")  # newest first
VERSION = transformers.__version__
_SLIDING_PARTS = sorted(["causal_mask_function", "sliding_window_overlay.<locals>.inner_mask"])


@functools.cache
def cache_arg(model_cls: type) -> str | None:
    """The name under which `model_cls.forward` takes the generation cache (None: neither)."""
    try:
        params = inspect.signature(model_cls.forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in CACHE_ARGS if name in params), None)


def cache_entry(kwargs: dict) -> tuple[str | None, Any]:
    """(name, cache) of the cache a caller passed to generate() or forward() under either name,
    or (None, None)."""
    for name in CACHE_ARGS:
        if kwargs.get(name) is not None:
            return name, kwargs[name]
    return None, None


def given_cache(kwargs: dict) -> Any:
    """The cache a caller passed to generate() or forward() under either name, or None."""
    return cache_entry(kwargs)[1]


def head_dim(text_config) -> int:
    """The attention head size of a (text) model config."""
    return getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads
    )


def local_kv_heads(model, text_config) -> int:
    """The KV heads of `model` on this rank (a config without num_key_value_heads, GPT-2's or
    GPT-NeoX's: one a query head): all of them, or under a tensor-parallel plan
    (`model.tp_size` > 1, public on 5.17 to 5.24) this rank's share, as its k_proj shards them."""
    heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
    tp = getattr(model, "tp_size", None) or 1
    return heads // tp if tp > 1 and heads % tp == 0 else heads


def output_cache(outputs: Any) -> Any:
    """The cache a model output or generate() output carries (either name)."""
    for name in CACHE_ARGS:
        value = outputs.get(name) if hasattr(outputs, "get") else getattr(outputs, name, None)
        if value is not None:
            return value
    return None


def mask_kind(fn) -> str:
    """'causal', 'sliding' or 'custom' for the mask function a mask is built from."""
    if fn is causal_mask_function:
        return "causal"
    if getattr(fn, "__qualname__", "") == "and_masks.<locals>.and_mask" and fn.__closure__:
        parts = [c.cell_contents for c in fn.__closure__]
        funcs = next((p for p in parts if isinstance(p, tuple)), ())
        if sorted(getattr(f, "__qualname__", "") for f in funcs) == _SLIDING_PARTS:
            return "sliding"
    return "custom"


def layer_types(text_config) -> list[str]:
    """The cache layer type of every decoder layer (full_attention, sliding_attention, ...)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(text_config)  # 5.24: per-layer kwargs; unused here
    return list(types)


@functools.cache
def penalty_skips_padding() -> bool:
    """Whether stock generate() leaves a row's left padding out of its repetition penalty (its
    processor builder passes ``prompt_ignore_length``)."""
    from transformers.generation.utils import GenerationMixin

    builder = getattr(GenerationMixin, "_get_logits_processor", None)
    try:
        return builder is not None and "prompt_ignore_length=" in inspect.getsource(builder)
    except (OSError, TypeError):  # no source (a frozen install): the newer rule
        return True
