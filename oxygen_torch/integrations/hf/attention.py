"""The "oxygen" attention function and its mask function, as transformers calls them.

transformers builds masks through the mask function registered under the model's attention
implementation (without one it silently drops the causal mask). Ours builds nothing: it returns an
`OxygenMask` that keeps the arguments. The paged path reads only which new tokens are padding
(one host sync per prefill, none per decode step); any other path asks it for the exact mask
stock SDPA would have got (`dense()`), so falling back never changes an answer.
"""

from __future__ import annotations

import logging

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sdpa_mask

from .cache import take_pending, traced_step

log = logging.getLogger("oxygen_torch")

_SLIDING_PARTS = sorted(["causal_mask_function", "sliding_window_overlay.<locals>.inner_mask"])


def _mask_kind(fn) -> str:
    """'causal', 'sliding' or 'custom' (image-token overlays, packing, bidirectional...)."""
    if fn is causal_mask_function:
        return "causal"
    if getattr(fn, "__qualname__", "") == "and_masks.<locals>.and_mask" and fn.__closure__:
        parts = [c.cell_contents for c in fn.__closure__]
        funcs = next((p for p in parts if isinstance(p, tuple)), ())
        if sorted(getattr(f, "__qualname__", "") for f in funcs) == _SLIDING_PARTS:
            return "sliding"
    return "custom"


class OxygenMask:
    """What the mask function returns to the layers: the arguments of the mask, unbuilt."""

    def __init__(self, kwargs: dict):
        self.kwargs = kwargs
        self.kind = _mask_kind(kwargs.get("mask_function", causal_mask_function))
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
        q = self.kwargs["q_length"]
        end = self.kwargs.get("kv_offset", 0) + self.kwargs["kv_length"]
        if pm.shape[-1] < end:  # as transformers' prepare_padding_mask: missing columns = pad
            pm = torch.nn.functional.pad(pm, (0, end - pm.shape[-1]))
        real = pm[:, end - q : end].to("cpu", torch.bool)
        self._real = None if bool(real.all()) else real
        return self._real


def oxygen_mask(**kwargs) -> OxygenMask | None:
    """Registered with AttentionMaskInterface under "oxygen". None in a traced decode-graph step:
    a decode step reads no mask."""
    return None if traced_step() else OxygenMask(kwargs)


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
    if traced_step():  # a decode graph compiles the forward: one opaque op per layer
        reason = _paged_unsupported(module, attention_mask, dropout, softcap, kwargs)
        if reason is not None:
            raise NotImplementedError(f"oxygen decode graphs do not support {reason}")
        out = torch.ops.oxygen.paged_step(
            query, key, value, module.layer_idx, scaling, sliding_window or 0
        )
        return out, None
    pending = take_pending(key)
    if pending is None:  # not a PagedKVCache (DynamicCache, StaticCache, no cache): stock SDPA
        mask = attention_mask.dense() if isinstance(attention_mask, OxygenMask) else attention_mask
        return sdpa_attention_forward(
            module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs
        )
    cache, layer_idx, key, value = pending
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
    out = cache.attend(layer_idx, query, key, value, mask, scaling=scaling, sliding_window=window)
    return out, None
