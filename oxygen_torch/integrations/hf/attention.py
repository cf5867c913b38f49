"""The "oxygen" attention and mask functions, as transformers calls them.

Which path a forward takes is decided by the forward itself, never by shared state: a forward on
a PagedKVCache marks its mask in the step context (``PagedKVCache.get_mask_sizes`` runs just
before the mask function) and hands its K/V over from ``update``; any other forward (a
DynamicCache, a StaticCache, no cache, HF's compiled static-cache step) gets exactly what stock
SDPA would: ``sdpa_mask`` and ``sdpa_attention_forward``. So two threads on one model, one on the
paged cache and one on its own cache, each get the attention they asked for.

On the paged path the mask function builds nothing: it returns an ``OxygenMask`` that keeps the
arguments. Attention reads only which new tokens are padding (one host sync per prefill, none
per decode step); ``dense()`` gives the exact mask stock SDPA would have got.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from ... import context
from .compat import mask_kind


class OxygenMask:
    """What the mask function returns to the layers of a paged forward: the arguments, unbuilt."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        self.kind = mask_kind(kwargs.get("mask_function", causal_mask_function))
        self.window = kwargs.get("local_size") if self.kind == "sliding" else None
        self._dense = self._real = None
        self._built = self._real_done = False

    def dense(self):
        """The mask stock SDPA gets for the same call (4D bool, or None for is_causal)."""
        if not self._built:
            self._dense, self._built = sdpa_mask(**self.kwargs), True
        return self._dense

    def new_tokens_real(self) -> torch.Tensor | None:
        """Host bool [B, q]: which new tokens are real; None when all are (one sync)."""
        if self._real_done:
            return self._real
        self._real_done = True
        pm = self.kwargs.get("attention_mask")
        if pm is None:
            return None
        end = self.kwargs.get("kv_offset", 0) + self.kwargs["kv_length"]
        real = new_columns(pm, end, self.kwargs["q_length"]).cpu()
        self._real = None if bool(real.all()) else real
        return self._real


def new_columns(padding_mask: torch.Tensor, end: int, q: int) -> torch.Tensor:
    """Bool [B, q]: columns end - q .. end of a 2D padding mask (True = a real token), as
    transformers' prepare_padding_mask reads it: missing columns are padding. On its device."""
    if padding_mask.shape[-1] < end:
        padding_mask = torch.nn.functional.pad(padding_mask, (0, end - padding_mask.shape[-1]))
    return padding_mask[:, end - q : end].to(torch.bool)


def oxygen_mask(**kwargs):
    """Registered with AttentionMaskInterface under "oxygen"."""
    if torch.compiler.is_dynamo_compiling():
        # a decode-graph step reads no mask; any other compiled forward is not on the paged cache
        return None if context.is_tracing() else sdpa_mask(**kwargs)
    if context.take_mask(kwargs["q_length"], kwargs["kv_length"]) is None:
        return sdpa_mask(**kwargs)
    return OxygenMask(kwargs)


def _paged_unsupported(module, mask, dropout, softcap, kwargs) -> str | None:
    if dropout:
        return f"dropout={dropout}"
    if softcap is not None:
        return "attention logit soft-capping"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        return "non-causal attention"
    if kwargs.get("position_bias") is not None or kwargs.get("s_aux") is not None:
        return "attention biases / sinks"
    if mask is not None and not isinstance(mask, OxygenMask):
        return "a custom 4D attention mask"
    if isinstance(mask, OxygenMask) and mask.kind == "custom":
        return "a custom mask pattern (bidirectional, packed or overlaid)"
    return None


def oxygen_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
):
    """Registered with AttentionInterface under "oxygen".

    query: [B, Hq, q, D]; key/value: what the cache's update() returned. Returns ([B, q, Hq, D],
    None) like the stock functions."""
    if torch.compiler.is_dynamo_compiling():
        if not context.is_tracing():  # HF's compiled static-cache step, a user's compile...
            return _stock(module, query, key, value, attention_mask, dropout, scaling, kwargs)
        reason = _paged_unsupported(module, attention_mask, dropout, softcap, kwargs)
        if reason is not None:
            raise NotImplementedError(f"oxygen decode graphs do not support {reason}")
        out = torch.ops.oxygen.paged_step(
            query, key, value, module.layer_idx, scaling, sliding_window or 0
        )
        return out, None
    pending = context.take_pending(key)
    if pending is None:  # not a PagedKVCache (DynamicCache, StaticCache, no cache): stock SDPA
        return _stock(module, query, key, value, attention_mask, dropout, scaling, kwargs)
    reason = _paged_unsupported(module, attention_mask, dropout, softcap, kwargs)
    if reason is not None:
        raise NotImplementedError(
            f"oxygen attention over a PagedKVCache does not support {reason}; call "
            "oxygen_torch.disable() or pass a DynamicCache for this model"
        )
    mask = attention_mask if isinstance(attention_mask, OxygenMask) else None
    window = mask.window if mask is not None and mask.kind == "sliding" else None
    if mask is None:
        window = sliding_window
    elif sliding_window is not None and window != sliding_window:
        raise NotImplementedError(
            f"oxygen attention: layer sliding_window={sliding_window} differs from the mask's "
            f"window {window}"
        )
    out = pending.cache.attend(
        pending.layer, query, pending.key, pending.value, mask, scaling=scaling,
        sliding_window=window,
    )  # fmt: skip
    return out, None


def _stock(module, query, key, value, mask, dropout, scaling, kwargs):
    if isinstance(mask, OxygenMask):  # a paged forward's mask reaching another cache's layer
        mask = mask.dense()
    return sdpa_attention_forward(
        module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
    )
