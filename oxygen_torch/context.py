"""The state of the forward step running on this thread, in one object (nano-vllm's context).

A model's forward on the paged cache crosses transformers' code between oxygen's pieces: the
cache's ``get_mask_sizes`` runs before the mask function, ``update`` before the attention function,
and a decode graph's compiled ``oxygen::paged_step`` long after the Python forward that set it up.
What one piece leaves for the next lives here, per thread (a forward runs on one thread), and
nowhere else: never in the model, its config or a module global that other threads read.

- ``mask_for``: the paged cache whose mask is being built (``get_mask_sizes`` -> mask function);
- ``pending``: the K/V a paged cache's ``update`` handed to the attention function;
- ``lent``: the core whose decode-graph step runs (what ``oxygen::paged_step`` reads and writes);
- ``TRACING`` (a module global, so compiled code guards on it): some thread is inside
  ``tracing()``, a decode graph's forward being traced by torch.compile or its compiled code
  replayed. It stays True while any thread is inside (a count): a thread that left must not
  clear it under another's replay, whose guard would then fail and recompile without it.

The multi-task engine's batched step is one forward too: its core is the batch's, so the same
fields serve a step that carries several generate() calls' tokens.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass
from typing import Any

import torch

TRACING = False
_tracers = 0  # threads' tracing() contexts open (TRACING: any)
_tracers_lock = threading.Lock()


@dataclass
class _Pending:
    cache: Any
    layer: int
    key: torch.Tensor
    value: torch.Tensor


class StepContext(threading.local):
    def __init__(self):
        self.mask_for: tuple[Any, int, int] | None = None  # (cache, q_length, kv_length)
        self.pending: _Pending | None = None
        self.lent: Any = None


_ctx = StepContext()


def current() -> StepContext:
    return _ctx


def begin_forward() -> None:
    """A forward on the paged cache starts on this thread: what an interrupted one left (a mask
    mark, K/V handed over but never attended) is forgotten."""
    _ctx.mask_for = _ctx.pending = None


# --- tracing ---------------------------------------------------------------------------------


@contextlib.contextmanager
def tracing():
    """Within: torch.compile traces the forward of a decode-graph step (or replays its compiled
    code, which guards on TRACING). Any thread's, nested or not: TRACING is True until the last
    one open ends."""
    global TRACING, _tracers
    with _tracers_lock:
        _tracers += 1
        TRACING = True
    try:
        yield
    finally:
        with _tracers_lock:
            _tracers = max(_tracers - 1, 0)  # (0 after a fork inside one: _forget_tracers)
            TRACING = _tracers > 0


def _forget_tracers() -> None:
    """After fork: the child's one thread is inside none of the parent's other threads'
    tracing() (one of its own, if it forked inside it, ends at a count of 0, not below)."""
    global TRACING, _tracers, _tracers_lock
    _tracers_lock = threading.Lock()
    _tracers, TRACING = 0, False


def is_tracing() -> bool:
    """Whether the code running is a decode-graph step being traced by torch.compile.

    Every "compiling?" check of ours asks ``torch.compiler.is_dynamo_compiling()``: Dynamo folds
    it to True in the code it traces, and eagerly it is False on every thread. Since torch 2.13
    ``torch.compiler.is_compiling()`` reads a process-wide flag held True through a whole compile
    on any thread, and an eager forward on another thread took the compiled branch."""
    return TRACING and torch.compiler.is_dynamo_compiling()


# --- mask: get_mask_sizes -> mask function ---------------------------------------------------


def mark_mask(cache: Any, q_length: int, kv_length: int) -> None:
    _ctx.mask_for = (cache, q_length, kv_length)


def take_mask(q_length: int, kv_length: int) -> Any:
    """The paged cache whose mask of these sizes is being built, or None (any other cache)."""
    mark, _ctx.mask_for = _ctx.mask_for, None
    if mark is None or mark[1:] != (q_length, kv_length):
        return None
    return mark[0]


# --- K/V: update -> attention ----------------------------------------------------------------


def hand_over(cache: Any, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    if _ctx.pending is not None:
        _ctx.pending = None
        raise RuntimeError(
            "PagedKVCache: the previous update() was not consumed by oxygen attention (the model "
            "bypasses the attention interface); not supported"
        )
    _ctx.pending = _Pending(cache, layer, key, value)


def take_pending(key: torch.Tensor) -> _Pending | None:
    """What update() handed over for this `key`, or None (the forward is not on a paged cache)."""
    pending, _ctx.pending = _ctx.pending, None
    if pending is None:
        return None
    if pending.key is not key:
        raise RuntimeError(
            "oxygen attention: the keys given to attention are not the ones PagedKVCache.update "
            "returned (the model transforms K/V after the cache update); this architecture is "
            "not supported by oxygen attention"
        )
    return pending


# --- decode-graph steps ----------------------------------------------------------------------


def lend(core: Any) -> None:
    _ctx.lent = core


def lent_core() -> Any:
    """The core whose decode-graph step runs on this thread: what oxygen::paged_step uses."""
    if _ctx.lent is None:
        raise RuntimeError(
            "oxygen::paged_step runs only inside a decode-graph step of a PagedKVCache "
            "(PagedKVCore.lend); none is running on this thread"
        )
    return _ctx.lent


def forget(core: Any) -> None:
    """This thread's step of `core` is over (done, or failed: the thread must not keep the core
    alive nor hand it to a later oxygen::paged_step)."""
    if _ctx.lent is core:
        _ctx.lent = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_tracers)
