"""The engine's batched processors and draw (engine/sampling.py, triton_kernels/sampling.py):
each processor against transformers' own on fresh random logits, and the draw's distribution
against the processed probabilities (a chi-square test on a small vocabulary)."""

from __future__ import annotations

import math
import time

import pytest
import torch
import transformers as T
from oxygen_torch.triton_kernels.sampling import (
    sample_rows,
    sample_rows_ref,
    top_p_cut,
    top_p_cut_ref,
)

from oxygen_torch.engine.sampling import RowSample, Sampler, SamplingParams, step_seed, step_seeds

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


def test_rows_with_different_settings_in_one_batch_each_get_their_own():
    gen = torch.Generator().manual_seed(3)
    names = list(SETTINGS) + ["greedy"]
    params = [SETTINGS.get(n, SamplingParams()) for n in names]
    logits = torch.randn(len(params), V, generator=gen) * 2
    held = held_tokens(len(params), gen)
    sampler = Sampler(V, torch.device("cpu"))
    for r in range(len(params)):
        sampler.start_row(r, held[r])
    tokens, scores = sampler(logits, [RowSample(p, 0, r) for r, p in enumerate(params)])
    for r, p in enumerate(params):
        want = stock_processors(p)(held[r : r + 1], logits[r : r + 1].clone())
        torch.testing.assert_close(scores[r : r + 1], want, rtol=1e-6, atol=1e-6)
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
    logits = torch.randn(len(params), V, generator=gen) * 3
    held = held_tokens(len(params), gen)
    sampler = Sampler(V, torch.device("cpu"))
    for r in range(len(params)):
        sampler.start_row(r, held[r])
    _, scores = sampler(logits, [RowSample(p, 0, r) for r, p in enumerate(params)])
    for r, p in enumerate(params):
        want = stock_processors(p)(held[r : r + 1], logits[r : r + 1].clone())
        torch.testing.assert_close(scores[r : r + 1], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("vocab", [7, 300, 1500])
def test_the_top_p_cut_kernel_equals_its_float64_reference(vocab):
    """top_p_cut under the interpreter against the sort in float64, on fresh rows: random
    scores, integer ones (ties at the cut), half the vocabulary filtered, top_p from 0 to 1.
    A row may differ only where the mass below a score is within float32 rounding of 1 - top_p
    (the sums' order differs); most rows are not such rows."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    ps = torch.tensor([0.0, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0])
    s = torch.randn(len(ps), vocab, generator=gen) * 3
    s[1] = torch.randint(-3, 3, (vocab,), generator=gen).float()  # ties
    s[2, torch.randperm(vocab, generator=gen)[: vocab // 2]] = float("-inf")
    got, want = top_p_cut(s, ps), top_p_cut_ref(s, ps)
    p = s.double().softmax(-1)
    checked = 0
    for r in range(len(ps)):
        below = torch.stack([p[r][s[r] < v].sum() for v in s[r].unique()])
        if (below - (1 - ps[r].double())).abs().min() < 1e-5:
            continue  # (the rounding's side of the cut)
        checked += 1
        assert torch.equal(s[r] >= got[r], s[r] >= want[r]), (r, float(got[r]), float(want[r]))
    assert checked >= len(ps) - 2
    # the cut's meaning, directly: at p = 0 only the maximum stays; at p = 1 every token
    assert float(got[0]) == float(s[0].max()) and float(got[-1]) == float(s[-1].min())


@pytest.mark.cuda
def test_the_top_p_cut_kernel_on_the_gpu_equals_its_reference():
    """On the GPU at a real vocabulary: 64 rows of 32,000 float32 scores, and the same as bf16
    (ties), top_p 0.5-0.99: the kept tokens equal the float64 sort's on rows whose cut is not
    within rounding (most of them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (runs on the H200 device machine)")
    gen = torch.Generator(device="cuda").manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    s = torch.randn(64, 32000, device="cuda", generator=gen) * 2
    ps = torch.rand(64, device="cuda", generator=gen) * 0.49 + 0.5
    for scores in (s, s.bfloat16().float()):
        got, want = top_p_cut(scores, ps), top_p_cut_ref(scores, ps)
        same = ((scores >= got[:, None]) == (scores >= want[:, None])).all(-1)
        assert same.float().mean() > 0.9, same.float().mean()


@pytest.mark.parametrize("name", ["top_p", "all"])
def test_the_sampler_with_the_cut_kernel_equals_transformers(monkeypatch, name):
    """scheduler.top_p_kernel "cut" (the kernel under the interpreter here): processed scores
    equal transformers' top-p on rows without ties; a bad setting names the field."""
    from oxygen_torch.config import load_config
    from oxygen_torch.engine import sampling

    monkeypatch.setattr(sampling, "_kernel_ok", lambda t: True)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    p = SETTINGS[name]
    logits = torch.randn(6, V, generator=gen) * 3
    held = held_tokens(6, gen)
    sampler = Sampler(V, torch.device("cpu"), top_p_kernel="cut")
    for r in range(6):
        sampler.start_row(r, held[r])
    _, scores = sampler(logits, [RowSample(p, 0, r) for r in range(6)])
    want = stock_processors(p)(held, logits.clone())
    assert torch.equal(scores.isinf(), want.isinf())
    torch.testing.assert_close(scores, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="scheduler.top_p_kernel"):
        load_config(scheduler={"top_p_kernel": "fast"})


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
