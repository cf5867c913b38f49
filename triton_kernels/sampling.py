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


def _rows(name: str, scores: torch.Tensor, **per_row: torch.Tensor) -> torch.Tensor:
    """scores ([R, V]) with unit column stride, once it and each per-row tensor ([R]) check."""
    if scores.dim() != 2 or any(t.shape != (scores.shape[0],) for t in per_row.values()):
        shapes = ", ".join(f"{k} {list(t.shape)}" for k, t in per_row.items())
        raise ValueError(
            f"{name}: scores {list(scores.shape)}, {shapes}: want scores [R, V] and [R] for each"
        )
    check_runnable(f"{name} scores", scores)
    return scores if scores.stride(1) == 1 else scores.contiguous()


def sample_rows(scores: torch.Tensor, seeds: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """scores: [R, V] float (processed logits; -inf = filtered), seeds: [R] int64, greedy: [R]
    bool -> [R] int64 token ids."""
    scores = _rows("sample_rows", scores, seeds=seeds, greedy=greedy)
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    block = min(4096, triton.next_power_of_2(vocab))
    _sample_kernel[(rows,)](
        scores, seeds.to(torch.int64), greedy.to(torch.int8), out, vocab, scores.stride(0),
        BLOCK=block,
    )  # fmt: skip
    return out


@triton.jit
def _candidates_kernel(
    vals_ptr,  # [R, C] float32 processed scores of each row's candidates (-inf = filtered)
    ids_ptr,  # [R, C] int64 their token ids
    seeds_ptr,  # [R] int64
    out_ptr,  # [R] int64
    C,
    stride_v,
    stride_i,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    seed = tl.load(seeds_ptr + r)
    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.full((), 1 << 62, tl.int64)
    for start in range(0, C, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < C
        s = tl.load(vals_ptr + r * stride_v + cols, mask=inside, other=float("-inf"))
        ids = tl.load(ids_ptr + r * stride_i + cols, mask=inside, other=1 << 62)
        # the noise of token id i is _sample_kernel's at column i: the same Philox counter
        u = tl.maximum(tl.rand(seed, ids.to(tl.int32)), 1e-12)
        s = tl.where(inside, s - tl.log(-tl.log(u)), float("-inf"))
        m = tl.max(s, 0)
        i = tl.min(tl.where(s == m, ids, 1 << 62), 0)  # ties: the smallest id, as argmax
        take = (m > best) | ((m == best) & (i < best_id) & (m > float("-inf")))
        best_id = tl.where(take, i, best_id)
        best = tl.where(take, m, best)
    tl.store(out_ptr + r, tl.where(best_id == 1 << 62, 0, best_id))


def sample_candidates(vals: torch.Tensor, ids: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """`sample_rows`' draw over a subset of each row's tokens: vals [R, C] float32 (processed
    scores; -inf = filtered), ids [R, C] int64 (their token ids, distinct within a row), seeds
    [R] int64 -> [R] int64. Token i gets the noise `sample_rows` gives column i, so when the
    subset holds every token the processors keep, the draw is sample_rows' over the whole row."""
    vals = _rows("sample_candidates", vals, seeds=seeds)
    if ids.shape != vals.shape:
        raise ValueError(
            f"sample_candidates: ids {list(ids.shape)} against vals {list(vals.shape)}"
        )
    ids = ids if ids.stride(1) == 1 else ids.contiguous()
    rows, c = vals.shape
    out = torch.empty(rows, dtype=torch.int64, device=vals.device)
    if rows == 0:
        return out
    _candidates_kernel[(rows,)](
        vals, ids.to(torch.int64), seeds.to(torch.int64), out, c, vals.stride(0), ids.stride(0),
        BLOCK=min(1024, triton.next_power_of_2(max(c, 16))),
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
