"""PagedKVCache: a transformers `Cache` whose K/V live in oxygen's paged pool.

With oxygen attention (`config._attn_implementation == "oxygen"`), `update()` only hands the new
K/V to the attention function, which stores them (it knows which tokens are padding, from the
mask) and attends over the block table. With any other attention implementation `update()`
stores them itself and returns the whole history densely, as DynamicCache does.

All layers share one block table, so batch operations (beam reorder, crop, repeat) act once on
the core, not per layer. For the same reason the blocks behind a sliding window are given back
only when every layer is a sliding-window layer with one window (`uniform_window`); a hybrid
model narrows them instead: its sliding layers' pages go, its full-attention layers keep the
blocks (`hybrid_window`, kv.hybrid_windows; kv/window.py).
"""

from __future__ import annotations

import weakref
from types import SimpleNamespace
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ... import context
from ...config import OxygenConfig, load_config
from ...config.profiles import get_profile
from ...kv.attention import tiles_for
from ...kv.core import PagedKVCore
from ...triton_kernels.precision import PrecisionMode
from .compat import layer_types


def uniform_window(text_config, types: list[str]) -> int | None:
    """The sliding window every layer attends with, or None: some layer is not a sliding one
    (a hybrid model: see hybrid_window) or there is no layer."""
    window = getattr(text_config, "sliding_window", None) if text_config is not None else None
    if not types or not window or any(t != "sliding_attention" for t in types):
        return None
    return int(window)


def hybrid_window(text_config, types: list[str]) -> tuple[int | None, tuple[int, ...]]:
    """A hybrid model's sliding window and its sliding layers (some layers slide, the others
    see every token): the blocks behind the window are narrowed (kv/window.py). (None, ()) for
    any other model."""
    window = getattr(text_config, "sliding_window", None) if text_config is not None else None
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not window or not layers or len(layers) == len(types):
        return None, ()
    return int(window), layers


class OxygenDisabledError(RuntimeError):
    """oxygen_torch.disable() ran while a generate() call was running on oxygen's paged cache
    (or the model's attention was switched away from oxygen under it)."""


DISABLED = (
    "oxygen_torch.disable() ran while this generate() call was running on oxygen's paged KV "
    "cache (or the model's attention was switched away from oxygen under it): its K/V are kept "
    "for oxygen attention, which is gone, so the call cannot go on. Run it again (on stock "
    "transformers now), or call disable() once no generate() is running"
)


class PagedLayer(CacheLayerMixin):
    """Per-layer face of PagedKVCache; the data and the batch operations live in the core."""

    is_croppable = True

    def __init__(self, cache: PagedKVCache, layer_idx: int, is_sliding: bool):
        super().__init__()
        self._cache_ref = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.is_sliding = is_sliding

    @property
    def _core(self) -> PagedKVCore:
        return self._cache_ref()._core

    def lazy_initialization(self, key_states, value_states) -> None:
        pass  # the core binds to a pool on its first write

    def update(self, key_states, value_states, *args, **kwargs):
        return self._cache_ref().update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache_ref().get_mask_sizes(query_length, self.layer_idx)

    def get_seq_length(self) -> int:
        return self._core.length

    def get_max_length(self) -> int:
        return -1

    @property
    def is_initialized(self) -> bool:  # noqa: D401 - property replaces the base attribute
        return self._core.pool is not None

    @is_initialized.setter
    def is_initialized(self, value) -> None:
        pass


class PagedKVCache(Cache):
    """A transformers Cache over oxygen's paged KV pool (see the module docstring).

    config: the (text) model config; gives the number of layers and which are sliding.
    cfg: the OxygenConfig (kv.*, pool.page_size, kernel.precision); default: ``load_config()``
    (OXYGEN_CONF, OXYGEN_CONFIG_FILE, the defaults). generate() passes the model's.
    kv_dtype: overrides cfg's kv.kv_dtype ("auto", or "fp8_e4m3": K/V stored as e4m3 codes with
    one fp32 scale per block and kv head; half the bytes of bf16). precision: overrides
    cfg's kernel.precision. cfg's kv.fresh_prefill chooses how a prefill with no cached prefix
    attends (kv/fresh.py).
    """

    def __init__(
        self,
        config: Any = None,
        *,
        num_layers: int | None = None,
        cfg: OxygenConfig | None = None,
        backing: str = "auto",
        block_tokens: int | None = None,
        kv_dtype: str | None = None,
        precision: Any = None,
    ):
        cfg = cfg if cfg is not None else load_config()
        text = self._text_config(config)
        types = self._layer_types(text, num_layers)
        self.cfg = cfg
        self._config = config
        self._any_sliding = any(t != "full_attention" for t in types)
        narrow, window_layers = hybrid_window(text, types) if cfg.kv.hybrid_windows else (None, ())
        self._core = PagedKVCore(
            len(types),
            block_tokens=block_tokens or cfg.kv.block_tokens,
            backing=backing,
            arena_bytes=cfg.kv.arena_bytes,
            page_size=cfg.pool.page_size,
            debug=cfg.kv.debug_checks,
            precision=PrecisionMode.parse(
                precision if precision is not None else cfg.kernel.precision
            ),
            kv_dtype=kv_dtype or cfg.kv.kv_dtype,
            tiles=tiles_for(cfg.kernel, self._profile(config, cfg)),
            fresh_prefill=cfg.kv.fresh_prefill,
            window=uniform_window(text, types),
            narrow_window=narrow,
            window_layers=window_layers,
        )
        self.max_cache_len_hint = 0  # tokens generate() may reach (sizes decode graphs)
        self.compile_options = None  # backend "oxygen" options of the call (compile_config)
        self.merge = None  # (Merger, Call) while a generate() on this cache is registered
        self._on_oxygen = False  # stored K/V for oxygen attention (no dense read-back after)
        self.prefix_prompt = None  # the prompt the prefix cache saw (integrations/hf/prefix.py)
        layers = [PagedLayer(self, i, t != "full_attention") for i, t in enumerate(types)]
        super().__init__(layers=layers)
        self._finalizer = weakref.finalize(self, self._core.release)

    @staticmethod
    def _profile(config, cfg: OxygenConfig):
        """The model family's profile (the `optimizations:` block of the config file over the
        built-ins), by the model's model_type; None without a config."""
        mtype = getattr(config, "model_type", None) if config is not None else None
        return get_profile(mtype, cfg.profiles) if mtype else None

    @staticmethod
    def _text_config(config):
        if config is not None and hasattr(config, "get_text_config"):
            return config.get_text_config(decoder=True)
        return config

    @staticmethod
    def _layer_types(text, num_layers) -> list[str]:
        if text is not None:
            return layer_types(text)
        if num_layers is None:
            raise ValueError("PagedKVCache: pass the model config (or num_layers)")
        return ["full_attention"] * num_layers

    # --- what the model calls -------------------------------------------------------------

    def _deferred(self) -> bool:
        return getattr(self._config, "_attn_implementation", None) == "oxygen"

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"PagedKVCache: layer {layer_idx} of {len(self.layers)}")
        if self._deferred():
            self._on_oxygen = True
            if torch.compiler.is_dynamo_compiling():
                if not context.TRACING:
                    raise NotImplementedError(
                        "PagedKVCache under torch.compile: generate() on the paged cache "
                        "compiles and captures its decode steps itself (kv.decode_graphs); "
                        "leave the model's forward uncompiled, or pass a StaticCache"
                    )
                return key_states, value_states  # oxygen::paged_step stores them
            context.hand_over(self, layer_idx, key_states, value_states)
            return key_states, value_states
        if self._on_oxygen:  # the model left oxygen attention under it: disable()
            raise OxygenDisabledError(DISABLED)
        # dense read-back: every block stays whole (kv/window.py)
        self._core.window = self._core.narrow_window = None
        self._core.write(layer_idx, key_states, value_states)
        return self._core.dense(layer_idx)

    def attend(self, layer_idx: int, query, key, value, mask, *, scaling, sliding_window):
        """Stores the new key/value ([B, Hkv, q, D]) and attends: -> [B, q, Hq, D]."""

        def real_fn():
            real = mask.new_tokens_real() if mask is not None else None
            if real is not None and self._any_sliding:
                self._check_left_padding(real)
            return real

        plan = self._core.write(layer_idx, key, value, real_fn)
        return self._core.attend(
            layer_idx, query, plan, scale=scaling, sliding_window=sliding_window, k=key, v=value
        )

    def _check_left_padding(self, real: torch.Tensor) -> None:
        # Skipping padding keeps distances between real tokens only when all of a sequence's
        # padding comes before its first real token; sliding windows count distances.
        ok = bool((real.to(torch.int8).diff(dim=1) >= 0).all()) if real.shape[1] > 1 else True
        seqs = self._core.seqs
        if ok and seqs is not None:
            ok = all(n == 0 or bool(real[b].all()) for b, n in enumerate(seqs.lens))
        if not ok:
            raise NotImplementedError(
                "oxygen attention: padding after real tokens (right padding or holes) with "
                "sliding-window layers is not supported; pad on the left"
            )

    # --- what generate() calls ------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._core.length

    # In a traced decode-graph step no mask is built and the position comes in as an input:
    # the two give sizes that hold no length, so the compiled step is not specialised on it.
    # Outside a trace, get_mask_sizes is what transformers asks just before it calls the mask
    # function: the step context notes that the mask about to be built is this cache's.
    def get_query_offset(self, layer_idx: int = 0) -> int:
        return 0 if context.is_tracing() else self._core.length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if context.is_tracing():
            return query_length, 0
        kv_length = self._core.length + query_length
        if self._deferred():
            context.mark_mask(self, query_length, kv_length)
        return kv_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self._core.batch_size

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # one host sync per beam step: the host owns the block tables
        self._core.select([int(i) for i in beam_idx.tolist()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        n = self._core.batch_size
        if n > 0:
            self._core.select([i for i in range(n) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._core.select([int(i) for i in torch.as_tensor(indices).tolist()])

    def crop(self, tokens_to_remove: int) -> None:
        tokens_to_remove = int(tokens_to_remove)  # assisted decoding passes a 0-d tensor
        if tokens_to_remove > 0:  # legacy: the absolute length to keep
            tokens_to_remove = max(0, self._core.length - tokens_to_remove)
        else:
            tokens_to_remove = -tokens_to_remove
        self._core.crop(tokens_to_remove)

    def reset(self) -> None:
        self._core.release()

    def activate_past_recording(self, **kwargs) -> None:
        # every token is kept until crop or release: nothing to switch on (5.25 passes
        # recurrent_states_to_keep, for caches of recurrent layers, which this one has none of)
        pass

    def __deepcopy__(self, memo) -> PagedKVCache:
        other = PagedKVCache.__new__(PagedKVCache)
        other.__dict__.update(
            {
                k: v
                for k, v in self.__dict__.items()
                if k not in ("_core", "layers", "_finalizer", "merge", "prefix_prompt")
            }
        )
        other._core = self._core.fork()
        other.layers = [
            PagedLayer(other, i, layer.is_sliding) for i, layer in enumerate(self.layers)
        ]
        other._finalizer = weakref.finalize(other, other._core.release)
        other.merge = None  # a copy is not the registered call's cache
        other.prefix_prompt = None
        return other

    def stats(self) -> SimpleNamespace:
        core = self._core
        return SimpleNamespace(
            length=core.length,
            batch=core.batch_size,
            blocks=core.seqs.num_held() if core.seqs is not None else 0,
            pool=core.pool.stats() if core.pool is not None else None,
        )
