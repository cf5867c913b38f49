"""Concurrent generate() calls on one model, merged step by step (the engine's transformers side).

While two or more generate() calls on the paged cache are live on one model (same KV pool,
precision and tiles), each forward they make becomes a request to the model's StepScheduler
(engine/scheduler.py) instead of running alone. The step runs one forward of the model over all
the requests' new real tokens packed into one row ([1, T], each token with its own position),
through a MergedStep (kv/merged.py) that writes and attends over every call's block table side by
side; each caller gets its rows of logits back, as its own forward would have returned them.
A call alone runs as before (decode graphs included). A forward the merge cannot take (inputs
embeddings, hidden states asked for, ...) runs alone, in its caller's thread.

Each registered call's core records the tokens it holds (kv/history.py: ids and positions per
row, also for the steps it ran alone), so a call the scheduler preempts has its KV recomputed at
its next step.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass

import torch

from ...engine.scheduler import Chunk, Request, StepScheduler
from ...engine.task import Task
from ...kv.history import History
from ...kv.merged import MergedStep, Part
from . import compat
from .cache import PagedKVCache, PagedLayer

_MERGEABLE = frozenset(
    {"input_ids", "attention_mask", "position_ids", "cache_position", "logits_to_keep"}
    | {"use_cache", "return_dict", *compat.CACHE_ARGS}
)


@dataclass
class CallState:
    """What the runner keeps of a call: its cache (whose core records the tokens it holds)."""

    cache: PagedKVCache


@dataclass
class Work:
    """One forward of one call, parsed: ids [B, q] (device), which new tokens are real (host),
    each token's position (host), the logits it wants (last `keep` columns; 0 = all)."""

    cache: PagedKVCache
    cache_name: str
    ids: torch.Tensor
    real: torch.Tensor  # [B, q] bool, host
    pos: torch.Tensor  # [B, q] int64, host
    keep: int
    done: int = 0  # columns served by earlier steps
    out: torch.Tensor | None = None  # the caller's logits, filled as the columns are served


class Merger:
    """The scheduler and runner of one model and one KV geometry."""

    def __init__(self, model, cache: PagedKVCache):
        self._model = weakref.ref(model)
        self.scheduler = StepScheduler(cache.cfg.scheduler, self)
        self.out_type = None
        self._lock = threading.Lock()

    # --- what the router asks -----------------------------------------------------------------

    def wanted(self, kw: dict, args: tuple) -> bool:
        return (
            self.scheduler.live() > 1
            and not args
            and isinstance(kw.get("input_ids"), torch.Tensor)
            and all(v is None or k in _MERGEABLE for k, v in kw.items())
            and (kw.get("logits_to_keep") is None or isinstance(kw.get("logits_to_keep"), int))
        )

    def forward(self, call, kw: dict):
        cache = compat.given_cache(kw)
        name = next(n for n in compat.CACHE_ARGS if kw.get(n) is cache)
        work = self._parse(cache, name, kw)
        return self.scheduler.submit(call, work)

    def _parse(self, cache: PagedKVCache, name: str, kw: dict) -> Work:
        ids = kw["input_ids"]
        real, pos = _real_and_positions(cache._core, kw, ids.shape)
        real = torch.ones(ids.shape, dtype=torch.bool) if real is None else real.cpu()
        keep = kw.get("logits_to_keep") or 0
        q = ids.shape[1]
        return Work(
            cache, name, ids, real, pos.cpu().expand(ids.shape), min(keep, q) if keep else q
        )

    def record_alone(self, cache: PagedKVCache, kw: dict, args: tuple) -> None:
        """A forward of a registered call that runs alone: its new tokens join the core's record
        as device tensors (no host sync now); a forward that cannot be recorded ends the record
        (that call then cannot be preempted)."""
        core = cache._core
        if core.history is None:
            return
        ids = kw.get("input_ids")
        if args or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            core.history = None
            return
        real, pos = _real_and_positions(core, kw, ids.shape)
        core.history.add_later(ids, real, pos)

    # --- the Runner protocol ---------------------------------------------------------------------

    def plan(self, req: Request, budget: int) -> Chunk | None:
        work: Work = req.payload
        core = work.cache._core
        cols_left = work.real.shape[1] - work.done
        per_col = work.real[:, work.done :].sum(0).tolist()  # real tokens in each column left
        if req.call.preempted:
            core.history.settle()
            hist = [len(h) for h in core.history.ids]
        else:
            hist = [0] * work.real.shape[0]
        base = sum(hist)
        cols, tokens = 0, base
        for n in per_col:
            if cols and tokens + n > budget:
                break
            cols, tokens = cols + 1, tokens + n
        cols = max(cols, 1) if cols_left else 0
        counts = [
            h + int(r) for h, r in zip(hist, work.real[:, work.done : work.done + cols].sum(1))
        ]
        bt = core.block_tokens
        if core.seqs is None or req.call.preempted:
            blocks = sum(-(-n // bt) for n in counts)
        else:
            blocks = sum(core.seqs.blocks_needed(i, n) for i, n in enumerate(counts))
        part = (cols, counts)
        return Chunk(req, sum(counts), len(counts), blocks, part)

    def free_blocks(self) -> int:
        pool = self._pool()
        return pool.manager.num_free if pool is not None else 1 << 30

    def total_blocks(self) -> int:
        pool = self._pool()
        return pool.manager.num_blocks - pool.manager.first_id if pool is not None else 1 << 30

    def _pool(self):
        for call in list(self.scheduler._calls):
            core = call.state.cache._core
            if core.pool is not None:
                return core.pool
        return None

    def preempt(self, call) -> int:
        core = call.state.cache._core
        if core.history is None or core.seqs is None or core.debug:
            return 0  # no record of its tokens: it cannot be recomputed
        before = core.pool.manager.num_free
        core.drop_kv()
        return core.pool.manager.num_free - before

    def run(self, chunks: list[Chunk]) -> bool:
        """One merged forward over `chunks`; False when nothing was served (a call running
        alone took the blocks meanwhile: the requests stay queued)."""
        model = self._model()
        if model is None:
            raise RuntimeError("oxygen_torch: the model of these generate() calls is gone")
        for ch in chunks:
            self._bind(model, ch.request.payload.cache, ch.request.payload.real.shape[0])
        parts = [
            Part(ch.request.payload.cache._core, ch.part[1], ch.part[0],
                 not bool(ch.request.payload.real.all()))
            for ch in chunks
        ]  # fmt: skip
        step = MergedStep(parts)
        with step.pool.lock:
            if step.blocks_needed() > step.pool.manager.num_free:
                return False
            step.reserve()
        try:
            ids, pos, keeps = self._pack(chunks)
            keep_idx = torch.tensor([i for k in keeps for i in k if i >= 0], dtype=torch.int64)
            out = _forward(model, step, ids, pos, keep_idx.to(ids.device))
        except BaseException:
            step.abandon()
            raise
        step.commit()
        self.out_type = type(out)
        self._deliver(chunks, out.logits[0], keeps)
        return True

    # --- a step's inputs and outputs ---------------------------------------------------------

    @staticmethod
    def _bind(model, cache: PagedKVCache, batch: int) -> None:
        core = cache._core
        if core.pool is not None:
            return
        text = model.config.get_text_config(decoder=True)
        hkv = text.num_key_value_heads
        d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        param = next(model.parameters())
        core.bind(batch, hkv, d, param.dtype, param.device)

    def _pack(self, chunks: list[Chunk]):
        """The step's packed ids and positions ([1, T], on the device) in row order (a
        recomputed row's stored tokens first), and per chunk the packed index of each logit its
        caller wants (-1: a padding position, answered with zeros). One gather on the device:
        every caller's ids and the recomputed history side by side, indexed from the host."""
        device = chunks[0].request.payload.ids.device
        sources, index, pos_rows, keeps = [], [], [], []
        base = offset = 0
        hist: list[int] = []
        for ch in chunks:
            req, work = ch.request, ch.request.payload
            hist_of = work.cache._core.history
            cols, _ = ch.part
            c0, c1 = work.done, work.done + cols
            b, q = work.real.shape
            keep = []
            for row in range(b):
                if req.call.preempted and hist_of is not None:
                    stored = hist_of.ids[row]
                    index.extend(-1 - (len(hist) + i) for i in range(len(stored)))
                    hist.extend(stored)
                    pos_rows.append(hist_of.pos[row])
                    offset += len(stored)
                real = (work.real[row, c0:c1].nonzero().squeeze(1) + c0).tolist()
                index.extend(base + row * q + c for c in real)
                pos_rows.append(work.pos[row, real].tolist())
                at = {c: offset + i for i, c in enumerate(real)}
                offset += len(real)
                if c1 == q:
                    keep.extend(at.get(c, -1) for c in range(q - work.keep, q))
            sources.append(work.ids.reshape(-1).to(torch.int64))
            base += b * q
            keeps.append(keep)
        if hist:  # history after the callers' ids: index -1 - i is its token i
            sources.append(torch.tensor(hist, dtype=torch.int64, device=device))
            index = [i if i >= 0 else base - 1 - i for i in index]
        flat = torch.cat(sources)
        idx = torch.tensor(index, dtype=torch.int64).to(device, non_blocking=True)
        ids = flat.index_select(0, idx)
        pos = torch.tensor([p for row in pos_rows for p in row], dtype=torch.int64)
        self._record(chunks, ids, pos)
        return ids.view(1, -1), pos.to(device).view(1, -1), keeps

    @staticmethod
    def _record(chunks, ids: torch.Tensor, pos: torch.Tensor) -> None:
        """Each core's tokens, per row (what a recompute after a preemption replays)."""
        flat, flat_pos = ids.tolist(), pos.tolist()
        at = 0
        for ch in chunks:
            history, (_, counts) = ch.request.payload.cache._core.history, ch.part
            recompute = ch.request.call.preempted
            for row, n in enumerate(counts):
                got_ids, got_pos = flat[at : at + n], flat_pos[at : at + n]
                if history is not None:
                    (history.replace if recompute else history.add)(row, got_ids, got_pos)
                at += n
            ch.request.call.preempted = False

    def _deliver(self, chunks: list[Chunk], logits: torch.Tensor, keeps) -> None:
        """Each finished request gets its logits [B, keep, V]; a prefill chunk that is not the
        last moves its request on."""
        at = 0
        for ch, keep in zip(chunks, keeps):
            req, work = ch.request, ch.request.payload
            cols, _ = ch.part
            work.done += cols
            if work.done < work.real.shape[1]:
                continue
            b = work.real.shape[0]
            got = torch.zeros(b * work.keep, logits.shape[-1], dtype=logits.dtype,
                              device=logits.device)  # fmt: skip
            have = [i for i, k in enumerate(keep) if k >= 0]
            if have:
                idx = torch.tensor(have, dtype=torch.int64, device=logits.device)
                got.index_copy_(0, idx, logits[at : at + len(have)])
            at += len(have)
            req.result = self.out_type(
                logits=got.view(b, work.keep, -1), **{work.cache_name: work.cache}
            )
            req.done = True


def _real_and_positions(core, kw: dict, shape) -> tuple[torch.Tensor | None, torch.Tensor]:
    """For a forward of `shape` [B, q] on `core`: which new tokens are real (None: all; as
    transformers reads the padding mask: missing columns are padding) and each one's position
    (position_ids as given, else the cache positions, padding counted, as stock)."""
    b, q = shape
    pm = kw.get("attention_mask")
    real = None
    if pm is not None:
        end = core.length + q
        if pm.shape[-1] < end:
            pm = torch.nn.functional.pad(pm, (0, end - pm.shape[-1]))
        real = pm[:, end - q : end].to(torch.bool)
    if kw.get("position_ids") is not None:
        pos = kw["position_ids"].to(torch.int64)
    else:
        pos = torch.arange(core.length, core.length + q).view(1, q)
    return real, pos


class _StepCache(PagedKVCache):
    """The cache a merged forward runs on: PagedKVCache's attention path over a MergedStep."""

    def __init__(self, step: MergedStep, model_config, cfg):
        types = self._layer_types(model_config, None)
        self.cfg, self._config, self._core = cfg, model_config, step
        self._any_sliding = any(t != "full_attention" for t in types)
        self.max_cache_len_hint, self.compile_options, self.merge = 0, None, None
        layers = [PagedLayer(self, i, t != "full_attention") for i, t in enumerate(types)]
        super(PagedKVCache, self).__init__(layers=layers)


def _forward(model, step: MergedStep, ids, pos, keep_idx):
    """The model's own forward (not its __call__: the router would send it here again)."""
    text = model.config.get_text_config(decoder=True)
    cache = _StepCache(step, text, None)
    name = compat.cache_arg(type(model))
    forward = type(model).forward.__get__(model)
    return forward(
        input_ids=ids, position_ids=pos, attention_mask=None, use_cache=True,
        logits_to_keep=keep_idx, return_dict=True, **{name: cache},
    )  # fmt: skip


_mergers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Merger}
_mergers_lock = threading.Lock()


def merger_for(model, cache: PagedKVCache) -> Merger:
    """The Merger for this model and this cache's KV geometry, precision and tiles."""
    core = cache._core
    text = model.config.get_text_config(decoder=True)
    d = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    param = next(model.parameters())
    key = (core.pool_key(text.num_key_value_heads, d, param.dtype, param.device),
           core.precision, core.tiles)  # fmt: skip
    with _mergers_lock:
        group = _mergers.setdefault(model, {})
        if key not in group:
            group[key] = Merger(model, cache)
        return group[key]


@contextlib.contextmanager
def session(model, cache: PagedKVCache, task: Task):
    """One generate() call registered with its model's scheduler for its whole duration."""
    merger = merger_for(model, cache)
    core = cache._core
    if core.seqs is None and core.history is None:  # a fresh cache: its tokens can be recorded
        core.history = History(0)
    call = merger.scheduler.enter(task, CallState(cache))
    cache.merge = (merger, call)
    try:
        yield call
    finally:
        cache.merge = None
        merger.scheduler.leave(call)
