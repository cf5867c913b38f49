"""The engine's batched processors and draw (engine/sampling.py, triton_kernels/sampling.py):
each processor against transformers' own on fresh random logits, and the draw's distribution
against the processed probabilities (a chi-square test on a small vocabulary)."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest
import torch
import transformers as T
from oxygen_torch.triton_kernels import sampling as kernels
from oxygen_torch.triton_kernels.sampling import (
    sample_candidates,
    sample_rows,
    sample_rows_ref,
    top_candidates,
)

from oxygen_torch.engine.sampling import RowSample, Sampler, SamplingParams, step_seed, step_seeds
from oxygen_torch.kv.transfer import put_value

V = 12
SETTINGS = {
    "temperature": SamplingParams(do_sample=True, temperature=0.7),
    "top_k": SamplingParams(do_sample=True, top_k=5),
    "top_p": SamplingParams(do_sample=True, top_p=0.8),
    "min_p": SamplingParams(do_sample=True, min_p=0.15),
    "penalty": SamplingParams(do_sample=True, repetition_penalty=1.5),
    "all": SamplingParams(
        do_sample=True, temperature=1.3, top_k=8, top_p=0.9, min_p=0.05, repetition_penalty=1.2
    ),  # fmt: skip
}


def stock_processors(p: SamplingParams) -> T.LogitsProcessorList:
    """transformers' processors for the same settings, in generate()'s order."""
    procs = T.LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(T.RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.temperature != 1.0:
        procs.append(T.TemperatureLogitsWarper(p.temperature))
    if p.top_k:
        procs.append(T.TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        procs.append(T.TopPLogitsWarper(p.top_p))
    if p.min_p is not None:
        procs.append(T.MinPLogitsWarper(p.min_p))
    return procs


@pytest.fixture
def triton_draws(monkeypatch):
    """The Sampler's Triton paths (the draws, "topk") on CPU tensors, under the
    interpreter: by default it takes them on CUDA only."""
    from oxygen_torch.engine import sampling

    monkeypatch.setattr(sampling, "_kernel_ok", lambda t: True)


def held_tokens(rows: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, V, (rows, 5), generator=gen)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_processed_scores_equal_transformers(name):
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    p = SETTINGS[name]
    rows = 6
    logits = torch.randn(rows, V, generator=gen) * 3
    held = held_tokens(rows, gen)
    sampler = Sampler(V, torch.device("cpu"))
    for r in range(rows):
        sampler.start_row(r, held[r])
    _, scores = sampler(logits, [RowSample(p, 0, r) for r in range(rows)])
    want = stock_processors(p)(held, logits.clone())
    torch.testing.assert_close(scores, want, rtol=1e-6, atol=1e-6)


def assert_each_row_as_stock(params, logits, gen) -> torch.Tensor:
    """One Sampler step of rows with these settings (held tokens drawn from gen): each row's
    processed scores equal transformers' processors on its own. Returns the tokens."""
    held = held_tokens(len(params), gen)
    sampler = Sampler(V, torch.device("cpu"))
    for r in range(len(params)):
        sampler.start_row(r, held[r])
    tokens, scores = sampler(logits, [RowSample(p, 0, r) for r, p in enumerate(params)])
    for r, p in enumerate(params):
        want = stock_processors(p)(held[r : r + 1], logits[r : r + 1].clone())
        torch.testing.assert_close(scores[r : r + 1], want, rtol=1e-6, atol=1e-6)
    return tokens


def test_rows_with_different_settings_in_one_batch_each_get_their_own():
    gen = torch.Generator().manual_seed(3)
    names = list(SETTINGS) + ["greedy"]
    params = [SETTINGS.get(n, SamplingParams()) for n in names]
    logits = torch.randn(len(params), V, generator=gen) * 2
    tokens = assert_each_row_as_stock(params, logits, gen)
    assert int(tokens[-1]) == int(logits[-1].argmax())  # the greedy row: the argmax
    suppressed = Sampler(V, torch.device("cpu"))
    toks, sc = suppressed(logits[-1:], [RowSample(SamplingParams(), 0, 0, (int(tokens[-1]),))])
    assert sc[0, int(tokens[-1])] == float("-inf") and int(toks[0]) != int(tokens[-1])


def test_step_seeds_of_a_batch_equal_each_rows_step_seed():
    gen = torch.Generator().manual_seed(17)
    seeds = torch.randint(0, 1 << 62, (300,), generator=gen).tolist() * 2
    seeds += [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -5]  # edges, and ints outside int64
    steps = torch.randint(0, 1 << 20, (len(seeds),), generator=gen).tolist()
    got = step_seeds(seeds, steps).tolist()
    assert got == [step_seed(s, t) for s, t in zip(seeds, steps)]


def test_every_row_sampling_with_its_own_values_each_gets_its_own():
    """Every row of the step uses every processor, each with its own value: the processors run
    in place on the whole batch (no gather and scatter), with per-row values."""
    gen = torch.Generator().manual_seed(11)
    params = [
        SamplingParams(do_sample=True, temperature=0.5 + 0.3 * r, top_k=3 + r, top_p=0.6 + 0.05 * r,
                       min_p=0.02 * r, repetition_penalty=1.0 + 0.2 * r)
        for r in range(5)
    ]  # fmt: skip
    assert_each_row_as_stock(params, torch.randn(len(params), V, generator=gen) * 3, gen)


def near_the_cut(s: torch.Tensor, top_p: float) -> bool:
    """Whether the mass below some score of row s is within float32 rounding of 1 - top_p
    (where the topk path's sums and the sort's may fall on either side of it). top_p 1 keeps
    every token by definition, with no sums."""
    if top_p >= 1.0:
        return False
    p = s.double().softmax(-1)
    below = torch.stack([p[s < v].sum() for v in s.unique()])
    return bool((below - (1 - top_p)).abs().min() < 1e-5)


TOPK_SETTINGS = [
    SamplingParams(do_sample=True, top_k=5),
    SamplingParams(do_sample=True, temperature=0.7, top_k=40, top_p=0.8),
    SamplingParams(do_sample=True, temperature=1.3, top_k=8, top_p=0.9, min_p=0.05,
                   repetition_penalty=1.2),
    SamplingParams(do_sample=True, top_k=100, min_p=0.1),
    SamplingParams(do_sample=True, top_k=250, top_p=0.95),  # (wider than the vocabulary: all)
    SamplingParams(),  # greedy rows beside them
    SamplingParams(repetition_penalty=1.5),
]  # fmt: skip


@pytest.mark.parametrize("logits_kind", ["float32", "bfloat16", "integers"])
def test_the_topk_path_draws_the_processors_tokens(triton_draws, logits_kind):
    """scheduler.sampling_kernel "topk" (its draw under the interpreter here): each sampling
    row warped over its top_k + TIE_SLACK largest scores and drawn over them gives the token
    the PyTorch processors and sample_rows give over the whole vocabulary, for the same seeds
    (penalties, suppressed ids, greedy rows beside), but where a top-p or min-p cut falls
    within rounding. bf16 and integer logits tie often (at the k-th score: every tied token
    kept; at a top-p cut: which the sort drops is its order's choice). Scores wanted, or a
    row without top_k: the processors' path itself."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    vocab, rows = 300, 3 * len(TOPK_SETTINGS)
    params = [p for p in TOPK_SETTINGS for _ in range(3)]
    params = [dataclasses.replace(p, seed=int(torch.randint(1 << 40, (), generator=gen)))
              for p in params]  # fmt: skip
    samples = [RowSample(p, r % 5, r, (3, 9) if r % 2 else ()) for r, p in enumerate(params)]
    ties = logits_kind != "float32"
    if logits_kind == "integers":
        logits = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    else:
        logits = (torch.randn(rows, vocab, generator=gen) * 3).to(getattr(torch, logits_kind))
    held = torch.randint(0, vocab, (rows, 5), generator=gen)
    topk, plain = Sampler(vocab, torch.device("cpu"), "topk"), Sampler(vocab, torch.device("cpu"))
    for sampler in (topk, plain):
        for r in range(rows):
            sampler.start_row(r, held[r])
    tokens, none = topk(logits, samples, scores_wanted=False)
    want, scores = plain(logits, samples)
    assert none is None and tokens.dtype == torch.int64
    # every draw a kept token, or one tied with a kept one (which of the tokens tied at a
    # top-p cut the sort drops is its own order's choice)
    base = plain._adjusted(logits, samples) / torch.tensor([[p.temperature] for p in params])
    for r in range(rows):
        lowest = base[r][scores[r].isfinite()].min()
        assert base[r, tokens[r]] >= lowest, (r, params[r])
    checked = 0
    for r, p in enumerate(params):
        cut = p.top_p < 1.0 and (ties or near_the_cut(scores[r][scores[r].isfinite()], p.top_p))
        if cut or (p.min_p is not None):  # (min-p's cut: a softmax over other sums)
            continue
        checked += 1
        assert int(tokens[r]) == int(want[r]), (r, p)
    assert checked >= 9  # top_k alone and the greedy rows at least
    # the warped candidates themselves: the tokens kept and their scores are the processors'
    _, _, vals, ids, _ = topk._top_k_warped(logits, samples)
    sampling = [r for r, p in enumerate(params) if p.do_sample]
    for j, r in enumerate(sampling):
        p = params[r]
        near = p.top_p < 1.0 and near_the_cut(scores[r][scores[r].isfinite()], p.top_p)
        if near or (ties and p.top_p < 1.0):
            continue  # (ties at a top-p cut: which the sort drops is its order's choice)
        kept = vals[j].isfinite()
        assert sorted(ids[j][kept].tolist()) == scores[r].isfinite().nonzero().flatten().tolist()
        torch.testing.assert_close(vals[j][kept], scores[r][ids[j][kept]], rtol=1e-6, atol=1e-6)
    again, wanted = topk(logits, samples)  # scores wanted: the processors' path
    assert torch.equal(again, want) and torch.equal(wanted, scores)
    no_k = [RowSample(SamplingParams(do_sample=True, top_p=0.9, seed=1), 0, 0)]
    assert torch.equal(topk(logits[:1], no_k, scores_wanted=False)[0], plain(logits[:1], no_k)[0])


def test_the_topk_path_beyond_its_tie_slack_draws_only_kept_tokens(triton_draws):
    """A row whose k-th largest score is tied by more tokens than TIE_SLACK: the path draws
    among the top_k + TIE_SLACK it holds, every one a token the processors keep."""
    vocab = 400
    logits = torch.zeros(4, vocab)
    logits[:, :3] = 1.0  # 3 above, 397 tied at the k-th score (top_k 10)
    rows = [RowSample(SamplingParams(do_sample=True, top_k=10, seed=s), 0, s) for s in range(4)]
    tokens, _ = Sampler(vocab, torch.device("cpu"), "topk")(logits, rows, scores_wanted=False)
    _, scores = Sampler(vocab, torch.device("cpu"))(logits, rows)
    assert scores.isfinite().all()  # the processors keep every tied token
    assert ((tokens >= 0) & (tokens < vocab)).all()
    assert scores.gather(1, tokens[:, None]).isfinite().all()


def assert_top_of_each_row(x: torch.Tensor, vals: torch.Tensor, ids: torch.Tensor, width: int):
    """vals / ids are each row's `width` largest scores, largest first, and their columns:
    torch.topk's values exactly, columns distinct and holding those values."""
    want, _ = x.float().topk(width, dim=-1)
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64
    assert vals.shape == ids.shape == (x.shape[0], width)
    assert torch.equal(vals, want)
    assert ((ids >= 0) & (ids < x.shape[1])).all()
    assert torch.equal(x.float().gather(1, ids), vals)
    assert all(len(set(row.tolist())) == width for row in ids)


@pytest.mark.parametrize("kind,dtype", [("random", torch.float16), ("ties", torch.float32),
                                        ("ulps", torch.float32), ("ulps", torch.float16),
                                        ("few finite", torch.float32)])  # fmt: skip
def test_top_candidates_are_each_rows_largest_scores(kind, dtype):
    """The chunked selection (under the interpreter): every chunk's W largest, then topk over
    those, gives torch.topk's values with their own columns, for ties at the cut (integer
    scores: which tied column is taken may differ), scores a unit in the last place apart
    beside +-1e4 in every chunk (the bisection must run to the last bit), a last chunk
    shorter than W (its columns past the end never come out) and rows with fewer finite
    scores than the width."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    rows, vocab, width, chunk = 3, 5 * 128 + 9, 20, 128  # W 32: the last chunk holds 9
    if kind == "ties":
        x = torch.randint(-3, 3, (rows, vocab), generator=gen).to(dtype)
    elif kind == "ulps":
        width = 32  # = W: a chunk may have to give every one of its candidates
        ulp = torch.finfo(dtype).eps
        x = torch.stack([1 + torch.randperm(vocab, generator=gen).to(dtype) * ulp
                         for _ in range(rows)])  # fmt: skip
        x[:, ::64] = 1e4
        x[:, 1::64] = -1e4
    else:
        x = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    if kind == "few finite":
        x[0, torch.randperm(vocab, generator=gen)[: vocab - 7]] = float("-inf")  # 7 finite
        x[1, :-3] = float("-inf")  # 3 finite, all in the short last chunk
    vals, ids = top_candidates(x, width, chunk)
    if kind != "few finite":
        assert_top_of_each_row(x, vals, ids, width)
        return
    want, _ = x.float().topk(width, dim=-1)
    assert torch.equal(vals, want)  # finite ones first, -inf after
    finite = vals.isfinite()
    assert torch.equal(x.float().gather(1, ids)[finite], vals[finite])
    assert ((ids >= 0) & (ids < vocab)).all()


def test_top_candidates_take_torch_topk_where_chunks_save_nothing_and_refuse_bad_widths():
    x = torch.randn(2, 300)
    for width, chunk in ((10, 256), (40, 128), (300, 16)):  # 2 chunks or fewer; W > chunk / 4
        assert_top_of_each_row(x, *top_candidates(x, width, chunk), width)
    for width in (0, 301):
        with pytest.raises(ValueError, match=f"width {width} for rows of 300 scores"):
            top_candidates(x, width)
    with pytest.raises(ValueError, match="chunk 100: want a power of two"):
        top_candidates(x, 5, 100)
    with pytest.raises(ValueError, match=r"want scores \[R, V\]"):
        top_candidates(x[0], 5)


def test_the_topk_path_on_chunked_candidates_draws_what_whole_rows_give(triton_draws, monkeypatch):
    """The Sampler's "topk" path with its candidates from the chunk kernel (TOP_CHUNK cut to
    512 so that a 2,600-token vocabulary takes it under the interpreter): the same warped
    candidates and tokens as with torch.topk over whole rows (float32 logits: no ties)."""
    from oxygen_torch.engine import sampling

    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    vocab = 2600
    settings = [SamplingParams(do_sample=True, top_k=5),
                SamplingParams(do_sample=True, temperature=0.7, top_k=40, top_p=0.8),
                SamplingParams(do_sample=True, temperature=1.3, top_k=8, min_p=0.05,
                               repetition_penalty=1.2),
                SamplingParams()]  # fmt: skip
    params = [dataclasses.replace(p, seed=int(torch.randint(1 << 40, (), generator=gen)))
              for p in settings for _ in range(2)]  # fmt: skip
    samples = [RowSample(p, r % 3, r, (3,) if r % 2 else ()) for r, p in enumerate(params)]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    held = torch.randint(0, vocab, (len(params), 5), generator=gen)
    got = {}
    monkeypatch.setattr(kernels, "TOP_CHUNK", 512)  # width 104 -> W 128: chunks of 512
    for name in ("chunks", "whole rows"):
        if name == "whole rows":
            monkeypatch.setattr(sampling, "top_candidates", lambda s, w: s.float().topk(w, dim=-1))
        sampler = Sampler(vocab, torch.device("cpu"), "topk")
        for r in range(len(params)):
            sampler.start_row(r, held[r])
        got[name] = (sampler(logits, samples, scores_wanted=False)[0],
                     sampler._top_k_warped(logits, samples))  # fmt: skip
    (tokens, warped), (want, want_warped) = got["chunks"], got["whole rows"]
    assert torch.equal(tokens, want)
    for a, b in zip(warped[1:], want_warped[1:]):  # vals, ids, seeds (greedy rows: argmax)
        assert torch.equal(a, b)


def test_sample_candidates_is_sample_rows_on_the_kept_tokens():
    """The candidate draw over any subset holding every kept token equals sample_rows over the
    whole row (same seed: token i's noise is column i's); an all -inf row gives 0."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    rows, vocab = 6, 500
    scores = torch.randn(rows, vocab, generator=gen) * 2
    keep = torch.rand(rows, vocab, generator=gen) < 0.05
    keep[:, 0] = True
    scores = scores.masked_fill(~keep, float("-inf"))
    scores[5] = float("-inf")
    seeds = torch.randint(-(1 << 62), 1 << 62, (rows,), generator=gen)
    want = sample_rows(scores, seeds, torch.zeros(rows, dtype=torch.bool))
    width = int(keep.sum(1).max()) + 7  # the kept tokens plus some filtered ones, shuffled
    ids = torch.stack([torch.cat([keep[r].nonzero().flatten(), (~keep[r]).nonzero().flatten()])[
        :width][torch.randperm(width, generator=gen)] for r in range(rows)])  # fmt: skip
    got = sample_candidates(scores.gather(1, ids), ids, seeds)
    assert got[:5].tolist() == want[:5].tolist() and int(got[5]) == 0


@pytest.mark.cuda
@pytest.mark.parametrize("rows,width", [(1, 114), (256, 114), (7, 1000)])
def test_top_candidates_on_the_gpu_are_torch_topks_on_bf16_logits(rows, width):
    """The chunk kernel on the GPU, bf16 logits of a 128k vocabulary (model-like: a few likely
    tokens over a long tail, ties common), the widths the sampler asks (top_k 50 + the tie
    slack; W 1024, a quarter of the default chunk: the widest the kernel takes), without a
    wait for the stream."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (runs on the H200 device machine)")
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    x = (torch.randn(rows, 128256, device="cuda", generator=gen) * 2).bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the engine's step never waits for the stream
    try:
        vals, ids = top_candidates(x, width)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_top_of_each_row(x, vals, ids, width)


@pytest.mark.cuda
def test_a_step_of_every_processor_on_the_gpu_does_not_wait_for_the_stream():
    """Every setting in one batch on CUDA: the scores equal the CPU's, and the call returns
    while the stream is still busy (its host values go through pinned memory: a pageable copy
    waits for the stream, and the engine could not prepare a step while the GPU ran one)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (runs on the H200 device machine)")
    gen = torch.Generator().manual_seed(11)
    names = list(SETTINGS) + ["greedy"]
    params = [SETTINGS.get(n, SamplingParams()) for n in names] * 8
    rows = [RowSample(p, 3, r, (1,) if r % 3 == 0 else ()) for r, p in enumerate(params)]
    logits = torch.randn(len(params), V, generator=gen) * 2
    held = held_tokens(len(params), gen)
    out = {}
    for dev in ("cpu", "cuda"):
        sampler = Sampler(V, torch.device(dev))
        for r in range(len(params)):
            sampler.start_row(r, held[r])
        on = logits.to(dev)
        sampler(on, rows)  # (warm: Triton's draw compiled, the host allocator's blocks made)
        torch.cuda.synchronize()
        if dev == "cuda":
            torch.cuda._sleep(1 << 30)  # the stream busy for ~0.5 s
        t0 = time.perf_counter()
        tokens, scores = sampler(on, rows)
        out[dev] = (time.perf_counter() - t0, tokens.cpu(), scores.cpu())
    host_s, tokens, scores = out["cuda"]
    torch.testing.assert_close(scores, out["cpu"][2], rtol=1e-5, atol=1e-5)
    greedy = [r for r, p in enumerate(params) if not p.do_sample]
    assert tokens[greedy].tolist() == out["cpu"][1][greedy].tolist()
    assert host_s < 0.1, f"the sampler waited {host_s:.3f} s for the stream"


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["torch", "topk"])
def test_no_step_of_the_sampler_synchronises_the_stream(kernel):
    """A penalised row's start, a step of every setting (suppressed ids included) and the new
    tokens noted, under torch.cuda.set_sync_debug_mode("error"): none of it may wait for the
    stream (`t[rows, cols] = value` did: its Python value is copied from pageable memory).
    "topk" (the default): every sampling row given a top_k and no scores wanted, so its path
    takes the step."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (runs on the H200 device machine)")
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ()).item()))
    names = list(SETTINGS) + ["greedy"]
    params = [SETTINGS.get(n, SamplingParams()) for n in names] * 4
    if kernel == "topk":
        params = [dataclasses.replace(p, top_k=p.top_k or 40) if p.do_sample else p for p in params]
    rows = [RowSample(p, 2, r, (1, 5) if r % 2 == 0 else ()) for r, p in enumerate(params)]
    logits = (torch.randn(len(params), V, generator=gen) * 2).cuda()
    held = [h.cuda() for h in held_tokens(len(params), gen)]
    sampler = Sampler(V, torch.device("cuda"), kernel)
    for r in range(len(params)):  # (as the engine does: every row's mask line before its step)
        sampler.start_row(r, held[r])
    wanted = kernel != "topk"
    sampler(logits, rows, scores_wanted=wanted)  # (warm: compiles, first pinned blocks)
    torch.cuda.synchronize()
    slots = torch.arange(len(params), device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for r in range(len(params)):
            sampler.start_row(r, held[r])
        tokens, scores = sampler(logits, rows, scores_wanted=wanted)
        sampler.note(slots, tokens)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    if kernel == "topk":  # (no scores: the suppressed ids were never drawn)
        assert scores is None and not tokens[0::2].eq(5).any() and not tokens[0::2].eq(1).any()
    else:
        assert scores[torch.arange(0, len(params), 2), 5].eq(float("-inf")).all()
    assert sampler.seen[slots, tokens].all()


def test_a_penalised_row_without_its_mask_line_is_a_clear_error():
    """A penalised row whose penalty-mask line was never started (start_row) is refused on
    the host, naming its slot, before index_select could read past the mask (on a GPU a
    device-side assert that leaves the CUDA context unusable); started, the same step runs."""
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ()).item()))
    slot = int(torch.randint(16, 40, (), generator=gen))
    rows = [
        RowSample(SamplingParams(repetition_penalty=1.3), 0, slot),
        RowSample(SamplingParams(), 0, 0),
    ]
    logits = torch.randn(2, V, generator=gen)
    sampler = Sampler(V, torch.device("cpu"))
    for started in ([], [0]):
        for r in started:
            sampler.start_row(r, torch.tensor([1, 2]))
        with pytest.raises(RuntimeError, match=f"slot {slot} has no penalty-mask line"):
            sampler(logits, rows)
    held = torch.randint(V, (5,), generator=gen)
    sampler.start_row(slot, held)
    tokens, scores = sampler(logits, rows)
    ref = logits[0].clone()
    ref[held] = torch.where(ref[held] < 0, ref[held] * 1.3, ref[held] / 1.3)
    assert torch.allclose(scores[0], ref) and int(tokens[0]) == int(ref.argmax())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool])
def test_put_value_equals_the_indexed_assignment(dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(1 << 30, ()).item()))
    t = (
        (torch.randn(9, 40, generator=gen) > 0)
        if dtype == torch.bool
        else torch.randn(9, 40, generator=gen).to(dtype)
    )
    ref = t.clone()
    n = int(torch.randint(1, 30, (), generator=gen))
    rows, cols = torch.randint(9, (n,), generator=gen), torch.randint(40, (n,), generator=gen)
    value = True if dtype == torch.bool else float("-inf")
    put_value(t, (rows, cols), value)
    ref[rows, cols] = value
    assert torch.equal(t, ref)
    put_value(t[3], (cols,), False if dtype == torch.bool else 2.5)  # a row's view, one index
    ref[3, cols] = False if dtype == torch.bool else 2.5
    assert torch.equal(t, ref)


@pytest.mark.cuda
def test_put_value_is_an_indexed_assignment_without_a_wait():
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (runs on the H200 device machine)")
    t = torch.randn(8, 33, device="cuda")
    ref = t.clone()
    rows = torch.tensor([0, 3, 3, 7], device="cuda")
    cols = torch.tensor([1, 0, 32, 5], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        put_value(t, (rows, cols), float("-inf"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref[rows, cols] = float("-inf")
    assert torch.equal(t, ref)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) over the tokens the probabilities allow."""
    keep = probs > 0
    n = counts.sum()
    expected = probs[keep] * n
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    return stat, int(keep.sum()) - 1


def chi2_limit(dof: int) -> float:
    """A bound the statistic passes with probability ~1 - 1e-6 (Wilson-Hilferty)."""
    z = 4.9
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("name", list(SETTINGS))
def test_draws_follow_the_processed_probabilities(name):
    """Many rows of the same logits, each with its own seed: the tokens drawn are distributed
    as softmax(processed scores); filtered tokens are never drawn."""
    gen = torch.Generator().manual_seed(11)
    p = SETTINGS[name]
    logits = torch.randn(1, V, generator=gen) * 2
    held = held_tokens(1, gen)
    rows = 4000
    sampler = Sampler(V, torch.device("cpu"))
    for r in range(rows):
        sampler.start_row(r, held[0])
    samples = [RowSample(SamplingParams(**{**p.__dict__, "seed": 1000 + r}), 0, r)
               for r in range(rows)]  # fmt: skip
    tokens, scores = sampler(logits.expand(rows, V).contiguous(), samples)
    probs = scores[0].softmax(-1)
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[probs == 0].sum() == 0
    stat, dof = chi_square(counts, probs.double())
    if dof > 0:
        assert stat < chi2_limit(dof), (name, stat, dof)


def test_the_kernel_draws_by_its_seeds_and_its_greedy_rows_take_the_first_maximum():
    """triton_kernels.sample_rows under the interpreter: the same seeds the same draws, whoever
    else is in the launch; greedy rows the first of tied maxima; frequencies near the
    probabilities (the GPU suite tests the distribution at scale)."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 9, generator=gen)
    logits[2, 4] = logits[2, 7] = logits[2].max() + 1  # a tie: the first index wins
    seeds = torch.tensor([step_seed(s, 0) for s in range(6)])
    greedy = torch.tensor([False, False, True, False, False, False])
    a = sample_rows(logits, seeds, greedy)
    b = sample_rows(logits[[0, 2, 1]], seeds[[0, 2, 1]], greedy[[0, 2, 1]])
    assert int(a[2]) == 4 and torch.equal(b, a[[0, 2, 1]])
    filtered = logits[0].clone()
    filtered[3] = float("-inf")
    n = 200
    tok = sample_rows(filtered.expand(n, 9).contiguous(),
                      torch.tensor([step_seed(s, 7) for s in range(n)]),
                      torch.zeros(n, dtype=torch.bool))  # fmt: skip
    assert not (tok == 3).any()
    freq = torch.bincount(tok, minlength=9).double() / n
    assert (freq - filtered.softmax(-1).double()).abs().max() < 0.12


def test_reference_draw_matches_its_seeds():
    logits = torch.randn(3, 9)
    seeds = torch.tensor([1, 2, 3])
    greedy = torch.tensor([False, True, False])
    a = sample_rows_ref(logits, seeds, greedy)
    assert torch.equal(a, sample_rows_ref(logits, seeds, greedy))
    assert int(a[1]) == int(logits[1].argmax())
