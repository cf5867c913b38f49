"""Sampling one token per row from processed logits, every row at once (Gumbel-max).

Row r draws argmax_i(scores[r, i] + g_i) with g_i = -log(-log u_i), u_i uniform from Philox
keyed by the row's own 64-bit seed: P(i) = softmax(scores[r])_i, and the draw depends only on
(seed, scores), never on which other rows share the launch. A row with `greedy` set takes the
plain argmax (the first index among ties, as torch.argmax). Tokens filtered out are -inf and
are never drawn; a row whose scores are all -inf returns 0.

The seeds change every step (the caller mixes the row's seed with its step count), so one
kernel launch serves rows of any calls and their draws stay reproducible per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._checks import check_runnable


@triton.jit
def _sample_kernel(
    scores_ptr,  # [R, V] float, row stride stride_r
    seeds_ptr,  # [R] int64
    greedy_ptr,  # [R] int8
    out_ptr,  # [R] int64
    V,
    stride_r,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    seed = tl.load(seeds_ptr + r)
    greedy = tl.load(greedy_ptr + r) != 0
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < V
        s = tl.load(scores_ptr + r * stride_r + cols, mask=inside, other=float("-inf"))
        s = s.to(tl.float32)
        if not greedy:
            u = tl.rand(seed, cols)
            u = tl.maximum(u, 1e-12)  # log(0): a zero draw would win nothing anyway
            s = s - tl.log(-tl.log(u))
        s = tl.where(inside, s, float("-inf"))
        m = tl.max(s, 0)
        # first index of the block's maximum (torch.argmax's tie rule), then strict > across
        # blocks keeps the earliest block's
        i = tl.min(tl.where(s == m, cols, V), 0)
        take = m > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, m, best)
    tl.store(out_ptr + r, best_i.to(tl.int64))


def sample_rows(scores: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """scores: [R, V] float (processed logits; -inf = filtered), seeds: [R] int64, greedy: [R]
    bool -> [R] int64 token ids."""
    if scores.dim() != 2 or seeds.shape != (scores.shape[0],) or greedy.shape != seeds.shape:
        raise ValueError(
            f"sample_rows: scores {list(scores.shape)}, seeds {list(seeds.shape)}, greedy "
            f"{list(greedy.shape)}: want [R, V], [R], [R]"
        )
    check_runnable("sample_rows scores", scores)
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    if scores.stride(1) != 1:
        scores = scores.contiguous()
    block = min(4096, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](
        scores, seeds.to(torch.int64), greedy.to(torch.int8), out, vocab, scores.stride(0),
        BLOCK=block,
    )  # fmt: skip
    return out


def sample_rows_ref(
    scores: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor
) -> torch.Tensor:
    """The same draw rule in plain PyTorch, for devices Triton cannot run on: each sampling
    row's uniforms come from its own torch.Generator seeded with its seed (so not the kernel's
    Philox stream: same distribution, other draws)."""
    out = scores.float().argmax(-1)
    for r in torch.nonzero(~greedy.bool()).flatten().tolist():
        g = torch.Generator(device=scores.device)
        g.manual_seed(int(seeds[r]) & ((1 << 63) - 1))
        u = torch.rand(scores.shape[1], generator=g, device=scores.device).clamp_min(1e-12)
        out[r] = (scores[r].float() - torch.log(-torch.log(u))).argmax()
    return out
