"""transformers integration: `enable_hf(cfg)`, `disable_hf()`, `apply(model)`.

enable_hf registers the "oxygen" attention and mask functions, makes models created afterwards
default to them (when their architecture is supported), and makes generate() build a
PagedKVCache where it would have built a DynamicCache. A cache the user passes, or another
`cache_implementation` ("static", "offloaded", "quantized"...), is respected: for that call the
model runs on stock SDPA, so transformers' own paths (and its compiled static cache) behave as
without oxygen. disable_hf() undoes all of it, models created in between included.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref

from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface

from ...config import KVConfig
from ...kv.pool import release_pools
from . import graphs as hf_graphs
from .attention import oxygen_attention_forward, oxygen_mask
from .cache import PagedKVCache

log = logging.getLogger("oxygen_torch")

NAME = "oxygen"
STOCK = "sdpa"
# Model families whose attention goes through the interface unchanged (tested in CI).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
KERNEL_HEAD_DIMS = (64, 80, 96, 128, 256)  # triton_kernels._checks.SUPPORTED_HEAD_DIMS

_state = threading.local()  # .switched: configs put back on stock attention for one generate()
_lock = threading.RLock()
_cfg = None
_installed = False  # attention registered + generate hooks in place
_defaulting = False  # new models default to oxygen (enable_hf)
_models: weakref.WeakSet = weakref.WeakSet()  # models switched to oxygen
_warned: set[str] = set()
_orig: dict[str, object] = {}


def active_cfg():
    """The configuration given to enable_hf/apply, else oxygen_torch's active one, else None."""
    if _cfg is not None:
        return _cfg
    try:
        from ... import api

        return api.active_config()
    except ImportError:
        return None


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run on oxygen attention, or None when it can."""
    cfg = model.config
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder models (cross-attention)"
    text = cfg.get_text_config(decoder=True)
    mtype = getattr(text, "model_type", None)
    if mtype not in SUPPORTED_MODEL_TYPES:
        return f"model type {mtype!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
    if getattr(text, "attn_logit_softcapping", None) is not None:
        return "attention logit soft-capping"
    if getattr(text, "attention_chunk_size", None) is not None:
        return "chunked attention"
    if not type(model)._can_set_attn_implementation():
        return "a model that bypasses the attention interface"
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return f"layer types {sorted(kinds)}"
    return None


def _uses_oxygen(model) -> bool:
    text = model.config.get_text_config(decoder=True)
    return getattr(text, "_attn_implementation", None) == NAME


# --- hooks -------------------------------------------------------------------------------


def _get_correct_attn_implementation(self, requested_attention=None, is_init_check=False):
    """New models (no attn_implementation asked) default to oxygen when supported."""
    if requested_attention is None and _defaulting:
        reason = unsupported_reason(self)
        if reason is None:
            _models.add(self)
            requested_attention = NAME
        else:
            _warn_once(
                f"oxygen_torch: {type(self).__name__} keeps stock attention: {reason} "
                "is not supported"
            )
    return _orig["get_correct"](self, requested_attention, is_init_check)


def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
    user_cache = model_kwargs.get("past_key_values")
    out = _orig["prepare_cache"](self, generation_config, model_kwargs, *args, **kwargs)
    if not _uses_oxygen(self):
        return out
    cache = model_kwargs.get("past_key_values")
    default = (
        user_cache is None
        and type(cache) is DynamicCache
        and generation_config.cache_implementation in (None, "dynamic")
        and not generation_config.output_attentions  # paged attention has no weights to give
    )
    text = self.config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    if default and self.device.type == "cuda" and head_dim not in KERNEL_HEAD_DIMS:
        _warn_once(f"oxygen_torch: head_dim {head_dim} has no kernel; stock attention is used")
        default = False
    if default:
        opts, given = _paged_compile_options(generation_config)
        cache = PagedKVCache(
            config=text,
            cfg=active_cfg(),
            kv_dtype=opts.kv_dtype if "kv_dtype" in given else None,
            precision=opts.precision if "precision" in given else None,
        )
        cache.compile_options = opts
        max_len = kwargs.get("max_cache_length", args[2] if len(args) > 2 else 0)
        cache.max_cache_len_hint = int(max_len or 0)
        model_kwargs["past_key_values"] = cache
        hf_graphs.paged_call(self)
    elif cache is not None and not isinstance(cache, PagedKVCache):
        _stock_for_this_call(self)
        compile_through_oxygen(generation_config, cache, self.device.type)
    return out


def _paged_compile_options(generation_config):
    """A compile_config on a generate() that runs on the paged cache: transformers would skip it
    (the cache is not its compileable kind), so it is taken here. Backend "oxygen" configures
    the call: its options set the cache's kv_dtype and precision when given, and the compile of
    the decode graphs (inductor, fallback...). Another backend cannot trace the paged cache:
    one warning, and the decode graphs compile with backend "oxygen" as without it. Returns
    (validated CompileOptions or None, the options the caller gave)."""
    from ...compile import CompileOptions

    cc = generation_config.compile_config
    if cc is None:
        return None, {}
    generation_config.compile_config = None  # this call's copy: transformers skips nothing
    if cc.backend != NAME:
        _warn_once(
            f"oxygen_torch: compile_config backend {cc.backend!r} is not used on the paged "
            'cache; its decode steps are compiled by backend "oxygen" (kv.decode_graphs)'
        )
        return None, {}
    return CompileOptions.from_user(cc.options, cc.mode), dict(cc.options or {})


def compile_through_oxygen(generation_config, cache, device_type: str) -> bool:
    """transformers compiles the decode step of a compileable cache (StaticCache...) on a GPU with
    CompileConfig() -- Inductor, mode "reduce-overhead" -- unless the call names its own
    compile_config. After enable() that default becomes backend "oxygen" (same mode): attention
    rewritten to oxygen's kernels and the backend's own CUDA graphs, which run on the pool. (On
    the H200, inductor's CUDA graphs replayed a device-side assert under the global pluggable
    allocator, and its graph trees need an allocator API the pluggable one lacks.) A
    compile_config the caller sets is kept as it is. Returns whether it changed the config."""
    if (
        device_type != "cuda"
        or generation_config.compile_config is not None
        or generation_config.disable_compile
        or not getattr(cache, "is_compileable", False)
    ):
        return False
    from transformers import CompileConfig

    generation_config.compile_config = CompileConfig(backend="oxygen", mode="reduce-overhead")
    log.info("oxygen_torch: generate() compiles the static-cache decode with backend='oxygen'")
    return True


def prefill_chunk(batch: int, length: int, block_tokens: int, limit: int) -> int | None:
    """Chunk length along the sequence for a batch x length prompt, or None for one pass: chunks
    of about `limit` tokens over the whole batch, never shorter than one KV block."""
    if limit <= 0 or batch * length <= limit:
        return None
    chunk = max(limit // batch, block_tokens)
    return chunk if chunk < length else None


def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
    """A long prompt on the paged cache is prefilled in chunks (transformers' own
    prefill_chunk_size path): the MLP activations of a 64 x 4096-token prompt alone are
    2.75 GiB each, which decided how large a batch fits. Only on a fresh PagedKVCache, and only
    when the caller set no prefill_chunk_size (theirs is kept)."""
    cache = model_kwargs.get("past_key_values")
    chunk = None
    if (
        isinstance(cache, PagedKVCache)
        and generation_config.prefill_chunk_size is None
        and model_kwargs.get("inputs_embeds") is None
        and input_ids.dim() == 2
        and cache.get_seq_length() == 0
    ):
        kv = getattr(active_cfg(), "kv", None)
        limit = getattr(kv, "prefill_chunk_tokens", KVConfig.prefill_chunk_tokens)
        block = getattr(kv, "block_tokens", KVConfig.block_tokens)
        chunk = prefill_chunk(*input_ids.shape, block, limit)
    if chunk is None:
        return _orig["prefill"](self, input_ids, generation_config, model_kwargs, *args, **kwargs)
    log.info("oxygen_torch: prefill of %s tokens in chunks of %d", tuple(input_ids.shape), chunk)
    generation_config.prefill_chunk_size = chunk
    try:
        return _orig["prefill"](self, input_ids, generation_config, model_kwargs, *args, **kwargs)
    finally:
        generation_config.prefill_chunk_size = None


def _stock_for_this_call(model) -> None:
    """Stock SDPA for the rest of this generate() call (restored when it returns)."""
    switched = getattr(_state, "switched", None)
    if switched is None:
        return
    for cfg in {
        id(c): c for c in (model.config, model.config.get_text_config(decoder=True))
    }.values():
        if getattr(cfg, "_attn_implementation_internal", None) == NAME:
            switched.append(cfg)
            cfg._attn_implementation_internal = STOCK


def _generate(self, *args, **kwargs):
    outer = getattr(_state, "switched", None)
    _state.switched = []
    try:
        with hf_graphs.decode_graphs(self):
            return _orig["generate"](self, *args, **kwargs)
    finally:
        for cfg in _state.switched:
            cfg._attn_implementation_internal = NAME
        _state.switched = outer


def _install() -> None:
    """Registers the attention + mask functions and wraps generate() (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return
        AttentionInterface.register(NAME, oxygen_attention_forward)
        AttentionMaskInterface.register(NAME, oxygen_mask)
        _orig["generate"] = GenerationMixin.generate
        _orig["prepare_cache"] = GenerationMixin._prepare_cache_for_generation
        _orig["prefill"] = GenerationMixin._prefill
        GenerationMixin.generate = functools.wraps(_orig["generate"])(_generate)
        GenerationMixin._prepare_cache_for_generation = _prepare_cache_for_generation
        GenerationMixin._prefill = _prefill
        _installed = True


# --- public ------------------------------------------------------------------------------


def is_enabled() -> bool:
    """Whether enable_hf() is in force (new models default to oxygen attention)."""
    return _defaulting


def enable_hf(cfg=None) -> None:
    """Switch the transformers integration on (see the module docstring)."""
    global _cfg, _defaulting
    with _lock:
        _cfg = cfg
        _install()
        if not _defaulting:
            _orig["get_correct"] = PreTrainedModel.get_correct_attn_implementation
            PreTrainedModel.get_correct_attn_implementation = _get_correct_attn_implementation
            _defaulting = True


def apply(model, cfg=None):
    """Switch an existing model to oxygen attention (and paged KV in generate); returns it.

    An unsupported model is left as it is, with one warning naming what is unsupported."""
    global _cfg
    with _lock:
        if cfg is not None:
            _cfg = cfg
        _install()
        reason = unsupported_reason(model)
        if reason is not None:
            _warn_once(
                f"oxygen_torch: {type(model).__name__} keeps stock attention: {reason} "
                "is not supported"
            )
            return model
        model.set_attn_implementation(NAME)
        _models.add(model)
    return model


def disable_hf() -> None:
    """Restore stock transformers: models switched to oxygen go back to SDPA."""
    global _cfg, _installed, _defaulting
    with _lock:
        for model in list(_models):
            if _uses_oxygen(model):
                model.set_attn_implementation(STOCK)
        _models.clear()
        if _defaulting:
            PreTrainedModel.get_correct_attn_implementation = _orig.pop("get_correct")
            _defaulting = False
        if _installed:
            GenerationMixin.generate = _orig.pop("generate")
            GenerationMixin._prepare_cache_for_generation = _orig.pop("prepare_cache")
            GenerationMixin._prefill = _orig.pop("prefill")
            AttentionInterface._global_mapping.pop(NAME, None)
            AttentionMaskInterface._global_mapping.pop(NAME, None)
            _installed = False
        _cfg = None
        hf_graphs.clear()  # graphs read the pools' memory
        release_pools()  # pools still holding a live cache's blocks stay
