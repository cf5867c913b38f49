"""The hand-written attention pattern on a Dynamo graph:

    softmax(q @ k.transpose(-2, -1) * scale [+ mask | .masked_fill(m, -inf)], dim=-1) [.to()] @ v

with `/ sqrt(d)` or `* c` (on the scores or on q), `torch.matmul` / `@` / `bmm`, `baddbmm(mask,
q, kT)`, casts around the softmax (HF eager: softmax in fp32, then back), and dropout that is
off (p = 0 or training=False). Anchored at the softmax; a softmax that is not between two
matmuls is not attention and is not counted.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from .sites import (
    Attn,
    call,
    check,
    emit,
    erase_dead,
    is_tensor_node,
    same,
    strip_repeat_kv,
    value,
    where,
)
from .stats import GraphReport

_FUNCS = {
    "softmax": (F.softmax, torch.softmax, torch.special.softmax),
    "matmul": (operator.matmul, torch.matmul, torch.bmm),
    "baddbmm": (torch.baddbmm,),
    "mul": (operator.mul, torch.mul),
    "div": (operator.truediv, torch.div, torch.true_divide),
    "add": (operator.add, torch.add),
    "masked_fill": (torch.masked_fill,),
    "transpose": (torch.transpose, torch.swapaxes),
    "permute": (torch.permute,),
    "dropout": (F.dropout, torch.dropout),
}
_METHODS = {
    "softmax": ("softmax",),
    "matmul": ("matmul", "bmm", "__matmul__"),
    "baddbmm": ("baddbmm",),
    "mul": ("mul", "__mul__"),
    "div": ("div", "__truediv__"),
    "add": ("add", "__add__"),
    "masked_fill": ("masked_fill",),
    "transpose": ("transpose", "swapaxes"),
    "permute": ("permute",),
    "cast": ("to", "type", "type_as", "float", "half", "bfloat16"),
}


def kind(node) -> str | None:
    if not isinstance(node, Node):
        return None
    if node.op == "call_function":
        return next((k for k, fns in _FUNCS.items() if node.target in fns), None)
    if node.op == "call_method":
        return next((k for k, ms in _METHODS.items() if node.target in ms), None)
    return None


def is_softmax(node: Node) -> bool:
    return kind(node) == "softmax"


def _arg(node: Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _dropout_off(node: Node) -> bool:
    p, training = _arg(node, 1, "p", 0.5), _arg(node, 2, "training", True)
    return _number(p) == 0.0 or training is False


def _last_dim(node: Node, dim) -> bool:
    nd = value(node).dim()
    return isinstance(dim, int) and dim in (-1, nd - 1)


def _downstream(sm: Node) -> tuple[list[Node], Node | None, str | None]:
    """Casts/dropout after the softmax, the p @ v matmul, and a reason if it can't be fused."""
    chain, cur = [], sm
    while True:
        users = list(cur.users)
        pv = [u for u in users if kind(u) == "matmul" and u.args[0] is cur]
        if pv:
            if len(users) > 1:
                return chain, pv[0], "the attention weights are used elsewhere (need_weights?)"
            return chain, pv[0], None
        if len(users) != 1 or kind(users[0]) not in ("cast", "dropout"):
            return chain, None, None
        cur = users[0]
        chain.append(cur)
        if kind(cur) == "dropout" and not _dropout_off(cur):
            return chain, _find_pv(cur), "dropout with p > 0 in training"


def _find_pv(node: Node) -> Node | None:
    for u in node.users:
        if kind(u) == "matmul" and u.args[0] is node:
            return u
        if kind(u) in ("cast", "dropout"):
            return _find_pv(u)
    return None


def _transposed(kt: Node) -> Node | None:
    """k when kt is k with its last two dims swapped."""
    k = kind(kt)
    if k not in ("transpose", "permute") or not is_tensor_node(kt.args[0]):
        return None
    nd = value(kt).dim()
    if k == "transpose":
        dims = {d % nd for d in kt.args[1:3] if isinstance(d, int)}
        return kt.args[0] if dims == {nd - 2, nd - 1} else None
    perm = (
        kt.args[1] if len(kt.args) == 2 and isinstance(kt.args[1], (list, tuple)) else kt.args[1:]
    )
    want = list(range(nd - 2)) + [nd - 1, nd - 2]
    return kt.args[0] if [p % nd for p in perm] == want else None


class _Up:
    """Walks from the softmax input up to q @ kT: mask first, then constant scales."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.scale = 1.0
        self.mask: Node | None = None
        self.mask_is_fill = False  # masked_fill(m, -inf): attend where m is False
        self.q = self.kt = None

    def walk(self, x: Node) -> str | None:
        stage = 0  # 0: a mask may come; 1: only scales; matmul ends the walk
        while True:
            k = kind(x)
            if len(x.users) != 1:
                return "the scores are used elsewhere"
            self.nodes.append(x)
            if k in ("matmul", "baddbmm"):
                return self._matmul(x, k, stage)
            if k in ("add", "masked_fill") and stage == 0 and self.mask is None:
                x, reason = self._mask(x, k)
            elif k in ("mul", "div"):
                stage, (x, reason) = 1, self._scale(x, k)
            elif k == "cast":
                x, reason = x.args[0], None
            else:
                return (
                    f"unrecognised {x.op} {getattr(x.target, '__name__', x.target)} in the scores"
                )
            if reason:
                return reason

    def _mask(self, x: Node, k: str):
        if k == "masked_fill":
            fill = _number(_arg(x, 2, "value"))
            if fill != -math.inf:
                return x, f"masked_fill with {_arg(x, 2, 'value')} (only -inf)"
            self.mask, self.mask_is_fill = _arg(x, 1, "mask"), True
            return x.args[0], None
        a, b = x.args[0], _arg(x, 1, "other")
        if _arg(x, 2, "alpha", 1) != 1:
            return x, "add with alpha"
        main, mask = (a, b) if kind(a) in ("mul", "div", "matmul", "cast") else (b, a)
        if not (is_tensor_node(main) and is_tensor_node(mask)):
            return x, "a constant added to the scores"
        if value(mask).dtype == torch.bool:
            return x, "a bool tensor added to the scores (adds 0/1, not a mask)"
        sx, sm = value(x).shape, value(main).shape
        if len(sx) != len(sm) or not all(same(a, b) for a, b in zip(sx, sm)):
            return x, "the mask broadcasts the scores to a larger shape"
        self.mask = mask
        return main, None

    def _scale(self, x: Node, k: str):
        a, b = x.args[0], _arg(x, 1, "other")
        main, c = (a, _number(b)) if is_tensor_node(a) else (b, _number(a))
        if c is None or (k == "div" and not is_tensor_node(a)):
            return x, "the scores are scaled by a non-constant"
        self.scale *= c if k == "mul" else 1.0 / c
        return main, None

    def _matmul(self, mm: Node, k: str, stage: int) -> str | None:
        if k == "baddbmm":
            if self.mask is not None or stage != 0:
                return "baddbmm after a mask or scale"
            if _arg(mm, 3, "beta", 1) != 1 or _number(_arg(mm, 4, "alpha", 1)) is None:
                return "baddbmm with beta != 1"
            self.mask, self.scale = mm.args[0], self.scale * _number(_arg(mm, 4, "alpha", 1))
            q, self.kt = mm.args[1], mm.args[2]
        else:
            q, self.kt = mm.args[0], mm.args[1]
        if kind(q) in ("mul", "div") and len(q.users) == 1:
            pre, reason = self._scale(q, kind(q))
            if reason is None:
                self.nodes.append(q)
                q = pre
        self.q = q
        return None if _transposed(self.kt) is not None else "k is not transposed on its last dims"


def rewrite(gm: GraphModule, sm: Node, opts, report: GraphReport) -> None:
    down, pv, reason = _downstream(sm)
    if pv is None:
        return  # not between two matmuls: not attention
    if not _last_dim(sm, _arg(sm, 1, "dim")):
        return
    up = _Up()
    reason = reason or up.walk(sm.args[0])
    if up.q is None and reason and "unrecognised" in reason and not _has_matmul_above(sm):
        return
    report.found += 1
    a = None
    if reason is None:
        a = Attn(up.q, _transposed(up.kt), pv.args[1], up.mask, False, up.scale, gqa=True)
        reason = _out_dtype(a, pv) or check(a)
    if reason:
        report.leave("matmul_softmax", reason, where(sm))
        return
    repeats = strip_repeat_kv(a) if len(up.kt.users) == 1 else []
    with gm.graph.inserting_before(pv):
        if up.mask_is_fill:
            a.mask = call(gm.graph, torch.logical_not, (a.mask,), sm)
        out = emit(gm.graph, a, opts, sm)
    pv.replace_all_uses_with(out)
    erase_dead(gm.graph, [pv, *reversed(down), sm, *up.nodes, up.kt, *repeats])
    report.rewritten["matmul_softmax"] += 1


def _has_matmul_above(sm: Node, depth: int = 6) -> bool:
    x = sm.args[0]
    for _ in range(depth):
        if not isinstance(x, Node):
            return False
        if kind(x) in ("matmul", "baddbmm"):
            return True
        x = x.args[0] if x.args else None
    return False


def _out_dtype(a: Attn, pv: Node) -> str | None:
    if value(pv).dtype != value(a.q).dtype:
        return f"output dtype {value(pv).dtype} differs from q's {value(a.q).dtype}"
    return None
