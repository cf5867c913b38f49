"""Concurrent generate() calls on one model, merged step by step (the engine's transformers side).

While two or more generate() calls on the paged cache are live on one model (same KV pool,
precision and tiles), each forward they make becomes a request to the model's StepScheduler
(engine/scheduler.py) instead of running alone. The step runs one forward of the model over all
the requests' new real tokens packed into one row ([1, T], each token with its own position),
through a MergedStep (kv/merged.py) that writes and attends over every call's block table side by
side; each caller gets its rows of logits back, as its own forward would have returned them.
A call alone runs as before (decode graphs included). A forward the merge cannot take (inputs
embeddings, hidden states asked for, ...) runs alone, in its caller's thread.

On a tensor-parallel model (engine/rank_plan.py) every forward of a registered call goes through
the scheduler, whose steps rank 0 chooses for every rank: a call alone is a merged step of one,
and a forward the merge cannot take is a step of its own (`solo`). Calls are matched across ranks
by their key: the name of the thread that makes them and the count of that thread's calls.

Each registered call's core records the tokens it holds (kv/history.py: ids and positions per
row, also for the steps it ran alone), so a call the scheduler preempts has its KV recomputed at
its next step.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from ... import _patching
from ...engine import rank_plan
from ...engine.scheduler import Chunk, Request, Solo, StepScheduler
from ...engine.task import PRIORITIES, Task
from ...kv.block_manager import KVCacheFull
from ...kv.history import History
from ...kv.merged import MergedStep, Part, part_blocks
from ...kv.pool import get_pool
from ...kv.swap import pending, swap_in, swap_out, swappable
from ...kv.transfer import to_device
from . import compat, graphs, merged_graphs
from .attention import new_columns
from .cache import DISABLED, OxygenDisabledError, PagedKVCache, PagedLayer

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
    alone: object = None  # coordinated: runs the forward by itself (a step of one whole call)


# a tensor-parallel rank short of the blocks of the step rank 0 chose waits this long for them
COORDINATED_WAIT_S = 30.0


def _fits(manager, need: int) -> bool:
    return need <= manager.num_free or need <= manager.num_available


class Merger:
    """The scheduler and runner of one model and one KV geometry."""

    def __init__(self, model, cache: PagedKVCache):
        self._model = weakref.ref(model)
        self.pool_key = cache._core.pool_key(*_geometry(model))  # the calls' KV pool's
        # tensor parallel: steps agreed across the ranks (the integration checked it can be)
        self.coordinated = rank_plan.tp_size(model) > 1
        coordinator = rank_plan.coordinator() if self.coordinated else None
        self.scheduler = StepScheduler(cache.cfg.scheduler, self, coordinator)
        self.out_type = None
        self.graphs = merged_graphs.MergedGraphs()

    # --- what the router asks -----------------------------------------------------------------

    def wanted(self, kw: dict, args: tuple) -> bool:
        return (self.coordinated or self.scheduler.live() > 1) and self.mergeable(kw, args)

    def mergeable(self, kw: dict, args: tuple) -> bool:
        """Whether a merged step can take this forward (whether one is wanted aside)."""
        return (
            not args
            and isinstance(kw.get("input_ids"), torch.Tensor)
            and all(v is None or k in _MERGEABLE for k, v in kw.items())
            and (kw.get("logits_to_keep") is None or isinstance(kw.get("logits_to_keep"), int))
        )

    def forward(self, call, name: str, cache: PagedKVCache, kw: dict, alone=None):
        """One forward of `call` (its cache under `name`), served by a merged step. `alone()`
        runs it by itself: under coordinated steps, a step that is this whole forward alone
        runs it so (decode graphs included, as a call alone does without tensor parallelism)."""
        work = self._parse(cache, name, kw)
        work.alone = alone  # (given for coordinated calls only)
        return self.scheduler.submit(call, work)

    def solo(self, call, run):
        """A forward the merge cannot take (`run()`), as a step of its own (coordinated)."""
        return self.scheduler.submit(call, Solo(run))

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
        if isinstance(req.payload, Solo):
            return Chunk(req, 1, 0, 0, "solo")  # its forward reserves its own blocks
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
        if core.seqs is None or req.call.preempted:
            blocks = sum(-(-n // core.block_tokens) for n in counts)
        else:  # (as the step counts it: a swapped-out call's KV back first)
            blocks = part_blocks(core, counts)
        part = (cols, counts)
        return Chunk(req, sum(counts), len(counts), blocks, part)

    def free_blocks(self) -> int:
        pool = self._pool()
        return pool.manager.num_available if pool is not None else 1 << 30

    def total_blocks(self) -> int:
        pool = self._pool()
        return pool.manager.num_blocks - pool.manager.first_id if pool is not None else 1 << 30

    def _pool(self):
        """The calls' KV pool: a bound call's, else (none has run a forward yet) the one they
        will bind to. A step of calls none of which had run was counted against no pool at
        all (1 << 30 blocks), planned past the blocks it then found, and served nothing: under
        tensor parallelism a rank whose pool happened to hold the blocks ran that forward
        while the others skipped it, and the ranks' collectives hung (test_tp_gloo, twice)."""
        calls = self.scheduler.calls()
        for call in calls:
            core = call.state.cache._core
            if core.pool is not None:
                return core.pool
        return get_pool(self.pool_key) if calls else None

    def preempt(self, call) -> int:
        """Frees the call's KV: into the CPU tier when there is one with room (swap: it comes
        back at the call's next step), else dropped to be recomputed from its record."""
        core = call.state.cache._core
        call.swapped = False
        if core.seqs is None or core.debug or core._swapped is not None:
            return 0
        if not any(core.seqs.blocks):  # preempted before (dropped): nothing to swap or free
            return 0
        tier = core.pool.cpu_tier_of(call.state.cache.cfg.pool)
        if tier is not None and not swappable(core):
            _patching.warn_once(
                "oxygen_torch: a preempted call of a hybrid sliding-window model narrowed the "
                "blocks behind its window (their sliding layers' pages are unmapped); such "
                "calls are recomputed instead of swapped to the CPU tier"
            )
        elif tier is not None:
            freed = swap_out(core, low_priority=call.account.task.level < PRIORITIES["normal"])
            if freed is not None:
                call.swapped = True
                return freed
            _patching.warn_once(
                "oxygen_torch: the KV CPU tier is full (pool.cpu_tier_bytes); preempted calls "
                "are recomputed instead of swapped"
            )
        if core.history is None:
            return 0  # no record of its tokens: it cannot be recomputed
        before = core.pool.manager.num_free
        core.drop_kv()
        return core.pool.manager.num_free - before

    def fetch(self, call) -> tuple[bool, bool]:
        """A chosen call swapped out to the CPU tier starts coming back now, ahead of its step
        (kv.prefetch_distance > 0; the copy runs on the tier's side stream beside the steps
        before it). Returns (whether that swap-in started here, whether the call sits this step
        out: its copy is still running and it sat out fewer steps in a row than the distance)."""
        core = call.state.cache._core
        distance = call.state.cache.cfg.kv.prefetch_distance
        if not distance or core.pool is None:
            return False, False
        started = core._swapped is not None
        if started:
            try:
                swap_in(core, ahead=True)
            except KVCacheFull:  # a call running alone took the blocks: its step swaps it in
                return False, False
        return started, call.sat_out < distance and pending(core)

    def run(self, chunks: list[Chunk]) -> bool:
        """One merged forward over `chunks`; False when nothing was served (a call running
        alone took the blocks meanwhile: the requests stay queued)."""
        model = self._model()
        if model is None:
            raise RuntimeError("oxygen_torch: the model of these generate() calls is gone")
        if model.config.get_text_config(decoder=True)._attn_implementation != "oxygen":
            raise OxygenDisabledError(DISABLED)  # disable() put the model back on stock
        if chunks[0].part == "solo" or self._whole_alone(chunks):
            req = chunks[0].request
            run = req.payload.run if chunks[0].part == "solo" else req.payload.alone
            req.result, req.done = run(), True
            return True
        step = self._step_of(model, chunks)
        replayable = self._replayable(chunks)
        if not self._reserve(step, replayable):
            return False
        try:
            logits = self._replay(model, step, chunks) if replayable else None
            if logits is None:
                if replayable:  # its capture failed before: eager after all
                    step.build()
                ids, pos, keeps = self._pack(chunks)
                keep_idx = torch.tensor([i for k in keeps for i in k if i >= 0], dtype=torch.int64)
                out = _forward(model, step, ids, pos, keep_idx.to(ids.device))
                self.out_type, logits = type(out), out.logits[0]
            else:
                keeps = [[0] * ch.request.payload.real.shape[0] for ch in chunks]
        except BaseException:
            step.abandon()
            raise
        step.commit()
        self._record(chunks)  # (after the step: a failed one leaves its preempted to recompute)
        self._deliver(chunks, logits, keeps)
        return True

    def fits(self, chunks: list[Chunk]) -> bool:
        """Whether the blocks of a step of `chunks` are free now (rank 0 asks before it
        publishes a step: one it could not run, every rank would wait for in vain)."""
        model = self._model()
        if model is None or chunks[0].part == "solo" or self._whole_alone(chunks):
            return True  # (run() says the model is gone; a forward alone reserves its own)
        step = self._step_of(model, chunks)
        with step.pool.lock:
            return _fits(step.pool.manager, step.blocks_needed())

    def _step_of(self, model, chunks: list[Chunk]) -> MergedStep:
        for ch in chunks:
            self._bind(model, ch.request.payload.cache, ch.request.payload.real.shape[0])
        parts = [
            Part(ch.request.payload.cache._core, ch.part[1], ch.part[0],
                 not bool(ch.request.payload.real.all()))
            for ch in chunks
        ]  # fmt: skip
        return MergedStep(parts)

    def _reserve(self, step: MergedStep, replayable: bool) -> bool:
        """Reserves the step's blocks; False when they are not free (the requests stay queued:
        a call running alone took them meanwhile). Under tensor parallelism every rank runs
        the step rank 0 chose, or the ranks' collectives pair up wrongly and hang: rank 0 chose
        it within its own free blocks, so a rank short of them lags behind rank 0 (a finished
        call's cache here still waits for the collector): it collects and waits for them, and
        raises if they do not come (the ranks' pools went apart)."""
        end = time.monotonic() + COORDINATED_WAIT_S
        while True:
            with step.pool.lock:
                need, m = step.blocks_needed(), step.pool.manager
                if _fits(m, need):
                    step.reserve(build=not replayable)
                    return True
                if not self.coordinated:
                    return False
                free = m.num_available
            if time.monotonic() >= end:
                raise RuntimeError(
                    f"oxygen_torch: this tensor-parallel rank has {free} free KV blocks and the "
                    f"step rank 0 chose needs {need}, after {COORDINATED_WAIT_S:g} s: the ranks' "
                    "KV pools went apart (every rank must make the same generate() calls with "
                    "the same inputs)"
                )
            gc.collect()  # (caches in reference cycles give their blocks back only then)
            time.sleep(0.01)

    @staticmethod
    def _whole_alone(chunks: list[Chunk]) -> bool:
        """A coordinated step that is one call's whole forward, nothing recomputed or swapped:
        it runs by itself (every rank decides alike: the same state, the same chunks)."""
        if len(chunks) != 1:
            return False
        ch = chunks[0]
        work, call = ch.request.payload, ch.request.call
        return (
            getattr(work, "alone", None) is not None and work.done == 0
            and ch.part[0] == work.real.shape[1] and not call.preempted
            and work.cache._core._swapped is None
        )  # fmt: skip

    # --- merged decode steps through CUDA graphs (merged_graphs.py) ----------------------------

    def _replayable(self, chunks: list[Chunk]) -> bool:
        """Whether a merged decode graph may replay this step: every row of every call decodes
        one token (nothing recomputed), on CUDA, with scheduler.decode_graphs and
        kv.decode_graphs on."""
        work = chunks[0].request.payload
        cfg = work.cache.cfg
        if not (cfg.scheduler.decode_graphs and graphs.usable(work.ids.device, work.cache)):
            return False
        for ch in chunks:
            w = ch.request.payload
            if ch.request.call.preempted or w.real.shape[1] != 1 or w.keep != 1:
                return False
            if w.cache._core.debug or not bool(w.real.all()):
                return False
        return True

    def _replay(self, model, step: MergedStep, chunks: list[Chunk]):
        """The step's logits [R, V] from its graph, or None: run it eagerly."""
        need = max(p.core.seqs.max_blocks() for p in step.parts)
        width = max(max(graphs.graph_width(ch.request.payload.cache) for ch in chunks), need)
        width = -(-width // graphs.WIDTH_STEP) * graphs.WIDTH_STEP
        ids = [ch.request.payload.ids for ch in chunks]
        pos = [p for ch in chunks for p in ch.request.payload.pos[:, 0].tolist()]
        logits = self.graphs.run(model, step, width, ids, pos, _graph_forward)
        if logits is not None:
            self.out_type = self.graphs.out_type
        return logits

    # --- a step's inputs and outputs ---------------------------------------------------------

    @staticmethod
    def _bind(model, cache: PagedKVCache, batch: int) -> None:
        if cache._core.pool is None:
            cache._core.bind(batch, *_geometry(model))
        # the merged step writes its K/V for oxygen attention (padding skipped): a forward of
        # the call's after disable() ends in OxygenDisabledError, not a dense read-back
        cache._on_oxygen = True

    @staticmethod
    def _pack(chunks: list[Chunk]):
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
            stored = work.cache._core.history if req.call.preempted else None
            cols, _ = ch.part
            c0, c1 = work.done, work.done + cols
            b, q = work.real.shape
            sel = work.real[:, c0:c1]
            real_cols = [[] for _ in range(b)]  # each row's real columns, one nonzero a chunk
            for row, col in sel.nonzero().tolist():
                real_cols[row].append(c0 + col)
            positions = work.pos[:, c0:c1][sel].tolist()  # row by row, as real_cols
            keep, at_pos = [], 0
            for row, real in enumerate(real_cols):
                if stored is not None:
                    index.extend(-1 - (len(hist) + i) for i in range(len(stored.ids[row])))
                    hist.extend(stored.ids[row])
                    pos_rows.append(stored.pos[row])
                    offset += len(stored.ids[row])
                index.extend(base + row * q + c for c in real)
                pos_rows.append(positions[at_pos : at_pos + len(real)])
                at_pos += len(real)
                at = {c: offset + i for i, c in enumerate(real)}
                offset += len(real)
                if c1 == q:
                    keep.extend(at.get(c, -1) for c in range(q - work.keep, q))
            sources.append(work.ids.reshape(-1).to(torch.int64))
            base += b * q
            keeps.append(keep)
        if hist:  # history after the callers' ids: index -1 - i is its token i
            sources.append(_upload(hist, device))
            index = [i if i >= 0 else base - 1 - i for i in index]
        flat = torch.cat(sources)
        ids = flat.index_select(0, _upload(index, device))
        pos = _upload([p for row in pos_rows for p in row], device)
        return ids.view(1, -1), pos.view(1, -1), keeps

    @staticmethod
    def _record(chunks: list[Chunk]) -> None:
        """Each core's new tokens join its record (what a recompute after a preemption
        replays), kept as they came in, as a step that ran alone is: no host sync. A
        recomputed row replays its record, which stays as it was."""
        for ch in chunks:
            work, (cols, _) = ch.request.payload, ch.part
            history = work.cache._core.history
            if history is not None:
                c0, c1 = work.done, work.done + cols
                history.add_later(work.ids[:, c0:c1], work.real[:, c0:c1], work.pos[:, c0:c1])
            ch.request.call.preempted = ch.request.call.swapped = False

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
                got.index_copy_(0, _upload(have, logits.device), logits[at : at + len(have)])
            at += len(have)
            req.result = self.out_type(
                logits=got.view(b, work.keep, -1), **{work.cache_name: work.cache}
            )
            req.done = True


def _upload(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 values on the device without holding the host (kv/transfer.py to_device)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)


def _real_and_positions(core, kw: dict, shape) -> tuple[torch.Tensor | None, torch.Tensor]:
    """For a forward of `shape` [B, q] on `core`: which new tokens are real (None: all) and each
    one's position (position_ids as given, else the cache positions, padding counted, as
    stock). On the inputs' device."""
    q = shape[1]
    pm = kw.get("attention_mask")
    real = None if pm is None else new_columns(pm, core.length + q, q)
    if kw.get("position_ids") is not None:
        pos = kw["position_ids"].to(torch.int64)
    else:
        pos = torch.arange(core.length, core.length + q).view(1, q)
    return real, pos


class _StepCache(PagedKVCache):
    """The cache a merged forward runs on: PagedKVCache's attention path over a MergedStep."""

    def __init__(self, step: MergedStep, model_config):
        types = self._layer_types(model_config, None)
        self.cfg, self._config, self._core = None, model_config, step
        self._any_sliding = any(t != "full_attention" for t in types)
        self.max_cache_len_hint, self.compile_options, self.merge = 0, None, None
        self.prefix_prompt, self._on_oxygen = None, True
        layers = [PagedLayer(self, i, t != "full_attention") for i, t in enumerate(types)]
        super(PagedKVCache, self).__init__(layers=layers)


def step_cache(step, model) -> _StepCache:
    """The cache a merged forward runs on, over `step` (a MergedStep, or a merged decode
    graph's core)."""
    return _StepCache(step, model.config.get_text_config(decoder=True))


def _forward(model, step: MergedStep, ids, pos, keep_idx, forward=None, cache=None):
    """The model's own forward (not its __call__: the router would send it here again), or
    `forward` (a compiled twin of it) over `cache` (a _StepCache of `step`, else a new one)."""
    if cache is None:
        cache = step_cache(step, model)
    name = compat.cache_arg(type(model))
    if forward is None:
        forward = type(model).forward.__get__(model)
    else:  # (compiled: sizes symbolic from the first compile, tokens and kept logits apart)
        _symbolic(ids, pos, keep_idx)
    return forward(
        input_ids=ids, position_ids=pos, attention_mask=None, use_cache=True,
        logits_to_keep=keep_idx, return_dict=True, **{name: cache},
    )  # fmt: skip


def _symbolic(ids, pos, keep) -> None:
    """The compiled forward's sizes of 2 or more (its tokens, its kept logits) symbolic from
    its first compile on (torch._dynamo.maybe_mark_dynamic): the engine's decode graphs, its
    mixed steps' graphs and its compiled prefill run one compile of it, whichever comes first,
    instead of a static compile and then a symbolic one each (~15 s apiece on an H100, every
    running call waiting). A size of 1 stays its own compile (one row's decode graph)."""
    if ids.shape[-1] >= 2:
        torch._dynamo.maybe_mark_dynamic(ids, ids.dim() - 1)
        torch._dynamo.maybe_mark_dynamic(pos, pos.dim() - 1)
    if isinstance(keep, torch.Tensor) and keep.numel() >= 2:
        torch._dynamo.maybe_mark_dynamic(keep, 0)


def _graph_forward(model, core, ids, pos, forward=None, cache=None):
    """A merged decode graph's forward over its static buffers (every logit kept: by their
    indices, as a mixed step's graph and the compiled prefill keep theirs, so that the three
    run one compiled forward: _symbolic)."""
    keep = torch.arange(ids.shape[-1], device=ids.device)
    return _forward(model, core, ids, pos, keep, forward, cache)


def _geometry(model, text=None) -> tuple[int, int, torch.dtype, torch.device]:
    """(kv heads, head dim, dtype, device) of the model's K/V on this rank: what picks its KV
    pool (a tensor-parallel plan splits the KV heads across its ranks). `text`: the model's text
    config, when the caller has it."""
    text = text if text is not None else model.config.get_text_config(decoder=True)
    param = next(model.parameters())
    return compat.local_kv_heads(model, text), compat.head_dim(text), param.dtype, param.device


_mergers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Merger}
_calls_made = threading.local()  # this thread's coordinated calls so far (their keys)


def _call_key() -> tuple[str, int]:
    """A coordinated call's name on every rank: its thread's name and that thread's count."""
    n = getattr(_calls_made, "n", 0)
    _calls_made.n = n + 1
    return threading.current_thread().name, n


_mergers_lock = threading.Lock()


def merger_for(model, cache: PagedKVCache) -> Merger:
    """The Merger for this model and this cache's KV geometry, precision and tiles."""
    core = cache._core
    key = (core.pool_key(*_geometry(model)), core.precision, core.tiles)
    with _mergers_lock:
        group = _mergers.setdefault(model, {})
        if key not in group:
            group[key] = Merger(model, cache)
        return group[key]


def clear_graphs() -> None:
    """Drops every merged decode graph (disable(): they read the pools' memory)."""
    with _mergers_lock:
        for group in list(_mergers.values()):
            for m in group.values():
                m.graphs.clear()


def merged_graphs_of(model) -> list:
    """The merged decode graphs (MergedGraphs) of `model`'s mergers."""
    with _mergers_lock:
        return [m.graphs for m in _mergers.get(model, {}).values()]


@contextlib.contextmanager
def session(model, cache: PagedKVCache, task: Task):
    """One generate() call registered with its model's scheduler for its whole duration."""
    merger = merger_for(model, cache)
    core = cache._core
    if core.seqs is None and core.history is None:  # a fresh cache: its tokens can be recorded
        core.history = History(0)
    key = _call_key() if merger.coordinated else None
    call = merger.scheduler.enter(task, CallState(cache), key)
    cache.merge = (merger, call)
    try:
        yield call
    finally:
        cache.merge = None
        merger.scheduler.leave(call)
