"""One GEMM for the linear layers that read the same input (q, k and v; gate and up), when their
weights are adjacent rows of one storage.

A decode step's small projections are latency-bound: on an H100 at 64 rows, q, k and v of the
1B shape took 17.2 us apart and 7.4 us as one GEMM over the three weights concatenated
(benchmarks/bench_linear.py, RESULTS.md). transformers' models call three `nn.Linear`s; the
weights become one GEMM's when they are views of one buffer, in call order
(integrations/hf/projections.py makes them so, `kernel.fuse_projections`).

`rewrite(gm, example_inputs)`, a pass of the oxygen backend on the Dynamo graph: consecutive
`linear(x, w_i[, b_i])` calls on one input whose weights (graph inputs) are adjacent rows of one
storage, in order, and whose biases are all absent or all adjacent too, become one
`oxygen::linear_cat(x, [w_i], [b_i])` and a slice of its output for each. The op checks
adjacency again when it runs (a compiled graph is shared by the models of a class, and another
model's weights need not be laid out so): when they are not, it runs the linears apart and
concatenates their outputs (the same values, slower), counted in `stats()["linear_cat"]`.
"""

from __future__ import annotations

import operator
import threading
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.fx import GraphModule, Node

_LINEARS = (torch._C._nn.linear, F.linear)
_lock = threading.Lock()
_counts: Counter = Counter()  # groups rewritten (by size), calls that ran apart


def adjacent(tensors) -> bool:
    """Whether `tensors` (2-D weights [N_i, K] or 1-D biases [N_i]) are consecutive rows of one
    contiguous storage, in this order, with one dtype and device."""
    first = tensors[0]
    if not all(isinstance(t, Tensor) and type(t) in (Tensor, torch.nn.Parameter) for t in tensors):
        return False  # (subclasses: DTensor, quantized and fake tensors hold no plain storage)
    if any(t.dtype != first.dtype or t.device != first.device or t.dim() != first.dim()
           or not t.is_contiguous() for t in tensors):  # fmt: skip
        return False
    if first.dim() == 2 and any(t.shape[1] != first.shape[1] for t in tensors):
        return False
    if first.dim() not in (1, 2) or first.device.type == "meta":
        return False
    try:
        base = first.untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() != base for t in tensors):
            return False
    except (RuntimeError, NotImplementedError):  # no storage to compare (a functional tensor)
        return False
    at = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != at:
            return False
        at += t.numel() * t.element_size()
    return True


def _joined(tensors: list[Tensor]) -> Tensor:
    """The adjacent tensors as one view: [sum N_i, K] or [sum N_i]."""
    rows = sum(t.shape[0] for t in tensors)
    first = tensors[0]
    if first.dim() == 1:
        return first.as_strided((rows,), (1,))
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


@torch.library.custom_op("oxygen::linear_cat", mutates_args=())
def linear_cat(x: Tensor, weights: list[Tensor], biases: list[Tensor]) -> Tensor:
    """cat([F.linear(x, w_i, b_i)], -1): one GEMM over the weights when they are adjacent
    (module docstring); biases: empty, or one per weight."""
    if biases and len(biases) != len(weights):
        raise ValueError(
            f"oxygen::linear_cat: {len(biases)} biases for {len(weights)} weights "
            "(none, or one each)"
        )
    if adjacent(weights) and (not biases or adjacent(biases)):
        return F.linear(x, _joined(weights), _joined(biases) if biases else None)
    with _lock:
        _counts["ran_apart"] += 1
    parts = [F.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    return torch.cat(parts, dim=-1)


@linear_cat.register_fake
def _linear_cat_fake(x, weights, biases):
    rows = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], rows))


def _args(node: Node):
    """(input, weight, bias) of a linear call node."""
    args = list(node.args) + [None] * (3 - len(node.args))
    x = node.kwargs.get("input", args[0])
    w = node.kwargs.get("weight", args[1])
    b = node.kwargs.get("bias", args[2])
    return x, w, b


def _fusible(group: list[Node], values: dict) -> bool:
    ws = [_args(n)[1] for n in group]
    bs = [_args(n)[2] for n in group]
    if not all(isinstance(w, Node) and w in values for w in ws):
        return False
    if torch.is_grad_enabled() and any(
        values[n].requires_grad for n in ws + bs if isinstance(n, Node) and n in values
    ):  # (a graph that trains: the op has no backward, the linears apart keep theirs)
        return False
    if not adjacent([values[w] for w in ws]):
        return False
    if all(b is None for b in bs):
        return True
    return all(isinstance(b, Node) and b in values for b in bs) and adjacent(
        [values[b] for b in bs]
    )


def rewrite(gm: GraphModule, example_inputs) -> int:
    """The pass (module docstring); returns the groups rewritten."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = {
        n: v for n, v in zip(placeholders, example_inputs) if isinstance(v, Tensor)
    }  # (real tensors: Dynamo hands a backend the inputs it traced with)
    by_input: dict[Node, list[Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _LINEARS:
            x = _args(node)[0]
            if isinstance(x, Node):
                by_input.setdefault(x, []).append(node)
    done = 0
    for nodes in by_input.values():
        i = 0
        while i < len(nodes):
            # the longest run from nodes[i] whose weights follow each other in storage
            j = i + 1
            while j < len(nodes) and _fusible(nodes[i : j + 1], values):
                j += 1
            if j - i >= 2:
                _replace(gm, nodes[i:j], values)
                done += 1
                with _lock:
                    _counts[f"groups_of_{j - i}"] += 1
            i = j
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _replace(gm: GraphModule, group: list[Node], values: dict) -> None:
    x = _args(group[0])[0]
    ws = [_args(n)[1] for n in group]
    bs = [_args(n)[2] for n in group]
    biases = [] if all(b is None for b in bs) else bs
    with gm.graph.inserting_before(group[0]):
        cat = gm.graph.call_function(torch.ops.oxygen.linear_cat.default, (x, ws, biases))
    at = 0
    for node, w in zip(group, ws):
        rows = values[w].shape[0]
        with gm.graph.inserting_before(node):
            part = gm.graph.call_function(operator.getitem, (cat, (Ellipsis, slice(at, at + rows))))
        # (the source line and module stack; not the values: a slice's strides are not the
        # linear's)
        part.meta.update(
            {k: v for k, v in node.meta.items() if k not in ("val", "example_value", "tensor_meta")}
        )
        node.replace_all_uses_with(part)
        gm.graph.erase_node(node)
        at += rows


def stats() -> dict:
    """{"groups_of_N": groups rewritten, "ran_apart": op calls whose weights were not adjacent}
    since the last reset."""
    with _lock:
        return dict(_counts)


def reset() -> None:
    with _lock:
        _counts.clear()
