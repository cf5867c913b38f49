"""Fused kernels inside captured decode graphs (`kv.decode_graph_fusion`).

First choice, `compiled(model, forward)`: the model's whole forward compiled by the "oxygen"
torch.compile backend (fullgraph, static shapes): attention becomes oxygen::paged_step (one
opaque op per layer that stores the step's K/V and attends over the paged cache), everything
else goes to Inductor, which fuses norms, residual adds, rotary and activations around the
GEMMs. If that compile fails (a graph break, an architecture Dynamo cannot trace), the capture
falls back to `fused(model)` below, with one warning.

A replayed decode step costs no host time per kernel, but each kernel still costs the GPU a
couple of microseconds; on a Llama-1.1B shape at batch 16 the eager forward's ~580 small
elementwise kernels a step (RMSNorm's six, rotary's ten, the MLP's activation and product...)
took most of the graph's 2.1 ms (H200). While a decode graph warms up and is captured, the
model's RMSNorm, MLP and rotary-embedding modules and its `apply_rotary_pos_emb` run through
Inductor (`torch.compile`, fullgraph, static shapes): one compiled function per class, shared by
every instance and model, so each becomes a few fused kernels. The graph then replays those.

Only the capture sees the compiled functions: instance attributes on this model's modules and
the modeling module's `apply_rotary_pos_emb`, put back when the capture ends. Eager forwards
never run them. A compile that fails leaves that step unfused, with one warning.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types

import torch

from ... import _patching, context

_SUFFIXES = ("RMSNorm", "MLP", "RotaryEmbedding")  # module classes whose forward is compiled
_ROPE_FN = "apply_rotary_pos_emb"
GROUP = "fuse"
RECOMPILE_LIMIT = 64  # one compile per class and input shape: batch sizes x norm widths

_lock = threading.RLock()
_compiled: dict = {}  # a class's forward (or a module function) -> its torch.compile'd twin
_active = threading.local()  # .depth: inside fused() on this thread


def active() -> bool:
    """Whether this thread is inside `fused` (the graph being captured is fused)."""
    return getattr(_active, "depth", 0) > 0


def _compile(fn):
    c = _compiled.get(fn)
    if c is None:
        c = _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    return c


@contextlib.contextmanager
def compiled(model, forward, core, options=None, dynamic: bool | None = False):
    """Within: yields `forward` compiled whole by backend "oxygen" (module docstring); the
    compile itself happens at the first call. options: the call's CompileOptions (a
    compile_config naming backend "oxygen"), else the core's precision and fallback "error".
    dynamic: torch.compile's (None, an engine's merged graphs: a second batch bucket compiles
    the sizes symbolic, and later buckets reuse it, instead of one compile a bucket).
    One compiled function per forward function, options, `dynamic` and projection layout,
    shared by the models of a class (it holds no model: they stay collectable). The layout is in
    the key because the oxygen backend joins adjacent projections when it compiles
    (compile/linear_cat.py): a model laid out by kernel.fuse_projections reusing a graph compiled
    on a model that was not would run its projections apart, and the other way round each group
    would be run apart by the op's check."""
    from ...compile import make_backend
    from .projections import layout

    if options is None:
        spec = {"precision": core.precision.name.lower(), "fallback": "error"}
    else:  # the decode graph is the CUDA graph: the compile inside it is plain
        spec = {**options.as_dict(), "mode": "default"}
    func = getattr(forward, "__func__", None)
    bound = func is not None and getattr(forward, "__self__", None) is model
    key = (func, "whole", repr(sorted(spec.items())), dynamic, layout(model))
    with _lock:
        fn = _compiled.get(key) if bound else None
        if fn is None:
            fn = torch.compile(
                func if bound else forward,
                backend=make_backend(spec),
                fullgraph=True,
                dynamic=dynamic,
            )
            if bound:  # anything else may hold its model: compiled for this capture only
                _compiled[key] = fn
    with context.tracing(), torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        yield functools.partial(fn, model) if bound else fn


def tries(fuse_on: bool, whole: bool) -> list:
    """The fusions a decode graph's capture tries in turn, (name, context manager) pairs: the
    forward compiled whole (when `whole`), then the modules only; none when not `fuse_on` (the
    capture then takes the eager forward)."""
    if not fuse_on:
        return []
    return ([("compiled", compiled)] if whole else []) + [("modules", fused)]


def fusible(model) -> list[str]:
    """Names of the module classes and functions `fused` compiles for this model."""
    names = {type(m).__name__ for m in model.modules() if type(m).__name__.endswith(_SUFFIXES)}
    for mod in _rope_modules(model):
        names.add(f"{mod.__name__}.{_ROPE_FN}")
    return sorted(names)


def _rope_modules(model) -> list[types.ModuleType]:
    found = {}
    for m in model.modules():
        if type(m).__name__.endswith("Attention"):
            mod = sys.modules.get(type(m).__module__)
            if mod is not None and callable(getattr(mod, _ROPE_FN, None)):
                found[mod.__name__] = mod
    return list(found.values())


@contextlib.contextmanager
def fused(model, forward=None, core=None, options=None, dynamic=False):
    """Within: `model`'s fusible modules and rotary function run compiled (module docstring;
    static shapes whatever `dynamic` says: one compile per class and shape)."""
    why = "a decode graph's capture runs the compiled twin (same math, fused kernels)"
    with _lock:  # one capture at a time: the group below is this capture's
        try:
            for m in model.modules():
                if type(m).__name__.endswith(_SUFFIXES) and "forward" not in m.__dict__:
                    twin = types.MethodType(_compile(type(m).forward), m)
                    _patching.replace(m, "forward", twin, why=why, group=GROUP, weak=True)
            for mod in _rope_modules(model):
                twin = _compile(getattr(mod, _ROPE_FN))
                _patching.replace(mod, _ROPE_FN, twin, why=why, group=GROUP)
            _active.depth = getattr(_active, "depth", 0) + 1
            try:
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    yield forward
            finally:
                _active.depth -= 1
        finally:
            _patching.undo(GROUP)
