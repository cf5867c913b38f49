"""What every attention rewrite shares: reading node values, checking q/k/v, choosing tiles at
compile time and inserting the `oxygen::attention` call in place of the matched nodes.

Works on Dynamo graphs: every node carries meta["example_value"] (a FakeTensor, symbolic
sizes under dynamic shapes). Nothing here guards on a symbolic size: shapes are compared with
`statically_known_true` and tile choices read size hints.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..triton_kernels import MAX_HEAD_DIM
from ..triton_kernels.precision import PrecisionMode
from ..triton_kernels.tiling import TileQuery, select_block_size
from .options import CompileOptions

CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_HINT = 2048  # tile choice for a symbolic length without a hint


def value(x):
    """The example value of a node (FakeTensor / SymInt), or x itself for a constant."""
    if isinstance(x, Node):
        return x.meta.get("example_value", x.meta.get("val"))
    return x


def is_tensor_node(x) -> bool:
    return isinstance(x, Node) and isinstance(value(x), torch.Tensor)


def hint(size) -> int:
    if isinstance(size, torch.SymInt):
        h = size.node.hint
        return int(h) if h is not None else DEFAULT_HINT
    return int(size)


def same(a, b) -> bool:
    """a == b for sizes the op needs equal. Where only the hint says so (two inputs with their
    own symbols, e.g. k and v lengths under dynamic shapes), evaluating adds a guard that unifies
    them: the graph was only valid for equal sizes anyway (SDPA requires it)."""
    if statically_known_true(a == b):
        return True
    return bool(a == b)


def where(node: Node) -> str:
    """The user's source line that made `node` (last line of Dynamo's stack trace)."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    for line in reversed(trace):
        if line.strip().startswith("File "):
            return line.strip()
    return node.name


@dataclass
class Attn:
    """A matched attention: q/k/v (and mask) are graph nodes with [B, H, S, D] or [B, S, D]."""

    q: Node
    k: Node
    v: Node
    mask: Node | None = None
    causal: bool = False
    scale: float | None = None
    gqa: bool = False  # heads may differ (SDPA enable_gqa)


_ALL = slice(None)
_REPEAT_INDEX = (_ALL, _ALL, None, _ALL, _ALL)  # x[:, :, None, :, :] in transformers' repeat_kv


def _unrepeat(x: Node) -> tuple[Node, list[Node]] | None:
    """(source [B, Hkv, S, D], nodes made dead) when x repeats its source's heads: transformers'
    repeat_kv (x[:, :, None].expand(...).reshape(...)) or repeat_interleave(x, n, dim=1)."""
    if x.op == "call_method" and x.target in ("reshape", "view") and isinstance(x.args[0], Node):
        exp = x.args[0]
        if exp.op == "call_method" and exp.target == "expand" and isinstance(exp.args[0], Node):
            gi = exp.args[0]
            if gi.target is operator.getitem and gi.args[1] == _REPEAT_INDEX:
                src = gi.args[0]
                if is_tensor_node(src) and value(src).dim() == 4:
                    return src, [x, exp, gi]
    if x.target in ("repeat_interleave", torch.repeat_interleave) and len(x.args) >= 2:
        dim = x.args[2] if len(x.args) > 2 else x.kwargs.get("dim")
        if isinstance(x.args[1], int) and dim in (1, -3) and value(x).dim() == 4:
            return x.args[0], [x]
    return None


def strip_repeat_kv(a: Attn) -> list[Node]:
    """Feed the un-repeated K/V to the op (it does GQA itself): the repeat was a full copy of
    K/V per step. Returns the repeat nodes, to erase once the attention is replaced."""
    if not (is_tensor_node(a.k) and is_tensor_node(a.v)) or value(a.k).dim() != 4:
        return []
    rk, rv = _unrepeat(a.k), _unrepeat(a.v)
    if rk is None or rv is None or len(a.k.users) != 1 or len(a.v.users) != 1:
        return []
    a.k, a.v, a.gqa = rk[0], rv[0], True
    return rk[1] + rv[1]


def erase_dead(graph: Graph, nodes: list[Node]) -> None:
    for node in nodes:
        if not node.users:
            graph.erase_node(node)


def check(a: Attn) -> str | None:
    """None when the op can take a; else the reason it cannot."""
    q, k, v = value(a.q), value(a.k), value(a.v)
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return "q/k/v are not all tensors"
    if not q.dim() == k.dim() == v.dim() or q.dim() not in (3, 4):
        return f"q/k/v dims {q.dim()}/{k.dim()}/{v.dim()}: only [B, H, S, D] or [B, S, D]"
    if not q.dtype == k.dtype == v.dtype or not q.dtype.is_floating_point:
        return f"dtypes {q.dtype}/{k.dtype}/{v.dtype}: need one floating dtype"
    if not q.device == k.device == v.device:
        return "q/k/v on different devices"
    if not (same(q.shape[0], k.shape[0]) and same(k.shape[0], v.shape[0])):
        return "batch sizes differ (broadcast batch dims are not supported)"
    if not (same(q.shape[-1], k.shape[-1]) and same(k.shape[-1], v.shape[-1])):
        return "head dims of q/k/v differ"
    if not same(k.shape[-2], v.shape[-2]):
        return "k and v lengths differ"
    if q.dim() == 4:
        hq, hkv = q.shape[1], k.shape[1]
        if not same(hkv, v.shape[1]) or not statically_known_true(hq % hkv == 0):
            return f"heads {hq}/{hkv}: q heads must be a multiple of the k/v heads"
        if not a.gqa and not same(hq, hkv):
            return "q and k/v heads differ without enable_gqa"
    if q.device.type == "cuda":
        if q.dtype not in CUDA_DTYPES:
            return f"dtype {q.dtype} has no Triton path (fp16, bf16, fp32)"
        if hint(q.shape[-1]) > MAX_HEAD_DIM:
            return f"head_dim {q.shape[-1]} > {MAX_HEAD_DIM}"
    return _check_mask(a, q)


def _check_mask(a: Attn, q) -> str | None:
    if a.mask is None:
        return None
    if not is_tensor_node(a.mask):
        return "attn_mask is not a tensor"
    m = value(a.mask)
    if m.dtype != torch.bool and not m.dtype.is_floating_point:
        return f"attn_mask dtype {m.dtype}: only bool or float"
    if m.dim() > q.dim():
        return f"attn_mask has {m.dim()} dims for {q.dim()}-dim q"
    if m.device != q.device:
        return "attn_mask on another device"
    if a.causal:
        return "both is_causal and attn_mask"
    return None


def tiles(a: Attn, opts: CompileOptions) -> tuple[int, int, int]:
    """(precision, block_m, block_n) for a matched attention."""
    q, k = value(a.q), value(a.k)
    hq = q.shape[1] if q.dim() == 4 else 1
    hkv = k.shape[1] if k.dim() == 4 else 1
    return tile_choice(opts, q.dtype, hq, hkv, q.shape[-1], q.shape[-2], k.shape[-2])


def tile_choice(opts: CompileOptions, dtype, hq, hkv, d, sq, sk) -> tuple[int, int, int]:
    """(precision, block_m, block_n) fixed at compile time from the options and the shapes
    (size hints where symbolic)."""
    precision = opts.precision
    if dtype == torch.float32 and precision == PrecisionMode.AUTO_MIXED:
        # fp32 tensors: tf32 dots would be a silent downgrade torch itself does not make
        precision = PrecisionMode.FP32_SAFE
    hq, hkv, d, sq, sk = (hint(x) for x in (hq, hkv, d, sq, sk))
    tq = TileQuery(
        hidden_size=hq * d,
        head_dim=d,
        num_q_heads=hq,
        num_kv_heads=hkv,
        dtype=dtype,
        phase="decode" if sq == 1 else "prefill",
        seq_len=max(sk, 1),
        attention_type=opts.attention_type,
        block_m=opts.block_m,
        block_n=opts.block_n,
        precision=precision,
    )
    block_m, block_n = select_block_size(tq)
    return int(precision), block_m, block_n


def _fake(target, args):
    """Example value of target(*args) under the fake mode of the node values."""
    vals = [value(x) for x in args]
    # the node values' own mode: Dynamo hands the backend a fresh fake mode in TracingContext,
    # and the two must not mix
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:
        return None
    with mode:
        return target(*vals)


def call(graph: Graph, target, args: tuple, like: Node | None = None) -> Node:
    """graph.call_function with meta["example_value"] filled (later passes read it)."""
    node = graph.call_function(target, args)
    val = _fake(target, args)
    if val is not None:
        node.meta["example_value"] = val
    if like is not None:
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in like.meta:
                node.meta[key] = like.meta[key]
    return node


def emit(graph: Graph, a: Attn, opts: CompileOptions, like: Node) -> Node:
    """Insert oxygen::attention for `a` (before the current insertion point); returns the node
    holding the result in the input's rank ([B, S, D] inputs get a unit head dim and back)."""
    precision, block_m, block_n = tiles(a, opts)
    q, k, v, mask = a.q, a.k, a.v, a.mask
    flat = value(q).dim() == 3
    if flat:
        q, k, v = (call(graph, torch.unsqueeze, (t, 1), like) for t in (q, k, v))
        if mask is not None and value(mask).dim() == 3:
            mask = call(graph, torch.unsqueeze, (mask, 1), like)
    args = (q, k, v, mask, a.causal, a.scale, precision, block_m, block_n)
    out = call(graph, torch.ops.oxygen.attention.default, args, like)
    if flat:
        out = call(graph, torch.squeeze, (out, 1), like)
    return out
