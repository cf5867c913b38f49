"""The ``oxygen`` torch.compile backend: attention rewritten to oxygen ops, the rest to Inductor.

    torch.compile(model, backend="oxygen", options={"precision": "auto_mixed"})
    torch.compile(model, backend="oxygen", mode="reduce-overhead")

Steps per Dynamo graph: validate the options (ValueError naming the option), rewrite attention
(passes.py), join linear layers on one input whose weights are adjacent in memory into one GEMM
(linear_cat.py), report what was left (warning, or UnsupportedAttentionError with
fallback="error"), compile with Inductor's `compile_fx` (options["inductor"] as config patches),
and with mode="reduce-overhead" on CUDA wrap the result in our CUDA-graph runner (cudagraphs.py).
"""

from __future__ import annotations

import warnings

import torch
from torch.fx import GraphModule

from . import linear_cat
from .cudagraphs import GraphRunner, mutated_inputs
from .options import CompileOptions
from .passes import rewrite_attention
from .stats import GraphReport, record

NAME = "oxygen"
CPU_REDUCE_OVERHEAD = "mode=reduce-overhead on CPU: no CUDA graphs, compiled as mode=default"


class UnsupportedAttentionError(RuntimeError):
    """fallback="error" and an attention could not be rewritten."""


class AttentionLeftWarning(UserWarning):
    """fallback="warn" (default) and an attention was left to run as written."""


def _report_left(report: GraphReport, opts: CompileOptions) -> None:
    if not report.left:
        return
    lines = "\n".join(f"  {x.pattern} at {x.where}: {x.reason}" for x in report.left)
    msg = f"oxygen backend left {len(report.left)} attention(s) as written:\n{lines}"
    if opts.fallback == "error":
        raise UnsupportedAttentionError(msg + "\n(fallback='error'; use 'warn' to run them)")
    warnings.warn(msg, AttentionLeftWarning, stacklevel=2)


def _on_cuda(example_inputs) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == "cuda" for x in example_inputs)


def _inductor(gm: GraphModule, example_inputs, config_patches: dict | None):
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=config_patches)


# What compiles the rewritten graph. Tests of the passes swap in AOTAutograd + eager execution
# (torch._dynamo.backends.debugging.aot_eager): Inductor's C++ build on a CI CPU costs ~10-60 s
# per graph, while the ops still go through AOT tracing, functionalization and fake kernels.
final_compiler = _inductor


def compile_graph(gm: GraphModule, example_inputs, opts: CompileOptions):
    """Compiles one Dynamo graph with validated options."""
    report = rewrite_attention(gm, opts)
    linear_cat.rewrite(gm, example_inputs)  # (weights laid out adjacent: one GEMM a group)
    cuda = _on_cuda(example_inputs)
    graphs = opts.mode == "reduce-overhead" and cuda
    if opts.mode == "reduce-overhead" and not cuda:
        report.notes.append(CPU_REDUCE_OVERHEAD)
    record(report)
    _report_left(report, opts)
    patches = dict(opts.inductor)
    mutated = mutated_inputs(gm) if graphs else frozenset()  # before compile_fx takes gm over
    if graphs:
        # our runner captures; Inductor's graph trees fail under a pluggable allocator
        patches["triton.cudagraphs"] = False
    compiled = final_compiler(gm, example_inputs, patches or None)
    return GraphRunner(compiled, mutated) if graphs else compiled


def oxygen_backend(
    gm: GraphModule, example_inputs, mode: str | None = None, options: dict | None = None
):
    """The function registered as backend "oxygen" (torch.compile passes mode/options)."""
    return compile_graph(gm, example_inputs, CompileOptions.from_user(options, mode))


def make_backend(options: dict | None = None, mode: str | None = None):
    """A backend callable with its options validated now rather than at the first call:
    ``torch.compile(model, backend=make_backend({"precision": "fp32_safe"}))``."""
    opts = CompileOptions.from_user(options, mode)

    def oxygen_configured(gm: GraphModule, example_inputs):
        return compile_graph(gm, example_inputs, opts)

    return oxygen_configured


def register() -> None:
    """Registers backend "oxygen" with Dynamo; safe to call more than once."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if _COMPILER_FNS.get(NAME) is None:
        _COMPILER_FNS.pop(NAME, None)
        register_backend(oxygen_backend, name=NAME)
