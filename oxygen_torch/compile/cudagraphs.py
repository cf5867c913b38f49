"""mode="reduce-overhead": the oxygen backend captures its own CUDA graphs.

Why not Inductor's: PyTorch's CUDA-graph trees need `checkPoolLiveAllocations`, which a global
CUDAPluggableAllocator does not implement (torch 2.11, measured on the H200), and HF's static-cache
generate failed with Inductor's older non-tree graphs even on the default allocator. So Inductor
compiles without graphs and `GraphRunner` wraps the compiled callable:

- one graph per input signature (shapes, strides, dtypes, and the addresses of static inputs):
  a decode step at a given batch size is one graph; with dynamic shapes each batch-size/length
  bucket gets its own, up to MAX_GRAPHS (oldest dropped first);
- the first call of a signature runs plainly (warm-up: Triton compiles, lazy inits); the second
  captures with `torch.cuda.graph` (its own private memory pool, which the oxygen allocator
  serves from a capture arena) and replays;
- static inputs (parameters, buffers, tensors marked with torch._dynamo.mark_static_address such
  as HF's static cache) are used in place: the graph reads and writes their memory, and a new
  address means a new signature; other tensor inputs are copied into the graph's buffers before
  each replay and, when the graph mutates them, copied back after it;
- outputs are cloned after each replay (unless they alias a static input), so a result stays
  valid after the next call, unlike plain CUDA-graph outputs.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import warnings
from collections import OrderedDict

import torch
from torch.fx import GraphModule, Node

from .stats import count_cuda_graph

MAX_GRAPHS = 32
_VIEW_METHODS = frozenset(
    "view reshape transpose permute __getitem__ select narrow unsqueeze squeeze expand as_strided "
    "flatten unflatten t view_as expand_as split chunk unbind diagonal movedim swapaxes detach "
    "unfold real imag contiguous".split()
)
_VIEW_FUNCS = (
    operator.getitem,
    torch.transpose,
    torch.reshape,
    torch.narrow,
    torch.select,
    torch.unsqueeze,
    torch.squeeze,
    torch.permute,
    torch.flatten,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.movedim,
    torch.swapaxes,
    torch.as_strided,
    torch.diagonal,
    torch.t,
    torch.detach,
)
_INPLACE_FUNCS = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv)


def _dense(t: torch.Tensor) -> bool:
    """No two elements share memory and none is skipped (a permuted contiguous tensor)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def is_static(t: torch.Tensor) -> bool:
    return isinstance(t, torch.nn.Parameter) or hasattr(t, "_dynamo_static_input_type")


def _base_placeholder(x) -> Node | None:
    while isinstance(x, Node):
        if x.op == "placeholder":
            return x
        view = (x.op == "call_method" and x.target in _VIEW_METHODS) or (
            x.op == "call_function" and x.target in _VIEW_FUNCS
        )
        if not view or not x.args:
            return None
        x = x.args[0]
    return None


def _written_args(node: Node) -> list:
    """Arguments `node` may write to (conservative: extra ones only cost a copy)."""
    t = node.target
    out = [node.kwargs["out"]] if "out" in node.kwargs else []
    if node.op == "call_method" and isinstance(t, str):
        if t.endswith("_") and not t.startswith("__") or t in ("__setitem__", "__iadd__"):
            out.append(node.args[0])
    elif node.op == "call_function":
        if t in _INPLACE_FUNCS or getattr(t, "__name__", "").endswith("_"):
            out.append(node.args[0])
        op = t.default if isinstance(t, torch._ops.OpOverloadPacket) else t
        if isinstance(op, torch._ops.OpOverload):
            for i, a in enumerate(op._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    out.append(node.args[i] if i < len(node.args) else node.kwargs.get(a.name))
    return out


def mutated_inputs(gm: GraphModule) -> frozenset[int]:
    """Indices of the placeholders the graph may write to (through views too)."""
    index = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}
    hit = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_method", "call_function"):
            continue
        for arg in _written_args(node):
            base = _base_placeholder(arg)
            if base is not None:
                hit.add(index[base])
    return frozenset(hit)


class CaptureError(RuntimeError):
    """A strict runner's capture failed after its warm-up call had run: carries that result."""

    def __init__(self, result):
        super().__init__("CUDA-graph capture failed")
        self.result = result


class RerunGraph:
    """Stands in for a CUDA graph on CPU: a replay runs the captured call again and writes its
    outputs into the captured ones, as a replayed graph rewrites its buffers (the decode graphs'
    bookkeeping is tested this way on machines without a GPU)."""

    def __init__(self):
        self.call = None
        self.outs: list = []
        self.replays = 0

    def record(self, fn, args, outputs) -> None:
        self.call, self.outs = (fn, args), _flat(outputs)

    def replay(self) -> None:
        fn, args = self.call
        for old, new in zip(self.outs, _flat(fn(*args))):
            if isinstance(old, torch.Tensor):
                old.copy_(new)
        self.replays += 1


class _Captured:
    def __init__(self, graph, static_args, outputs, alias_static):
        self.graph = graph
        self.static_args = static_args  # inputs as the graph sees them
        self.outputs = outputs
        self.alias_static = alias_static  # per output: aliases a static input (return as is)


class GraphRunner:
    """Calls `fn` through CUDA graphs captured per input signature (module docstring). The one
    CUDA-graph runner: the backend's mode="reduce-overhead" and generate()'s decode graphs.

    warm_capture: capture in the call that warms up (its result is the warm-up's), for a call
    that may run twice (a decode step writes the same K/V to the same slots); `between()` runs
    after that warm-up, before the capture. strict: a failed capture raises CaptureError
    carrying the warm-up's result, instead of warning and running that signature plainly.
    copy_out: a replay returns copies of the graph's outputs; False, the output tensors
    themselves (the next replay rewrites them: for a caller that queues every use of a result
    on the replay's stream before it replays again, and whose graph has its own memory pool).
    device_type "cpu" with no graph_factory: RerunGraph stands in for the graph."""

    def __init__(
        self,
        fn,
        mutated: frozenset[int],
        graph_factory=None,
        capture=None,
        device_type: str = "cuda",
        static: frozenset[int] | None = None,
        *,
        warm_capture: bool = False,
        between=None,
        strict: bool = False,
        copy_out: bool = True,
    ):
        self.fn = fn
        self.device_type = device_type
        self.mutated = mutated
        self.static = static  # indices of inputs used in place; None: is_static() decides
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.warm: set[tuple] = set()
        self.plain: set[tuple] = set()  # signatures that cannot be captured
        self.warm_capture, self.between, self.strict = warm_capture, between, strict
        self.copy_out = copy_out
        cpu = device_type != "cuda"
        self._new_graph = graph_factory or (RerunGraph if cpu else torch.cuda.CUDAGraph)
        # thread_local: other threads (the pool's refill thread) may keep calling CUDA meanwhile
        self._capture_ctx = capture or (
            (lambda graph: contextlib.nullcontext())
            if cpu
            else functools.partial(torch.cuda.graph, capture_error_mode="thread_local")
        )

    def __call__(self, *args):
        key = self._key(args)
        if key is None or key in self.plain:
            return self.fn(*args)
        if self.device_type == "cuda" and torch.cuda.is_current_stream_capturing():
            return self.fn(*args)  # inside someone else's capture (a decode graph)
        g = self.graphs.get(key)
        if g is not None:
            self.graphs.move_to_end(key)
            return self._replay(g, args)
        warm = None
        if key not in self.warm or self.warm_capture:
            self.warm.add(key)
            warm = self.fn(*args)
            if not self.warm_capture:
                return warm
            if self.between is not None:
                self.between()
        if len(self.graphs) >= MAX_GRAPHS:
            self.graphs.popitem(last=False)
        try:
            g = self._capture(args)
        except Exception as err:  # an op that cannot be captured: run this signature plainly
            self.plain.add(key)
            count_cuda_graph("skipped")
            if self.strict:
                raise CaptureError(warm) from err
            warnings.warn(
                f"oxygen backend: CUDA-graph capture failed, running without a "
                f"graph for this input signature: {err}",
                stacklevel=2,
            )
            return warm if self.warm_capture else self.fn(*args)
        self.graphs[key] = g
        count_cuda_graph("captured")
        return warm if self.warm_capture else self._replay(g, args)

    def _key(self, args) -> tuple | None:
        """The signature; None when nothing is on CUDA or an input cannot be copied in."""
        key, cuda = [], False
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                cuda |= a.device.type == self.device_type
                static = self._static(i, a)
                if not static and not _dense(a):
                    return None  # expanded/overlapping: no static buffer can stand in for it
                ptr = a.data_ptr() if static else None
                key.append((tuple(a.shape), a.stride(), a.dtype, a.device, ptr))
            elif isinstance(a, (int, float, bool, str, type(None))):
                key.append(a)
            else:
                key.append(type(a).__name__)
        return tuple(key) if cuda else None

    def _static(self, i: int, a: torch.Tensor) -> bool:
        return is_static(a) if self.static is None else i in self.static

    def _capture(self, args) -> _Captured:
        static_args = [
            a
            if not isinstance(a, torch.Tensor) or self._static(i, a)
            else torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device).copy_(a)
            for i, a in enumerate(args)
        ]
        graph = self._new_graph()
        if self.device_type == "cuda":
            torch.cuda.synchronize()
        with self._capture_ctx(graph):
            outputs = self.fn(*static_args)
        if hasattr(graph, "record"):  # the CPU stand-in
            graph.record(self.fn, static_args, outputs)
        static_ptrs = {
            a.untyped_storage().data_ptr()
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and self._static(i, a)
        }
        alias = [
            isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in static_ptrs
            for o in _flat(outputs)
        ]
        return _Captured(graph, static_args, outputs, alias)

    def _replay(self, g: _Captured, args):
        for a, s in zip(args, g.static_args):
            if isinstance(a, torch.Tensor) and s is not a:
                s.copy_(a)
        g.graph.replay()
        for i in self.mutated:
            a, s = args[i], g.static_args[i]
            if isinstance(a, torch.Tensor) and s is not a:
                a.copy_(s)
        count_cuda_graph("replayed")
        if not self.copy_out:
            return g.outputs
        outs = [
            o.clone() if isinstance(o, torch.Tensor) and not alias else o
            for o, alias in zip(_flat(g.outputs), g.alias_static)
        ]
        return type(g.outputs)(outs) if isinstance(g.outputs, (list, tuple)) else outs[0]


def _flat(outputs) -> list:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def inductor_cudagraphify(model, inputs, static_input_idxs=(), **_):
    """Stands in for Inductor's non-tree `cudagraphify_impl` while the oxygen pool is PyTorch's
    allocator (allocator.enable patches it in; CUDA-graph trees cannot run there). Inductor's
    own version captures once, with its first inputs, and returns the graph's output tensors
    themselves, which the next replay overwrites: HF's static-cache generate() hit a
    device-side assert with it on the H200, with or without oxygen's pool. This one is
    GraphRunner: a graph per input signature, outputs cloned.

    model: Inductor's boxed callable (takes a list and clears it); returns the same kind."""
    del inputs  # GraphRunner warms up and captures on the calls that follow
    # Inductor keeps graphs whose inputs are mutated out of non-tree CUDA graphs
    runner = GraphRunner(
        lambda *args: model(list(args)), frozenset(), static=frozenset(static_input_idxs)
    )

    def run(new_inputs: list):
        args = list(new_inputs)
        new_inputs.clear()
        return runner(*args)

    return run
