"""FX passes of the oxygen backend, run on the Dynamo graph before AOTAutograd and Inductor.

Rewritten to `oxygen::attention` (tiles and precision fixed at compile time):
- `F.scaled_dot_product_attention` / `aten.scaled_dot_product_attention` (is_causal, bool or
  additive attn_mask, enable_gqa, scale; dropout_p must be 0);
- the private `aten._scaled_dot_product_*` ops when only their output is used;
- the hand-written `softmax(q @ k.transpose(-2, -1) * scale (+ mask)) @ v` (matmul_pattern.py);
- `F.multi_head_attention_forward`, which Dynamo keeps as one call (mha.py).
Everything else that looks like attention is left as is and reported with its reason.

Running before AOTAutograd keeps Inductor's own passes and any user passes (pre/post grad custom
passes in torch._inductor.config) untouched, and Inductor's FX graph cache keys on the rewritten
graph, tiles included, so no custom-pass uuid is needed for a correct cache key.
"""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from . import matmul_pattern, mha
from .options import CompileOptions
from .sites import Attn, check, emit, erase_dead, strip_repeat_kv, value, where
from .stats import GraphReport

aten = torch.ops.aten
SDPA_FUNCTIONS = (F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default)
SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attn_mask",
    "dropout_p",
    "is_causal",
    "scale",
    "enable_gqa",
)
SDPA_DEFAULTS = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}
# private SDPA kernels: tuple results, output first
SDPA_PRIVATE = tuple(
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
    )
    if hasattr(aten, name)
)


def bind(node: Node, params: tuple[str, ...], defaults: dict) -> dict:
    """node's args and kwargs by parameter name."""
    out = dict(defaults)
    out.update(zip(params, node.args))
    out.update(node.kwargs)
    return out


def _schema_bind(node: Node) -> dict:
    schema = node.target._schema
    params = tuple(a.name for a in schema.arguments)
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return bind(node, params, defaults)


def _sdpa_attn(b: dict) -> tuple[Attn | None, str | None]:
    """Attn from bound SDPA arguments, or the reason it cannot be one."""
    p = b.get("dropout_p", 0.0)
    if isinstance(p, Node) or p != 0.0:
        return None, f"dropout_p={value(p)} (only 0 is supported)"
    for name in ("is_causal", "enable_gqa"):
        if not isinstance(b.get(name, False), bool):
            return None, f"{name} is not a constant"
    scale = b.get("scale")
    if scale is not None and not isinstance(scale, (int, float)):
        return None, "scale is not a constant"
    mask = b.get("attn_mask", b.get("attn_bias"))
    a = Attn(
        b["query"],
        b["key"],
        b["value"],
        mask,
        b["is_causal"],
        None if scale is None else float(scale),
        b.get("enable_gqa", False),
    )
    return a, None


def _rewrite_sdpa(gm: GraphModule, node: Node, opts, report: GraphReport, private: bool):
    pattern = "aten_sdpa" if private else "sdpa"
    b = (
        _schema_bind(node)
        if isinstance(node.target, torch._ops.OpOverload)
        else bind(node, SDPA_PARAMS, SDPA_DEFAULTS)
    )
    a, reason = _sdpa_attn(b)
    if a is not None and private:
        users = list(node.users)
        if not all(u.target is operator.getitem and u.args[1] == 0 for u in users):
            reason = "uses outputs other than the attention result (logsumexp, rng state)"
    repeats = strip_repeat_kv(a) if reason is None else []
    reason = reason or check(a)
    report.found += 1
    if reason:
        report.leave(pattern, reason, where(node))
        return
    with gm.graph.inserting_before(node):
        out = emit(gm.graph, a, opts, node)
    if private:
        for u in list(node.users):
            u.replace_all_uses_with(out)
            gm.graph.erase_node(u)
    else:
        node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    erase_dead(gm.graph, repeats)
    report.rewritten[pattern] += 1


def _overload(node: Node) -> None:
    """torch.ops.aten.x in a Dynamo graph is the packet; its default overload has the schema."""
    node.target = node.target.default


_OXYGEN_ALREADY = (torch.ops.oxygen.paged_step, torch.ops.oxygen.paged_step.default)


def rewrite_attention(gm: GraphModule, opts: CompileOptions) -> GraphReport:
    """Rewrites gm in place; returns what was found, rewritten and left (with reasons)."""
    report = GraphReport()
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if isinstance(node.target, torch._ops.OpOverloadPacket) and (
            getattr(node.target, "default", None) in SDPA_FUNCTIONS + SDPA_PRIVATE
        ):
            _overload(node)
        if node.target in _OXYGEN_ALREADY:  # the HF integration's decode step: counted as is
            report.found += 1
            report.rewritten["paged_step"] += 1
        elif node.target in SDPA_FUNCTIONS:
            _rewrite_sdpa(gm, node, opts, report, private=False)
        elif node.target in SDPA_PRIVATE:
            _rewrite_sdpa(gm, node, opts, report, private=True)
        elif node.target is F.multi_head_attention_forward:
            mha.rewrite(gm, node, opts, report)
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method") and matmul_pattern.is_softmax(node):
            matmul_pattern.rewrite(gm, node, opts, report)
    # no eliminate_dead_code: it would drop unused in-place calls (cache writes); every rewrite
    # erases exactly the nodes it replaced
    gm.graph.lint()
    gm.recompile()
    return report
