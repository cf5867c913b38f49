"""Logits processing and sampling for every row of a step at once, on the step's device.

Each row carries its own settings (SamplingParams); a step gathers them into a few tensors and
runs each processor once, on the rows that use it, in transformers' order: repetition penalty,
the minimum length (EOS suppressed), then for sampling rows temperature, top-k, top-p, min-p.
The draw (triton_kernels/sampling.py) is Gumbel-max keyed by a per-row seed mixed with the
row's step count: a call's samples depend on its own seed and logits, never on who else shares
the step. Greedy rows take the first maximum, as torch.argmax does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..kv.transfer import put_value, to_device
from ..triton_kernels.sampling import (
    sample_candidates,
    sample_rows,
    sample_rows_ref,
    top_candidates,
)

_MASK64 = (1 << 64) - 1
# scheduler.sampling_kernel "topk": rows whose top_k is at most TOPK_MAX are warped and drawn
# over their top_k + TIE_SLACK largest scores (tokens tied with the k-th largest beyond that
# many are kept by the processors but cannot be drawn here)
TOPK_MAX, TIE_SLACK = 1024, 64


@dataclass(frozen=True)
class SamplingParams:
    """One row's settings, as transformers' generation config gives them (0 / 1.0 / None:
    the processor is off)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.do_sample and not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature: {self.temperature!r}; allowed: a finite number > 0")
        if not 0 <= self.top_k:
            raise ValueError(f"top_k: {self.top_k!r}; allowed: an integer >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p: {self.top_p!r}; allowed: 0 to 1")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: {self.min_p!r}; allowed: 0 to 1")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(
                f"repetition_penalty: {self.repetition_penalty!r}; allowed: a finite number > 0"
            )

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def plain(self) -> bool:
        """Greedy with nothing to process: the draw is the logits' argmax."""
        return not self.do_sample and not self.penalised


def step_seed(seed: int, step: int) -> int:
    """The row's seed for its `step`-th draw (splitmix64 of the two): every draw of every row
    has its own Philox key."""
    z = (seed + (step + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z  # as a signed int64


def step_seeds(seeds: list[int], steps: list[int]) -> np.ndarray:
    """step_seed of every row at once (int64 [K]): numpy's uint64 arithmetic wraps as the mask
    does (256 rows: ~15 us against ~110 for the Python loop)."""
    try:
        s = np.array(seeds, dtype=np.int64).view(np.uint64)
    except OverflowError:  # (calls' seeds are in [0, 2^63); any int is taken mod 2^64)
        s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
    z = s + (np.array(steps, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))).view(np.int64)


@dataclass
class RowSample:
    """What one kept row of a step needs from the sampler."""

    params: SamplingParams
    step: int  # tokens this row sampled before (its draw's counter)
    slot: int  # the row's line in the penalty mask (Sampler.seen)
    suppress: tuple[int, ...] = ()  # token ids set to -inf this step (EOS before min length)


class Sampler:
    """The processors and the draw of one engine; holds the repetition-penalty mask."""

    def __init__(self, vocab: int, device: torch.device, kernel: str = "torch"):
        self.vocab, self.device = vocab, device
        self.kernel = kernel  # scheduler.sampling_kernel: "torch" or "topk"
        self.seen: torch.Tensor | None = None  # [slots, V] bool: tokens a penalised row holds

    # --- the penalty mask ---------------------------------------------------------------

    def _mask(self, slots: int) -> torch.Tensor:
        if self.seen is None or self.seen.shape[0] < slots:
            grown = torch.zeros(max(slots, 16), self.vocab, dtype=torch.bool, device=self.device)
            if self.seen is not None:
                grown[: self.seen.shape[0]] = self.seen
            self.seen = grown
        return self.seen

    def start_row(self, slot: int, tokens: torch.Tensor) -> None:
        """A penalised row's mask starts as its prompt's tokens (padding included, as
        transformers' penalty reads input_ids). tokens: 1-D ids on any device."""
        seen = self._mask(slot + 1)
        seen[slot] = False
        ids = tokens.to(torch.int64)
        ids = to_device(ids, self.device) if ids.device.type == "cpu" else ids.to(self.device)
        put_value(seen[slot], (ids,), True)

    def note(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Penalised rows' new tokens join their masks (device ops only)."""
        if slots.numel():
            put_value(self.seen, (slots, tokens), True)

    # --- one step -------------------------------------------------------------------------

    def __call__(self, logits: torch.Tensor, rows: list[RowSample], scores_wanted=True) -> tuple:
        """logits: [K, V] (any float dtype) for the step's kept rows, in `rows` order.
        Returns (tokens [K] int64 on the device, the processed scores [K, V] float32, or None
        when not `scores_wanted` and the "topk" path drew the tokens)."""
        if self.kernel == "topk" and not scores_wanted and _kernel_ok(logits) and _topk_rows(rows):
            return self._from_top_k(logits, rows), None
        return self._processed(logits, rows)

    def _processed(self, logits, rows: list[RowSample]) -> tuple:
        """The processors in PyTorch on a float32 copy, then the draw over what they kept:
        (tokens, the processed scores)."""
        params = [r.params for r in rows]
        scores = self._adjusted(logits, rows)
        sampling = [i for i, p in enumerate(params) if p.do_sample]
        if sampling:
            self._warp(scores, params, sampling)
        if not sampling:
            return scores.argmax(-1), scores
        seeds = step_seeds([p.seed for p in params], [r.step for r in rows])
        greedy = np.array([not p.do_sample for p in params], dtype=np.int64)
        both = to_device(torch.from_numpy(np.concatenate([seeds, greedy])), self.device)
        fn = sample_rows if _kernel_ok(scores) else sample_rows_ref
        k = len(rows)
        return fn(scores, both[:k], both[k:].bool()), scores

    def _adjusted(self, logits: torch.Tensor, rows: list[RowSample]) -> torch.Tensor:
        """A float32 copy of the logits with the repetition penalty and the suppressed ids
        applied (transformers processes float32 copies too)."""
        scores = logits.float()
        if scores.data_ptr() == logits.data_ptr():
            scores = scores.clone()
        pen = [i for i, r in enumerate(rows) if r.params.penalised]
        if pen:
            self._penalise(scores, rows, pen)
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.suppress]
        if pairs:
            at = self._ints([i for i, _ in pairs] + [t for _, t in pairs])
            put_value(scores, (at[: len(pairs)], at[len(pairs) :]), float("-inf"))
        return scores

    def _from_top_k(self, logits: torch.Tensor, rows: list[RowSample]) -> torch.Tensor:
        """scheduler.sampling_kernel "topk", when every sampling row has 0 < top_k <= TOPK_MAX
        and no row wants its scores: each sampling row's top_k + TIE_SLACK largest scores (one
        topk over the logits, no float32 copy of [K, V] unless a penalty or a suppressed id
        needs one, no sort of the vocabulary), then transformers' warpers on those candidates
        alone (temperature, top-k, top-p, min-p: the tokens they drop are all outside the
        candidates) and the draw over them with the noise sample_rows gives each token id.
        Greedy rows take the argmax. The tokens are the processors' for the same seeds but
        where a top-p or min-p cut falls within float32 rounding (the sums run over the
        candidates, not the vocabulary) and where more than TIE_SLACK tokens tie with a row's
        k-th largest score."""
        tokens, at, vals, ids, seeds = self._top_k_warped(logits, rows)
        drawn = sample_candidates(vals, ids, seeds)
        return drawn if tokens is None else tokens.index_copy_(0, at, drawn)

    def _top_k_warped(self, logits: torch.Tensor, rows: list[RowSample]) -> tuple:
        """_from_top_k's rows before the draw: (the greedy rows' argmax over every row and the
        sampling rows' index on the device, both None when every row samples; the sampling
        rows' candidates' processed scores [S, C] float32, -inf where a warper dropped one, and
        token ids [S, C]; their draw seeds [S])."""
        params = [r.params for r in rows]
        adjust = any(p.penalised for p in params) or any(r.suppress for r in rows)
        base = self._adjusted(logits, rows) if adjust else logits
        sampling = [i for i, p in enumerate(params) if p.do_sample]
        tokens = base.argmax(-1) if len(sampling) < len(rows) else None
        sub, at = self._take(base, sampling)
        ks = [params[i].top_k for i in sampling]
        width = min(base.shape[1], max(ks) + TIE_SLACK)
        # largest first; on the GPU a chunked selection reads the logits once, then torch.topk
        # over each row's few thousand candidates (torch.topk over 128k columns was most of it)
        vals, ids = top_candidates(sub, width) if _kernel_ok(sub) else sub.topk(width, dim=-1)
        vals = vals.float()
        seeds = step_seeds([params[i].seed for i in sampling], [rows[i].step for i in sampling])
        values = np.array([
            [params[i].temperature for i in sampling],
            [1.0 - params[i].top_p for i in sampling],
            [params[i].min_p or 0.0 for i in sampling],
        ], dtype=np.float32)  # fmt: skip
        ints = np.concatenate([seeds, np.array([min(k, width) - 1 for k in ks], dtype=np.int64)])
        f = to_device(torch.from_numpy(values), self.device)
        n = to_device(torch.from_numpy(ints), self.device)
        neg = float("-inf")
        if any(params[i].temperature != 1.0 for i in sampling):
            vals = vals / f[0][:, None]  # transformers divides by the temperature
        kth = vals.gather(1, n[len(sampling) :, None])
        vals = vals.masked_fill(vals < kth, neg)
        if any(params[i].top_p < 1.0 for i in sampling):
            # transformers: drop the tokens whose ascending cumulative probability is <=
            # 1 - top_p, the largest always kept; in descending order that mass is the
            # suffix sum, summed from the smallest up as the ascending cumsum is
            mass = vals.softmax(dim=-1).flip(-1).cumsum(dim=-1).flip(-1)
            drop = mass <= f[1][:, None]
            drop[:, 0] = False
            vals = vals.masked_fill(drop, neg)
        if any(params[i].min_p is not None for i in sampling):
            probs = vals.softmax(dim=-1)
            vals = vals.masked_fill(probs < f[2][:, None] * probs[:, :1], neg)
        return tokens, at, vals, ids, n[: len(sampling)]

    # Every host value a step hands the GPU goes through pinned memory (kv/transfer.py
    # to_device): a copy from pageable memory waits for the stream, so the engine could not
    # prepare step n+1 while the GPU ran step n (H200, 64 sampling rows: a decode step's launch
    # 3.48 ms of host against greedy's 1.1-1.3 ms).

    def _ints(self, values: list) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), self.device)

    def _floats(self, values: list) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.float32), self.device)

    def _take(self, scores: torch.Tensor, rows: list[int]) -> tuple:
        """(the rows' scores, their index or None). Every row of the step: the scores
        themselves, processed in place (at 256 rows of a 128k vocabulary each pass is 131 MB:
        a gather and a scatter around each processor were two of its three passes)."""
        if len(rows) == scores.shape[0]:
            return scores, None
        idx = self._ints(rows)
        return scores.index_select(0, idx), idx

    @staticmethod
    def _put(scores: torch.Tensor, sub: torch.Tensor, idx: torch.Tensor | None) -> None:
        if idx is not None:
            scores.index_copy_(0, idx, sub)

    def _penalise(self, scores: torch.Tensor, rows: list[RowSample], pen: list[int]) -> None:
        """transformers' RepetitionPenaltyLogitsProcessor on the rows that ask: a held token's
        score is divided by the penalty (multiplied, when negative)."""
        want = [rows[i].slot for i in pen]
        lines = 0 if self.seen is None else self.seen.shape[0]
        if max(want) >= lines:  # on a GPU, index_select past the mask is a device assert
            raise RuntimeError(  # that leaves the CUDA context unusable for every call
                f"Sampler: a penalised row's slot {max(want)} has no penalty-mask line "
                f"({lines} started): start_row() before its first step"
            )
        sub, idx = self._take(scores, pen)
        slots = self._ints(want)
        penalty = self._floats([[rows[i].params.repetition_penalty] for i in pen])
        held = self.seen.index_select(0, slots)
        hit = torch.where(sub < 0, sub * penalty, sub / penalty)
        sub.copy_(torch.where(held, hit, sub))
        self._put(scores, sub, idx)

    def _warp(self, scores: torch.Tensor, params: list[SamplingParams], sampling: list[int]):
        """Temperature, top-k, top-p and min-p on the sampling rows, each processor once over
        the rows that use it (transformers' warpers, min_tokens_to_keep 1)."""
        neg = float("-inf")
        temps = [i for i in sampling if params[i].temperature != 1.0]
        if temps:
            sub, idx = self._take(scores, temps)
            values = {params[i].temperature for i in temps}
            if len(values) == 1:
                sub.div_(values.pop())  # one temperature for all: no tensor to upload
            else:
                sub.div_(self._floats([[params[i].temperature] for i in temps]))
            self._put(scores, sub, idx)
        k_rows = [i for i in sampling if params[i].top_k]
        if k_rows:
            sub, idx = self._take(scores, k_rows)
            ks = [min(params[i].top_k, scores.shape[1]) for i in k_rows]
            top = sub.topk(max(ks), dim=-1).values
            kth = top.gather(1, self._ints([[k - 1] for k in ks]))
            sub.masked_fill_(sub < kth, neg)
            self._put(scores, sub, idx)
        p_rows = [i for i in sampling if params[i].top_p < 1.0]
        if p_rows:
            sub, idx = self._take(scores, p_rows)
            ps = self._floats([[params[i].top_p] for i in p_rows])
            srt, order = sub.sort(dim=-1, descending=False)
            cum = srt.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - ps)
            drop[:, -1] = False
            drop = drop.scatter(1, order, drop)
            sub.masked_fill_(drop, neg)
            self._put(scores, sub, idx)
        m_rows = [i for i in sampling if params[i].min_p is not None]
        if m_rows:
            sub, idx = self._take(scores, m_rows)
            probs = sub.softmax(dim=-1)
            mp = self._floats([[params[i].min_p] for i in m_rows])
            cut = mp * probs.amax(dim=-1, keepdim=True)
            sub.masked_fill_(probs < cut, neg)
            self._put(scores, sub, idx)


def _topk_rows(rows: list[RowSample]) -> bool:
    """Whether the "topk" path takes the step: a sampling row, and every one with a top_k."""
    sampling = [r.params for r in rows if r.params.do_sample]
    return bool(sampling) and all(0 < p.top_k <= TOPK_MAX for p in sampling)


def _kernel_ok(t: torch.Tensor) -> bool:
    """The Triton draw on CUDA; elsewhere the PyTorch one (the interpreter runs the kernel at
    tens of ms a row: triton_kernels' tests cover it there)."""
    return t.device.type == "cuda"
