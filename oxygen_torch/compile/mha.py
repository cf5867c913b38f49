"""nn.MultiheadAttention under the oxygen backend.

Dynamo keeps `F.multi_head_attention_forward` as one call in its graph (it does not inline it),
so no SDPA node is visible. The pass swaps the call's target for `oxygen_mha_forward`: torch's
need_weights=False path with `oxygen::attention` in place of SDPA. AOTAutograd traces the new
target like any Python function. Cases with extra semantics (returned weights, bias_k/bias_v,
add_zero_attn, static_k/v, dropout in training) are left as they are.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from ..triton_kernels import MAX_HEAD_DIM
from ..triton_kernels.precision import PrecisionMode
from .sites import CUDA_DTYPES, hint, tile_choice, value, where
from .stats import GraphReport

_SIG = inspect.signature(F.multi_head_attention_forward)
_PARAMS = tuple(_SIG.parameters)
_DEFAULTS = {k: p.default for k, p in _SIG.parameters.items() if p.default is not p.empty}


def _bind(node: Node) -> dict:
    out = dict(_DEFAULTS)
    out.update(zip(_PARAMS, node.args))
    out.update(node.kwargs)
    return out


def _unsupported(b: dict) -> str | None:
    for name in (
        "need_weights",
        "training",
        "is_causal",
        "add_zero_attn",
        "use_separate_proj_weight",
        "num_heads",
        "dropout_p",
    ):
        if isinstance(b[name], Node):
            return f"{name} is not a constant"
    if b["need_weights"]:
        return "need_weights=True: the attention weights are returned (pass need_weights=False)"
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if b[name] is not None:
            return f"{name} is set"
    if b["add_zero_attn"]:
        return "add_zero_attn=True"
    if b["training"] and b["dropout_p"] != 0.0:
        return f"dropout_p={b['dropout_p']} in training"
    q = value(b["query"])
    if not isinstance(q, torch.Tensor) or q.dim() not in (2, 3):
        return "query is not [L, N, E] or [L, E]"
    if q.device.type == "cuda":
        if q.dtype not in CUDA_DTYPES:
            return f"dtype {q.dtype} has no Triton path"
        if hint(q.shape[-1]) // b["num_heads"] > MAX_HEAD_DIM:
            return f"head_dim > {MAX_HEAD_DIM}"
    return None


def rewrite(gm: GraphModule, node: Node, opts, report: GraphReport) -> None:
    report.found += 1
    b = _bind(node)
    reason = _unsupported(b)
    if reason:
        report.leave("mha", reason, where(node))
        return
    q, k = value(b["query"]), value(b["key"])
    h = b["num_heads"]
    d = hint(q.shape[-1]) // h
    tiles = tile_choice(opts, q.dtype, h, h, d, q.shape[0], k.shape[0])
    node.target = oxygen_mha_forward
    node.kwargs = {**node.kwargs, "oxygen_tiles": tiles}
    report.rewritten["mha"] += 1


def _masks(attn_mask, key_padding_mask, is_causal, dtype):
    """torch's mask canonicalisation (bool True = masked -> additive -inf), as in
    F.multi_head_attention_forward with need_weights=False."""
    kpm = F._canonical_mask(
        mask=key_padding_mask,
        mask_name="key_padding_mask",
        other_type=F._none_or_dtype(attn_mask),
        other_name="attn_mask",
        target_type=dtype,
    )
    if is_causal and kpm is None:
        return None, None, True
    attn_mask = F._canonical_mask(
        mask=attn_mask,
        mask_name="attn_mask",
        other_type=None,
        other_name="",
        target_type=dtype,
        check_other=False,
    )
    return attn_mask, kpm, is_causal and kpm is None


def oxygen_mha_forward(
    query,
    key,
    value,
    embed_dim_to_check,
    num_heads,
    in_proj_weight,
    in_proj_bias,
    bias_k,
    bias_v,
    add_zero_attn,
    dropout_p,
    out_proj_weight,
    out_proj_bias,
    training=True,
    key_padding_mask=None,
    need_weights=True,
    attn_mask=None,
    use_separate_proj_weight=False,
    q_proj_weight=None,
    k_proj_weight=None,
    v_proj_weight=None,
    static_k=None,
    static_v=None,
    average_attn_weights=True,
    is_causal=False,
    *,
    oxygen_tiles=(int(PrecisionMode.AUTO_MIXED), 0, 0),
):
    """F.multi_head_attention_forward (need_weights=False, no bias_kv / zero_attn / static kv,
    no dropout) computed with oxygen::attention. query: [L, N, E] or [L, E]."""
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    tgt_len, bsz, embed = query.shape
    src_len = key.shape[0]
    head_dim = embed // num_heads
    attn_mask, kpm, causal = _masks(attn_mask, key_padding_mask, is_causal, query.dtype)
    if use_separate_proj_weight:
        b_q, b_k, b_v = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
        q, k, v = F._in_projection(
            query, key, value, q_proj_weight, k_proj_weight, v_proj_weight, b_q, b_k, b_v
        )
    else:
        q, k, v = F._in_projection_packed(query, key, value, in_proj_weight, in_proj_bias)
    # [L, N, E] -> [N, H, L, D]
    q = q.reshape(tgt_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    k = k.reshape(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    v = v.reshape(src_len, bsz, num_heads, head_dim).permute(1, 2, 0, 3)
    mask = attn_mask
    if mask is not None and mask.dim() == 3:  # [N * H, L, S]
        mask = mask.view(bsz, num_heads, tgt_len, src_len)
    if kpm is not None:
        kp = kpm.view(bsz, 1, 1, src_len)
        mask = kp if mask is None else mask + kp
    precision, block_m, block_n = oxygen_tiles
    out = torch.ops.oxygen.attention(q, k, v, mask, causal, None, precision, block_m, block_n)
    out = out.permute(2, 0, 1, 3).reshape(tgt_len * bsz, embed)  # [L * N, E]
    out = F.linear(out, out_proj_weight, out_proj_bias).view(tgt_len, bsz, -1)
    return (out if batched else out.squeeze(1)), None
