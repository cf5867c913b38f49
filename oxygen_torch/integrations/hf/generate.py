"""generate() after enable(): the paged cache where transformers would build a DynamicCache.

Through public arguments only, decided per call from the call's own arguments: a PagedKVCache is
passed as the call's cache (``cache=`` from transformers 5.24, ``past_key_values=`` before), a
long prompt gets ``prefill_chunk_size`` (transformers' own chunked prefill), and on a GPU a
compileable cache (StaticCache) gets ``compile_config`` naming backend "oxygen". A cache the
caller passes, another ``cache_implementation``, ``use_cache=False`` or ``output_attentions`` are
respected: that call runs as stock transformers would (its forward on another cache takes stock
SDPA by itself, see attention.py). Nothing is written to the model or its configs.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from ... import _patching
from ...config import OxygenConfig
from ...triton_kernels._checks import SUPPORTED_HEAD_DIMS
from . import compat
from . import prefix as prefix_cache
from .batched import _geometry
from .cache import PagedKVCache

log = logging.getLogger("oxygen_torch")
NAME = "oxygen"


class _Call:
    """The generation options of one call: its kwargs over its generation config. Also what
    the call asks about its model more than once (oversubscribe.judge, then plan, then the
    prefix cache), found once."""

    def __init__(self, model, args: tuple, kwargs: dict):
        self.model, self.kwargs = model, kwargs
        self.base = kwargs.get("generation_config") or model.generation_config
        self.inputs = kwargs.get("inputs", kwargs.get("input_ids", args[0] if args else None))
        self._geometry = self._device_type = None
        self._cache: PagedKVCache | None = None

    def geometry(self) -> tuple:
        """The model's K/V geometry (batched._geometry: what picks its KV pool)."""
        if self._geometry is None:
            self._geometry = _geometry(self.model)
        return self._geometry

    def device_type(self) -> str:
        if self._device_type is None:
            self._device_type = self.model.device.type
        return self._device_type

    def empty_cache(self, cfg: OxygenConfig) -> PagedKVCache:
        """The call's PagedKVCache, still empty (new_cache), made once: judge reads its pool,
        plan gives it to the call."""
        if self._cache is None:
            self._cache = new_cache(self.model, cfg, self)
        return self._cache

    def opt(self, name: str):
        if name in self.kwargs:
            return self.kwargs[name]
        return getattr(self.base, name, None)

    def prompt_shape(self) -> tuple[int, int] | None:
        ids = self.inputs
        if ids is None or getattr(ids, "dim", lambda: 0)() != 2:
            embeds = self.kwargs.get("inputs_embeds")
            return tuple(embeds.shape[:2]) if embeds is not None else None
        return tuple(ids.shape)

    def max_length(self) -> int:
        shape = self.prompt_shape()
        new = self.opt("max_new_tokens")
        if new is not None and shape is not None:
            return shape[1] + new
        return self.opt("max_length") or 0


# Submodules that hold a table of learned absolute positions in transformers' decoder models
# (GPT-2's wpe, OPT / BioGPT / XGLM's embed_positions, ...): a position past the table is an
# index error inside the forward. Rotary and ALiBi models have no such limit (stock runs them on).
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")
_limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its limit or None


def validate(model, call: _Call, host_ids: torch.Tensor | None = None) -> None:
    """Refuses a call whose inputs would fail inside a forward, with a ValueError naming the
    argument and the limit. Checked at the door, before the call is merged with others: a
    forward that raises inside a merged step would fail every call in it.

    input_ids: 2-D [batch, length] of integers, length >= 1, every id in [0, vocab);
    attention_mask: 2-D, its length the prompt's, its rows the batch's (or one, broadcast as
    stock does); prompt length + max_new_tokens within the model's positions where the model
    embeds learned absolute positions. (One host sync: the ids' min and max; none when
    `host_ids`, the ids already read to the host, are given.)"""
    ids, shape = call.inputs, call.prompt_shape()
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(
                f"generate(): input_ids must be [batch, length] with length >= 1; got shape "
                f"{list(ids.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"generate(): input_ids must hold integer token ids; got {ids.dtype}")
        vocab = _vocab_size(model)
        seen = host_ids if host_ids is not None and host_ids.shape == ids.shape else ids
        low, high = (int(v) for v in torch.aminmax(seen))
        if vocab is not None and (low < 0 or high >= vocab):
            bad = low if low < 0 else high
            raise ValueError(
                f"generate(): input_ids holds token id {bad}, outside the model's vocabulary "
                f"[0, {vocab})"
            )
    mask = call.kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and shape is not None:
        if mask.dim() != 2 or mask.shape[1] != shape[1] or mask.shape[0] not in (1, shape[0]):
            raise ValueError(
                f"generate(): attention_mask of shape {list(mask.shape)} does not match the "
                f"prompt's [batch, length] = {list(shape)}"
            )
    limit = _position_limit(model)
    if limit is not None and shape is not None and call.max_length() > limit:
        new, total = call.opt("max_new_tokens"), call.max_length()
        asked = (
            f"prompt length {shape[1]} + max_new_tokens {new} = {total}"
            if new is not None
            else f"max_length {total}"
        )
        raise ValueError(
            f"generate(): {asked} positions; the model embeds at most {limit} "
            "(max_position_embeddings)"
        )


def _vocab_size(model) -> int | None:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(emb, torch.nn.Embedding):
        return emb.num_embeddings
    return getattr(model.config.get_text_config(decoder=True), "vocab_size", None)


def _position_limit(model) -> int | None:
    """The model's positions when it embeds learned absolute ones (a hard limit), else None.
    Found once per model (a walk over its modules)."""
    if model not in _limits:
        limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 0)
        table = any(
            name.rsplit(".", 1)[-1] in _POSITION_TABLES and isinstance(m, torch.nn.Embedding)
            for name, m in model.named_modules()
        )
        _limits[model] = int(limit) if limit and table else None
    return _limits[model]


def prefill_chunk(batch: int, length: int, block_tokens: int, limit: int) -> int | None:
    """Chunk length along the sequence for a batch x length prompt, or None for one pass: chunks
    of about `limit` tokens over the whole batch, never shorter than one KV block."""
    if limit <= 0 or batch * length <= limit:
        return None
    chunk = max(limit // batch, block_tokens)
    return chunk if chunk < length else None


def oxygen_compile_config(call: _Call, cache, device_type: str):
    """transformers compiles the decode step of a compileable cache (StaticCache...) on a GPU with
    CompileConfig() -- Inductor, mode "reduce-overhead" -- unless the call names its own
    compile_config. After enable() that default becomes backend "oxygen" (same mode): attention
    rewritten to oxygen's kernels and the backend's own CUDA graphs, which run on the pool. (On
    the H200, inductor's CUDA graphs replayed a device-side assert under the global pluggable
    allocator, and its graph trees need an allocator API the pluggable one lacks.) `cache`: the
    caller's cache, or the cache_implementation name. Returns the CompileConfig, or None."""
    compileable = (
        getattr(cache, "is_compileable", False)
        if not isinstance(cache, str)
        else cache in ("static", "sliding_window", "hybrid", "hybrid_chunked")
    )
    if (
        device_type != "cuda"
        or call.opt("compile_config") is not None
        or call.opt("disable_compile")
        or not compileable
    ):
        return None
    from transformers import CompileConfig

    log.info("oxygen_torch: generate() compiles the static-cache decode with backend='oxygen'")
    return CompileConfig(backend=NAME, mode="reduce-overhead")


def _paged_compile_options(call: _Call):
    """A compile_config on a generate() that runs on the paged cache (transformers would skip
    it: the cache is not its compileable kind). Backend "oxygen" configures the call: its
    options set the cache's kv_dtype and precision when given, and the compile of the decode
    graphs (inductor, fallback...). Another backend cannot trace the paged cache: one warning.
    Returns (validated CompileOptions or None, the options the caller gave)."""
    from ...compile import CompileOptions

    cc = call.opt("compile_config")
    if cc is None:
        return None, {}
    if cc.backend != NAME:
        _patching.warn_once(
            f"oxygen_torch: compile_config backend {cc.backend!r} is not used on the paged "
            'cache; its decode steps are compiled by backend "oxygen" (kv.decode_graphs)'
        )
        return None, {}
    return CompileOptions.from_user(cc.options, cc.mode), dict(cc.options or {})


def _stock_reason(model, call: _Call) -> str | None:
    """Why this call keeps transformers' own cache (None: it runs on the paged cache)."""
    if call.opt("use_cache") is False:
        return "use_cache=False"
    impl = call.opt("cache_implementation")
    if impl not in (None, "dynamic"):
        return f"cache_implementation={impl!r}"
    if call.opt("output_attentions"):
        return "output_attentions"  # paged attention has no weights to give
    if not getattr(model, "_supports_default_dynamic_cache", lambda: True)():
        return "a model that brings its own cache"
    return None


def plan(model, cfg: OxygenConfig, call: _Call) -> tuple[dict, PagedKVCache | None]:
    """This call's kwargs on oxygen, and the PagedKVCache given to it (None: it runs stock)."""
    kwargs = call.kwargs
    name = compat.cache_arg(type(model))
    device = call.device_type()
    if name is None:
        _patching.warn_once(
            f"oxygen_torch: transformers {compat.VERSION}: {type(model).__name__}.forward takes "
            f"none of {', '.join(compat.CACHE_ARGS)}; generate() runs on transformers' own "
            "cache (this layout is unknown to oxygen_torch)"
        )
        return kwargs, None
    user = compat.given_cache(kwargs)
    if user is not None or _stock_reason(model, call) is not None:
        cc = oxygen_compile_config(call, user or call.opt("cache_implementation"), device)
        return ({**kwargs, "compile_config": cc} if cc is not None else kwargs), None
    text = model.config.get_text_config(decoder=True)
    if device == "cuda" and compat.head_dim(text) not in SUPPORTED_HEAD_DIMS:
        _patching.warn_once(
            f"oxygen_torch: head_dim {compat.head_dim(text)} has no kernel; stock attention is used"
        )
        return kwargs, None
    cache = call.empty_cache(cfg)
    cache.max_cache_len_hint = max(call.max_length() - 1, 0)
    out = {**kwargs, name: cache}
    if call.opt("cache_implementation") == "dynamic":  # ours is the dynamic cache
        out["cache_implementation"] = None
    if call.opt("compile_config") is not None:  # taken here: transformers would only skip it
        out["compile_config"] = None
    cached = _start_on_prefix(model, call, cfg, cache)
    chunk = _chunk(call, cfg, cached)
    if chunk is not None:
        log.info("oxygen_torch: prefill of %s tokens in chunks of %d", call.prompt_shape(), chunk)
        out["prefill_chunk_size"] = chunk
    return out, cache


def new_cache(model, cfg: OxygenConfig, call: _Call) -> PagedKVCache:
    """The (empty) PagedKVCache this call runs on: kv_dtype and precision from its
    compile_config's options when given."""
    opts, given = _paged_compile_options(call)
    cache = PagedKVCache(
        config=model.config.get_text_config(decoder=True),
        cfg=cfg,
        kv_dtype=opts.kv_dtype if "kv_dtype" in given else None,
        precision=opts.precision if "precision" in given else None,
    )
    cache.compile_options = opts
    return cache


def _start_on_prefix(model, call: _Call, cfg: OxygenConfig, cache: PagedKVCache) -> int:
    """The prompt columns the prefix cache gives this call (kv.prefix_cache; 0: none). A
    suffix still long enough to be chunked runs whole: transformers' chunked prefill starts
    from column 0, whatever the cache holds."""
    if not cfg.kv.prefix_cache:
        return 0
    geometry = call.geometry()
    prompt = prefix_cache.prompt_of(model, call, cache, geometry)
    if prompt is None:
        return 0
    cache.prefix_prompt = prompt
    # a row about to give blocks back behind its window keeps its prompt in the cache first
    cache._core.before_drop = functools.partial(prefix_cache.keep_prompt, prompt)

    def chunked(cols: int) -> bool:  # the suffix after `cols` still prefilled in chunks
        return _chunk(call, cfg, cols) is not None

    return prefix_cache.start_on_cache(
        prompt, cache, geometry, chunked=chunked, record=cfg.scheduler.merge
    )


def _chunk(call: _Call, cfg: OxygenConfig, cached: int = 0) -> int | None:
    """A long prompt on the paged cache is prefilled in chunks: the MLP activations of a
    64 x 4096-token prompt alone are 2.75 GiB each, which decided how large a batch fits. A
    prefill_chunk_size the caller set is kept. `cached`: prompt columns the prefix cache gave
    (not computed)."""
    shape = call.prompt_shape()
    if call.opt("prefill_chunk_size") is not None or call.inputs is None or shape is None:
        return None
    expand = max(call.opt("num_beams") or 1, call.opt("num_return_sequences") or 1)
    return prefill_chunk(
        shape[0] * expand, shape[1] - cached, cfg.kv.block_tokens, cfg.kv.prefill_chunk_tokens
    )


def finish(cache: PagedKVCache | None, out) -> None:
    """After a call that returned: its blocks join the prefix cache (when it uses one)."""
    prompt = getattr(cache, "prefix_prompt", None)
    if prompt is not None:
        prefix_cache.keep(prompt, cache, out)


def check_used(model, cache: PagedKVCache | None) -> None:
    """After the call: a paged cache that was never written means transformers did not use it
    (a layout oxygen does not know): say so once, never silently."""
    if cache is not None and cache._core.pool is None:
        _patching.warn_once(
            f"oxygen_torch: transformers {compat.VERSION}: generate() on "
            f"{type(model).__name__} did not use the paged cache it was given; it ran on "
            "transformers' own cache (this layout is unknown to oxygen_torch)"
        )
