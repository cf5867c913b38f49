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


# --- the warpers and the draw in one kernel (sample_warped) --------------------------------
#
# transformers' top-k keeps the scores >= the k-th largest; its top-p sorts a row's
# probabilities ascending and drops the tokens whose cumulative sum is <= 1 - top_p, so the
# tokens kept are those with a score >= v*, the largest score v of the row whose mass below it
# (the probabilities of the kept scores < v) is <= 1 - top_p. The kernel finds both cuts
# without sorting: one pass for the row's maximum, then passes that each count (top-k) or weigh
# (top-p) the scores below NP pivots at once and keep the two pivots that bracket the cut,
# bisecting the 32-bit space of float keys (8 passes at NP 16, exact: the cut itself at the
# end); after the first passes only the scores inside the bracket are compared, and a block
# with none skips that work. Top-p differs from the sort only where scores tie at v* (every
# tied token is kept; the sort keeps some, in its order) and where the mass below v* is within
# float32 rounding of 1 - top_p (the sums' order differs).


@triton.jit
def _key(s):
    """float32 -> int32 whose order is the floats' (NaN aside; -0.0 just below +0.0)."""
    b = s.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def _value(key):
    """_key's inverse: the float32 of an int32 key."""
    b = key.to(tl.int32)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _row(base, cols, V):
    """A block of a row's logits as float32; -inf past the row."""
    return tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)


@triton.jit
def _warped_kernel(
    x_ptr,  # [R, V] logits (any float dtype; -inf = filtered), row stride stride_r
    seeds_ptr,  # [R] int64
    greedy_ptr,  # [R] int8: the plain argmax, no warpers
    temp_ptr,  # [R] float32 (1: off)
    top_k_ptr,  # [R] int32 (0: off)
    top_p_ptr,  # [R] float32 (1: off)
    min_p_ptr,  # [R] float32 (0: off)
    out_ptr,  # [R] int64: the token drawn
    cut_ptr,  # [R] float32: the lowest temperature-scaled score the row keeps
    V,
    stride_r,
    BLOCK: tl.constexpr,
    NP: tl.constexpr,
):
    # The cuts are searched over the raw logits x: dividing by t > 0 keeps their order, so the
    # k-th largest scaled score is the k-th largest x divided by t; the top-p masses multiply
    # x by 1 / t. Only the draw divides every score exactly (IEEE: transformers' values).
    r = tl.program_id(0)
    base = x_ptr + r * stride_r
    greedy = tl.load(greedy_ptr + r) != 0
    t = tl.where(greedy, 1.0, tl.load(temp_ptr + r))
    kk = tl.arange(0, NP).to(tl.int64)
    cut = tl.full((), float("-inf"), tl.float32)
    if not greedy:
        top_k = tl.load(top_k_ptr + r)
        top_p = tl.load(top_p_ptr + r)
        min_p = tl.load(min_p_ptr + r)
        m = tl.full((), -1e30, tl.float32)  # the row's largest x (a finite start: all -inf rows)
        for start in range(0, V, BLOCK):
            m = tl.maximum(m, tl.max(_row(base, start + tl.arange(0, BLOCK), V), 0))
        cut_x = tl.full((), float("-inf"), tl.float32)
        if top_k > 0 and top_k < V:
            # the k-th largest: the largest key with at least k logits at or above it
            # (invariant: count(>= lo) >= k > count(>= hi) = n_hi), NP pivots a pass. Only keys
            # in [lo, hi) are compared with the pivots, and a block with none skips it.
            lo = _key(cut_x).to(tl.int64)
            hi = _key(m).to(tl.int64) + 1
            n_hi = tl.full((), 0, tl.int32)
            while hi - lo > 1:
                piv = lo + ((kk + 1) * (hi - lo)) // (NP + 1)
                piv32, lo32, hi32 = piv.to(tl.int32), lo.to(tl.int32), hi.to(tl.int32)
                acc = tl.zeros((BLOCK, NP), tl.int32)  # summed once a pass, not a block
                for start in range(0, V, BLOCK):
                    kx = _key(_row(base, start + tl.arange(0, BLOCK), V))
                    inr = (kx >= lo32) & (kx < hi32)
                    if tl.max(inr.to(tl.int32), 0) > 0:
                        acc += ((kx[:, None] >= piv32[None, :]) & inr[:, None]).to(tl.int32)
                cnt = n_hi + tl.sum(acc, 0)
                lo = tl.maximum(lo, tl.max(tl.where(cnt >= top_k, piv, lo), 0))
                n_hi = tl.maximum(n_hi, tl.max(tl.where(cnt < top_k, cnt, n_hi), 0))
                hi = tl.minimum(hi, tl.min(tl.where(cnt < top_k, piv, hi), 0))
            cut_x = _value(lo)
        if top_p < 1.0:
            # transformers' top-p over the tokens top-k kept: the largest v* whose mass below
            # (of the kept tokens, at the temperature) is <= 1 - top_p (see above); invariant:
            # mass below lo = m_lo <= allowed < mass below hi. As for top-k, only keys in
            # [lo, hi) are compared and weighed.
            inv_t = 1.0 / t
            z = tl.full((), 0.0, tl.float32)
            for start in range(0, V, BLOCK):
                x = _row(base, start + tl.arange(0, BLOCK), V)
                z += tl.sum(tl.where(x >= cut_x, tl.exp((x - m) * inv_t), 0.0), 0)
            allowed = (1.0 - top_p) * z
            lo = _key(cut_x).to(tl.int64)  # mass below the top-k cut: 0
            hi = _key(m).to(tl.int64) + 1
            m_lo = tl.full((), 0.0, tl.float32)
            while hi - lo > 1:
                piv = lo + ((kk + 1) * (hi - lo)) // (NP + 1)
                piv32, lo32, hi32 = piv.to(tl.int32), lo.to(tl.int32), hi.to(tl.int32)
                acc = tl.zeros((BLOCK, NP), tl.float32)
                for start in range(0, V, BLOCK):
                    x = _row(base, start + tl.arange(0, BLOCK), V)
                    kx = _key(x)
                    inr = (kx >= lo32) & (kx < hi32)
                    if tl.max(inr.to(tl.int32), 0) > 0:
                        e = tl.where(inr, tl.exp((x - m) * inv_t), 0.0)
                        acc += tl.where(kx[:, None] < piv32[None, :], e[:, None], 0.0)
                mass = m_lo + tl.sum(acc, 0)
                lo = tl.maximum(lo, tl.max(tl.where(mass <= allowed, piv, lo), 0))
                m_lo = tl.maximum(m_lo, tl.max(tl.where(mass <= allowed, mass, m_lo), 0))
                hi = tl.minimum(hi, tl.min(tl.where(mass > allowed, piv, hi), 0))
            cut_x = _value(lo)
        cut = tl.div_rn(cut_x, t)
        if min_p > 0.0:
            # min-p keeps the probabilities >= min_p x the largest: s >= max s + log(min_p)
            cut = tl.maximum(cut, tl.div_rn(m, t) + tl.log(min_p))
    tl.store(cut_ptr + r, cut)
    seed = tl.load(seeds_ptr + r)
    best = tl.full((), float("-inf"), tl.float32)
    best_i = tl.full((), 0, tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        s = tl.div_rn(_row(base, cols, V), t)
        if not greedy:
            u = tl.maximum(tl.rand(seed, cols), 1e-12)
            s = tl.where(s >= cut, s - tl.log(-tl.log(u)), float("-inf"))
        s = tl.where(cols < V, s, float("-inf"))
        mx = tl.max(s, 0)
        i = tl.min(tl.where(s == mx, cols, V), 0)  # first index of the maximum, as argmax
        take = mx > best
        best_i = tl.where(take, i, best_i)
        best = tl.where(take, mx, best)
    tl.store(out_ptr + r, best_i.to(tl.int64))


def sample_warped(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    greedy: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    cut: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row from raw logits, transformers' warpers in the kernel: temperature,
    top-k, top-p (the bisection above, no sort) and min-p, then the Gumbel-max draw of
    sample_rows on the scores kept. logits: [R, V] any float dtype (-inf = filtered); seeds [R]
    int64; greedy [R] bool (the plain argmax); temperature [R] (1: off), top_k [R] (0: off),
    top_p [R] (1: off), min_p [R] (0: off). cut ([R] float32): also write each row's lowest
    kept (temperature-scaled) score there. Returns [R] int64 token ids."""
    logits = _rows("sample_warped", logits, seeds=seeds, greedy=greedy, temperature=temperature,
                   top_k=top_k, top_p=top_p, min_p=min_p)  # fmt: skip
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if cut is None:
        cut = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return out
    f32 = dict(dtype=torch.float32)
    _warped_kernel[(rows,)](
        logits, seeds.to(torch.int64), greedy.to(torch.int8), temperature.to(**f32).contiguous(),
        top_k.to(torch.int32).contiguous(), top_p.to(**f32).contiguous(),
        min_p.to(**f32).contiguous(), out, cut, vocab, logits.stride(0),
        BLOCK=min(512, triton.next_power_of_2(vocab)), NP=16, num_warps=8,
    )  # fmt: skip
    return out


def top_p_cut_ref(scores: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The same cut in float64 by sorting: for each row the largest score v whose mass below
    (the probabilities of the scores < v) is <= 1 - top_p."""
    s = scores.double()
    p = s.softmax(-1)
    sv, order = s.sort(-1)
    sp = p.gather(-1, order)
    below = sp.cumsum(-1) - sp  # mass strictly before each place in the sort...
    first = torch.searchsorted(sv, sv)  # ...at the first place of its value: below its value
    below = below.gather(-1, first)
    ok = below <= (1 - top_p.double())[:, None]
    return torch.where(ok, sv, float("-inf")).amax(-1).float()
