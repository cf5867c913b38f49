"""Sampling one token per row from processed logits, every row at once (Gumbel-max), and each
row's largest scores (`top_candidates`: the top-k sampling path's candidates).

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
    r = tl.program_id(0).to(tl.int64)  # (r * stride_r passes 2^31 from ~16k rows of 128k)
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


@triton.jit
def _chunk_top_kernel(
    x_ptr,  # [R, V] float scores, row stride stride_x
    vals_ptr,  # [R, n_chunks * W] float32: each chunk's W largest, in column order
    ids_ptr,  # [R, n_chunks * W] int64: their columns
    V,
    stride_x,
    n_out,  # n_chunks * W
    W: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program a (row, chunk of CHUNK columns): the chunk's W largest scores by bisection on
    # an order-preserving integer key of each float32 (at most 32 counts over the chunk, held in
    # registers: one read of the scores, no sort; it stops once exactly W keys are at or above
    # the bound), ties at the W-th largest taken from the left.
    r = tl.program_id(0).to(tl.int64)  # (a row stride of a [R, T, V] slice times R: past 2^31)
    c = tl.program_id(1)
    cols = c * CHUNK + tl.arange(0, CHUNK)
    inside = cols < V
    x = tl.load(x_ptr + r * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
    xi = x.to(tl.int32, bitcast=True)
    key = tl.where(xi >= 0, xi, xi ^ 0x7FFFFFFF)  # float order (int32: a register a column)
    key = tl.where(inside, tl.maximum(key, -2147483647), -2147483648)  # past the end: lowest
    lo = tl.min(key, 0).to(tl.int64)  # invariant: at least W keys >= lo (CHUNK >= W)
    hi = tl.max(key, 0).to(tl.int64)
    while lo < hi:  # (the keys span at most 2^32 values: 32 rounds at most)
        mid = lo + (hi - lo + 1) // 2
        n = tl.sum((key >= mid).to(tl.int32), 0)
        lo = tl.where(n >= W, mid, lo)
        hi = tl.where(n > W, hi, tl.where(n == W, mid, mid - 1))  # exactly W at mid: done
    above = key > lo
    tied = key == lo
    keep = above | (tied & (tl.cumsum(tied.to(tl.int32), 0) <= W - tl.sum(above.to(tl.int32), 0)))
    at = tl.cumsum(keep.to(tl.int32), 0) - 1  # exactly W kept (the mask below: never past)
    keep = keep & (at < W)
    tl.store(vals_ptr + r * n_out + c * W + at, x, mask=keep)
    tl.store(ids_ptr + r * n_out + c * W + at, tl.where(inside, cols, 0).to(tl.int64), mask=keep)


TOP_CHUNK = 4096  # columns a program of top_candidates reads (and holds in registers)


def top_candidates(
    scores: torch.Tensor, width: int, chunk: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `width` largest scores of each row, largest first, and their columns: what
    ``scores.float().topk(width)`` gives (float32 [R, width], int64 [R, width]), but for which of
    several tied scores is taken. One kernel keeps each chunk's W largest (W = width rounded up
    to a power of two), then torch.topk runs over those candidates only: for a 128k vocabulary
    and a width of ~100, 4,096 candidates a row instead of 128,256 (torch.topk over the whole
    row was most of the top-k sampling path's time). Scores past the last real column never
    come out ahead of a real one; where a row has fewer than `width` finite scores, -inf ones
    fill it (columns valid, never drawn).

    torch.topk takes the whole rows itself where the kernel saves nothing: rows of at most two
    chunks (`chunk` columns, TOP_CHUNK unless given: a power of two), or a width over a quarter
    of a chunk (top_k + the sampler's tie slack past 1,024 with the default chunk)."""
    scores = _rows("top_candidates", scores)
    rows, vocab = scores.shape
    chunk = TOP_CHUNK if chunk is None else chunk
    if not 0 < width <= vocab:
        raise ValueError(f"top_candidates: width {width} for rows of {vocab} scores: want 1..V")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"top_candidates: chunk {chunk}: want a power of two >= 16")
    w = triton.next_power_of_2(width)
    if rows == 0 or vocab <= 2 * chunk or 4 * w > chunk:
        vals, ids = scores.topk(width, dim=-1)  # (no float32 copy of [R, V]: the same order)
        return vals.float(), ids
    n_chunks = triton.cdiv(vocab, chunk)
    cand_v = torch.empty(rows, n_chunks * w, dtype=torch.float32, device=scores.device)
    cand_i = torch.empty(rows, n_chunks * w, dtype=torch.int64, device=scores.device)
    _chunk_top_kernel[(rows, n_chunks)](
        scores, cand_v, cand_i, vocab, scores.stride(0), n_chunks * w, W=w, CHUNK=chunk,
        num_warps=8 if chunk >= 4096 else 4,
    )  # fmt: skip
    vals, at = cand_v.topk(width, dim=-1)
    return vals, cand_i.gather(1, at)


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
