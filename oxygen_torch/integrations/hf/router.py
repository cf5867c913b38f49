"""A model's call while oxygen is on: installed once per model class, deciding per call.

Nothing about one call is ever written into the model: other threads run the same model at the
same time, and the model's own attributes (its forward, a ``model.compile()``) stay what the user
made them. Instead the model's class gets, once, through the patch module, a ``__call__`` that
chooses by each call's own arguments:

- a call on a PagedKVCache: a one-token step goes through a decode graph (graphs.py) where it
  can; anything else runs the model's uncompiled forward. A compile the user put on the forward
  (``model.forward = torch.compile(...)`` or ``model.compile()``) is not used for that call (one
  warning): the cache's host bookkeeping would break the graph at every layer and recompile
  every step. The decode graphs are compiled by backend "oxygen".
- any other call (a DynamicCache, a StaticCache, no cache, someone's trace): ``nn.Module``'s own
  ``__call__``, exactly as without oxygen.
"""

from __future__ import annotations

import threading

import torch

from ... import _patching, context
from ...kv.block_manager import KVCacheFull
from . import compat, graphs
from .cache import DISABLED, OxygenDisabledError, PagedKVCache

GROUP = "transformers"
_MODULE_CALL = torch.nn.Module.__call__
_USER_COMPILED = (
    "oxygen_torch: the model's forward is compiled by torch.compile; on the paged cache "
    "generate() runs it uncompiled, and captures the decode steps compiled by backend "
    '"oxygen" in CUDA graphs where it can (kv.decode_graphs). Pass a StaticCache to run your '
    "compiled forward as it is."
)
_lock = threading.Lock()
_disables = 0  # disable() calls so far (note_disable)


def _compiled(fn) -> bool:
    return getattr(fn, "_torchdynamo_orig_callable", None) is not None


def _model_call(self, *args, **kw):
    """The model class's __call__ while oxygen is on (see the module docstring)."""
    if not torch.compiler.is_dynamo_compiling():
        name, cache = compat.cache_entry(kw)
        if isinstance(cache, PagedKVCache):
            return _paged_call(self, name, cache, args, kw)
    return _MODULE_CALL(self, *args, **kw)


def _paged_call(model, name: str, cache: PagedKVCache, args: tuple, kw: dict):
    """A forward on the paged cache. One that disable() ran under (it switched the model back
    to stock attention while the layers ran) may have mixed the two: it fails, clearly."""
    seen = _disables
    try:
        out = _route(model, name, cache, args, kw)
    except Exception as err:
        if _disables != seen:
            raise OxygenDisabledError(DISABLED) from err
        raise
    if _disables != seen:
        raise OxygenDisabledError(DISABLED)
    return out


def note_disable() -> None:
    """disable() starts: the paged forwards running now end in OxygenDisabledError."""
    global _disables
    with _lock:
        _disables += 1


def _route(model, name: str, cache: PagedKVCache, args: tuple, kw: dict):
    context.begin_forward()
    own = model.__dict__.get("forward")
    if model.__dict__.get("_compiled_call_impl") is not None or _compiled(own):
        _patching.warn_once(_USER_COMPILED)
    hooks = bool(model._forward_hooks or model._forward_pre_hooks)
    wrapped = own is not None and not _compiled(own)
    merge = getattr(cache, "merge", None)
    if merge is not None:  # a generate() registered with the model's step scheduler
        merger, call = merge
        alone = None
        if merger.coordinated:  # tensor parallel: run where rank 0 puts it, maybe on another thread
            grad = torch.is_grad_enabled()

            def alone():
                merger.record_alone(cache, kw, args)  # its tokens, for a recompute
                context.begin_forward()
                with torch.set_grad_enabled(grad):
                    return _alone(model, name, cache, args, kw, own, hooks, wrapped)

        if not (hooks or wrapped) and merger.wanted(kw, args):  # (a merged step skips both)
            return merger.forward(call, name, cache, kw, alone)
        if alone is not None:  # a step of its own
            return merger.solo(call, alone)
        try:
            out = _alone(model, name, cache, args, kw, own, hooks, wrapped)
        except KVCacheFull:
            # the only live call runs its forwards by itself, with no KV check and no
            # preemption; a call that entered meanwhile took the blocks through a merged step.
            # Nothing was reserved (a core's reservation is all or nothing): the forward goes
            # through the scheduler, which preempts or waits, as a merged forward. Still alone,
            # the call is short of blocks by itself: its error stands (oversubscribe splits it)
            if hooks or wrapped or not merger.wanted(kw, args):
                raise
            return merger.forward(call, name, cache, kw)
        merger.record_alone(cache, kw, args)  # its tokens, read later if a recompute needs them
        return out
    return _alone(model, name, cache, args, kw, own, hooks, wrapped)


def _alone(model, name: str, cache: PagedKVCache, args: tuple, kw: dict, own, hooks, wrapped):
    """The forward on the paged cache run by itself (decode graphs where they apply)."""
    if hooks:
        _patching.warn_once(
            "oxygen_torch: decode steps run without CUDA graphs: the model has forward hooks"
        )
        return _MODULE_CALL(model, *args, **kw)
    if wrapped:
        _patching.warn_once(
            "oxygen_torch: decode steps run without CUDA graphs: the model's forward is replaced "
            f"on the instance ({own!r}: accelerate hooks or a wrapper)"
        )
        return own(*args, **kw)
    forward = own._torchdynamo_orig_callable if own is not None else model.forward
    if not args:
        out = graphs.decode_step(model, forward, kw, cache, name)
        if out is not None:
            return out
    return forward(*args, **kw)


def ensure(model) -> None:
    """Installs the router on `model`'s class unless it is there (idempotent, thread-safe)."""
    cls = type(model)
    if cls.__call__ is _model_call:  # every call after the first: no lock to take
        return
    with _lock:
        if cls.__call__ is _model_call:
            return
        if cls.__call__ is not _MODULE_CALL:
            _patching.warn_once(
                f"oxygen_torch: {cls.__name__} defines its own __call__: its generate() calls "
                "run on the paged cache without decode graphs"
            )
            return
        _patching.replace(
            cls, "__call__", _model_call, group=GROUP,
            why="a call on the paged cache: decode graphs, the user's compile set aside",
        )  # fmt: skip
