"""`kernel.fuse_projections`: a model's q / k / v and gate / up weights laid out as adjacent rows
of one buffer each, so the oxygen backend runs each group as one GEMM (compile/linear_cat.py).

`make_adjacent(model)` copies each group's weights (and biases) into one new buffer, in the
order the model calls them, and points the parameters at their rows of it (`param.data`): the
same Parameter objects and values, no memory added once the old tensors go (one group's worth
while it runs). transformers' `save_pretrained` clones tensors that share a buffer without
overlapping, so a model laid out so saves and loads as before. Groups whose layers are not plain
`nn.Linear`s of one dtype and device, one input width, all or none with a bias, are left as they
are and counted by reason.

Done once per model, when its first engine is made (integrations/hf/engine_runner.py), before
any of the engine's graphs is captured: a CUDA graph captured on the old tensors would read
freed memory. A model whose single-call decode graphs were captured already is left as it is.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter

import torch
from torch import nn

# sibling names a model's attention and MLP modules give the linears that read one input, in
# the order their forwards call them
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))

_lock = threading.Lock()
_done: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its report


def _why_not(layers: list) -> str | None:
    """Why a group cannot be laid out as one buffer, or None."""
    if not all(type(m) is nn.Linear for m in layers):
        return "not plain nn.Linear layers"
    ws = [m.weight for m in layers]
    if not all(type(w.data) is torch.Tensor for w in ws):
        return "weights that are not plain tensors"
    first = ws[0]
    if any(w.dtype != first.dtype or w.device != first.device for w in ws):
        return "weights of different dtypes or devices"
    if any(w.shape[1] != first.shape[1] for w in ws):
        return "different input widths"
    if len({m.bias is None for m in layers}) != 1:
        return "a bias on some layers only"
    return None


def _join(tensors: list[torch.Tensor]) -> None:
    """Copies `tensors` into one new buffer in order and points each at its rows of it."""
    first = tensors[0]
    rows = sum(t.shape[0] for t in tensors)
    buf = torch.empty((rows, *first.shape[1:]), dtype=first.dtype, device=first.device)
    at = 0
    for t in tensors:
        n = t.shape[0]
        buf[at : at + n].copy_(t.data)
        t.data = buf[at : at + n]
        at += n


def make_adjacent(model: nn.Module) -> Counter:
    """Lays out the model's groups (module docstring); idempotent. Returns a Counter of groups
    "joined", "already adjacent" and the reasons the others were left."""
    from ...compile.linear_cat import adjacent

    with _lock:
        if model in _done:
            return _done[model]
        report: Counter = Counter()
        with torch.no_grad():
            for module in model.modules():
                for names in GROUPS:
                    layers = [getattr(module, n, None) for n in names]
                    if any(m is None for m in layers):
                        continue
                    why = _why_not(layers)
                    if why is not None:
                        report[why] += 1
                        continue
                    weights = [m.weight for m in layers]
                    biases = [m.bias for m in layers if m.bias is not None]
                    if adjacent(weights) and (not biases or adjacent(biases)):
                        report["already adjacent"] += 1
                        continue
                    _join(weights)
                    if biases:
                        _join(biases)
                    report["joined"] += 1
        _done[model] = report
        return report


def report(model: nn.Module) -> Counter | None:
    """What make_adjacent did to `model`, or None when it has not run on it."""
    with _lock:
        return _done.get(model)


def layout(model: nn.Module) -> str:
    """The string "adjacent" when make_adjacent laid out (or found laid out) some group of
    `model`, else "as loaded": compiled forwards are shared per layout (fuse.compiled), since the
    oxygen backend's pass joins a group only when its weights are adjacent at compile time."""
    with _lock:
        done = _done.get(model)
    return "adjacent" if done and (done["joined"] or done["already adjacent"]) else "as loaded"
