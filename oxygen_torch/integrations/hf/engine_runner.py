"""The engine's runner for a transformers model: a step's forward over every row at once.

Each engine row owns a PagedKVCache of one sequence (its blocks in the model's KV pool). A step
packs every row's new tokens into one row of ids [1, T] with their own positions and runs the
model's own forward over a MergedStep (kv/merged.py), which writes and attends over every row's
blocks side by side: one forward per step, whatever the rows. A step in which every row decodes
one token replays a CUDA graph by batch-size bucket (merged_graphs.py) where decode graphs are
on (kv.decode_graphs, on a GPU).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref

import torch

from ... import _patching, context
from ...engine import gc_watch
from ...engine.kv_rows import RowKV
from ...engine.loop import Engine
from ...kv.core import PagedKVCore
from ...kv.decode_step import DecodeStep
from ...kv.merged import MergedStep, Part
from ...kv.pool import get_pool
from ...kv.transfer import to_device
from . import fuse, graphs, merged_graphs, mixed_graphs, projections, trace_guard
from . import prefix as prefix_cache
from .batched import _forward, _geometry, _graph_forward, step_cache
from .cache import PagedKVCache

ENGINE_MAX_GRAPHS = 48  # rows buckets x table widths the engine's decode steps go through
PREFILL_KEEP_MIN = 2  # the compiled prefill forward's kept logits at least (HFRunner._compiled)
# a step that compiled (or captured) alone for this long outside warm_up() is told, once a kind
STALL_TELL_S = 1.0
STALLS = {
    "decode": "decode step of a new rows bucket captured its graph",
    "mixed": "step with prompt tokens beside decoding rows captured its graph",
    "prefill": "step over kv.mixed_graphs prompt tokens ran the compiled forward (kv.prefill_"
    "compile)",
}
log = logging.getLogger("oxygen_torch")


class HFRunner:
    """What the engine (engine/loop.py) asks of a model: its rows' empty cores, their KV
    accounting (`kv_rows`), a step's forward."""

    def __init__(self, model, cfg, kv_dtype: str | None = None, precision=None):
        self._model = weakref.ref(model)
        self.cfg = cfg
        self.text = model.config.get_text_config(decoder=True)
        self.geometry = _geometry(model)
        self.device = self.geometry[3]
        self.vocab = _vocab(model)
        self._kv_dtype, self._precision = kv_dtype, precision
        self._proto_cache = self.new_cache()  # (holds the prototype core the rows copy)
        self._proto = self._proto_cache._core
        self.pool = get_pool(self._proto.pool_key(*self.geometry))
        # (the last engine's setting stands: one pool, one thread)
        self.pool.storage.map_ahead(cfg.kv.map_ahead_bytes)
        self.block_tokens = self._proto.block_tokens
        self.precision, self.tiles = self._proto.precision, self._proto.tiles
        self.graphs = merged_graphs.MergedGraphs(max_graphs=ENGINE_MAX_GRAPHS, copy_out=False)
        self.graph_blocks = 0  # the narrowest table a decode graph is captured with (warm.py)
        # while warm.py runs: each rows bucket its own decode graph (and no stall told)
        self.capture_exact = False
        self._told: set[str] = set()
        self.mixed = mixed_graphs.MixedGraphs(max_graphs=ENGINE_MAX_GRAPHS)  # kv.mixed_graphs
        self.kv_rows = RowKV(self.pool, cfg, (prefix_cache._serial(model),), self._bind)
        self.replayed = 0
        # kv.prefill_compile: the cache object its compiled forward runs on, whether it compiled
        # (its first step runs alone) or failed (eager from then on)
        self._prefill_cache = None
        self._prefill_ready = self._prefill_failed = False
        self.prefill_compiled = 0  # steps run through it

    # --- rows' KV (their accounting: engine/kv_rows.py) ------------------------------------

    def new_kv(self) -> PagedKVCore:
        """An empty core of one sequence with the model's KV settings (windows, precision,
        tiles, kv_dtype), bound to the pool at its first block."""
        return self._proto.fork()

    def new_cache(self) -> PagedKVCache:
        """An empty PagedKVCache with the same settings (a call's output cache)."""
        return PagedKVCache(
            config=self.text, cfg=self.cfg, kv_dtype=self._kv_dtype, precision=self._precision
        )

    def _bind(self, core: PagedKVCore) -> None:
        if core.pool is None:  # (its steps' tables are the step's: engine/loop.py)
            core.bind(1, *self.geometry, device_table=False)

    # --- a step -----------------------------------------------------------------------------

    def forward(self, rows, ids: torch.Tensor, pos: list[int]) -> torch.Tensor:
        """The logits [K, V] of the rows that keep one (engine/loop.py Runner)."""
        model = self._model()
        if model is None:
            raise RuntimeError("oxygen_torch: the model of these generate() calls is gone")
        cores = [row.req.kv for row in rows]
        decode = all(row.ids is None for row in rows)
        if decode:  # the steady state: one token for each row, every row bound
            step = DecodeStep(cores)
        else:
            for core in cores:
                self._bind(core)
            step = MergedStep([Part(c, [row.n], row.n) for c, row in zip(cores, rows)])
        replay = self._replayable(rows)
        mixed = not decode and self._mixed_ok(rows, len(pos))
        with step.pool.lock:
            step.reserve(build=not (replay or mixed))
        built = not (replay or mixed)
        try:
            graph, keep = None, None
            if replay:
                graph = self._pick(model, step, len(pos))
            elif mixed:
                graph, keep = self._pick_mixed(model, step, rows, len(pos))
            # a capture that compiles runs alone (trace_guard.py); any other step beside the
            # other engines' steps, not beside a compile of ours
            fuse_on = graph is not None and graph.runner is None and self._fuses()
            compiled = not decode and graph is None and self._compiles_prefill()
            alone = fuse_on or (compiled and not self._prefill_ready)
            began = time.perf_counter()
            with trace_guard.GUARD.compile() if alone else trace_guard.GUARD.step():
                logits = None
                if graph is not None:
                    whole = self.cfg.kv.decode_graph_compile
                    held = self.mixed if mixed else self.graphs
                    forward = mixed_graphs.mixed_forward if mixed else _graph_forward
                    logits = held.play(graph, model, step, [ids], pos, forward, fuse_on, whole,
                                       step_cache, keep)  # fmt: skip
                    self.replayed += logits is not None
                if logits is None and not built:  # eager after all (or its capture failed)
                    step.build()
                if logits is None and compiled:
                    logits = self._compiled(model, step, rows, ids, pos)
                if logits is None:
                    logits = self._eager(model, step, rows, ids, pos)
        except BaseException:
            step.abandon()
            raise
        step.commit()
        if alone:
            kind = "prefill" if graph is None else "mixed" if mixed else "decode"
            self._tell_stall(kind, time.perf_counter() - began, len(rows))
        return logits

    def _tell_stall(self, kind: str, seconds: float, rows: int) -> None:
        """A step that compiled or captured alone for STALL_TELL_S or more outside warm_up():
        said once a kind (a compile in the traffic is seconds every running call waits)."""
        if self.capture_exact or seconds < STALL_TELL_S or kind in self._told:  # (warm.py)
            return
        self._told.add(kind)
        log.warning(
            "oxygen_torch: the engine's first %s in the traffic: %.1f s that the step's rows "
            "(%d) and every waiting call waited through (the forward's compile, once per process); "
            "oxygen_torch.warm_up(model) pays it before the traffic comes (serve does)",
            STALLS[kind], seconds, rows,
        )  # fmt: skip

    def _mixed_ok(self, rows, tokens: int) -> bool:
        """A step with prompt tokens that may replay a mixed-step graph (kv.mixed_graphs)."""
        limit = self.cfg.kv.mixed_graphs
        if not limit or tokens > limit:
            return False
        return graphs.usable(self.device, self._proto_cache) and not rows[0].req.kv.debug

    def _pick_mixed(self, model, step: MergedStep, rows, tokens: int):
        """(the mixed-step graph of this reserved step, the packed indices of the logits it
        keeps), or (None, None): a row narrowed a sliding window (eager: its check) or the
        signature's capture failed before."""
        if step._narrowed is not None:
            return None, None
        need = max(len(b) for p in step.parts for b in p.core.seqs.blocks)
        width = max(self.graph_blocks, graphs.table_width(need))
        graph = self.mixed.pick(model, step, width, len(rows), tokens)
        if graph is None:
            return None, None
        return graph, _kept(rows)

    def _compiles_here(self) -> bool:
        """Whether this runner compiles forwards at all: on a GPU, or on a CPU with
        kv.cpu_decode_graphs "fuse"."""
        return self.device.type == "cuda" or self.cfg.kv.cpu_decode_graphs == "fuse"

    def _fuses(self) -> bool:
        """Whether a capture fuses its forward (kv.decode_graph_fusion, where it compiles)."""
        return self._compiles_here() and self.cfg.kv.decode_graph_fusion

    def _replayable(self, rows) -> bool:
        """A step of decodes only, with decode graphs on (kv.decode_graphs, on a GPU)."""
        if any(row.ids is not None for row in rows):
            return False
        return graphs.usable(self.device, self._proto_cache) and not rows[0].req.kv.debug

    def _pick(self, model, step: MergedStep, rows: int):
        """The merged decode graph of this reserved step (None: its signature runs eagerly)."""
        need = max(len(c.seqs.blocks[0]) for c in step.cores)
        width = max(self.graph_blocks, graphs.table_width(need))
        return self.graphs.pick(model, step, width, rows, exact=self.capture_exact)

    def widen_graphs(self, tokens: int) -> int:
        """Decode graphs captured from now on have tables for sequences of `tokens` tokens at
        least (oxygen_torch.warm_up): later steps up to that length replay them. Returns the
        width in blocks (never narrower than before)."""
        self.graph_blocks = max(
            self.graph_blocks, graphs.table_width(-(-tokens // self.block_tokens))
        )
        return self.graph_blocks

    def _inputs(self, pos, keep: list[int]):
        """The step's positions [1, T] and the kept logits' indices [K], on the device."""
        dev = to_device(torch.tensor(pos + keep, dtype=torch.int64), self.device)
        n = len(pos)
        return dev[:n].view(1, -1), dev[n:]

    def _eager(self, model, step: MergedStep, rows, ids, pos) -> torch.Tensor:
        at, keep = self._inputs(pos, _kept(rows))
        return _forward(model, step, ids.view(1, -1), at, keep).logits[0]

    def _compiles_prefill(self) -> bool:
        """Whether a step with prompt tokens runs the compiled forward (kv.prefill_compile,
        where it compiles; not after its compile failed)."""
        return self.cfg.kv.prefill_compile and self._compiles_here() and not self._prefill_failed

    def _compiled(self, model, step: MergedStep, rows, ids, pos) -> torch.Tensor | None:
        """The step's logits through the model's forward compiled whole by backend "oxygen"
        with dynamic shapes (kv.prefill_compile; the decode and mixed graphs' compile, where one
        ran: batched._symbolic): its layers' attention is oxygen::paged_step
        over `step` (lent to this thread while it runs), on the runner's one cache object (a
        compiled forward guards on its inputs). None when the first compile fails (warned
        once; these steps run eagerly from then on: a step is idempotent, the eager run writes
        the same K/V to the same slots).
        The kept logits' indices are PREFILL_KEEP_MIN at least: a dynamic compile specializes a
        size of 0 or 1, so steps keeping none (a long prompt's first chunks), one (one prompt
        alone: warm_up's) and several (decoding rows beside) would each compile the forward again,
        ~25 s on an H100 in the middle of the traffic (seen in the loaded trace); one compile
        serves them all."""
        kept = _kept(rows)
        # (padded with the first token's index: its logits dropped below)
        at, keep = self._inputs(pos, kept + [0] * (PREFILL_KEEP_MIN - len(kept)))
        if self._prefill_cache is None:
            self._prefill_cache = step_cache(step, model)
        cache = self._prefill_cache
        cache._core = step
        bound = type(model).forward.__get__(model)
        try:
            with fuse.compiled(model, bound, step, dynamic=None) as fn:
                context.lend(step)
                try:
                    with context.tracing():
                        out = _forward(model, step, ids.view(1, -1), at, keep, fn, cache)
                finally:
                    context.forget(step)
        except Exception as err:  # noqa: BLE001 - the first compile: eager from now on
            if self._prefill_ready:  # it compiled and ran before: this step's own error
                raise
            self._prefill_failed = True
            _patching.warn_once(
                "oxygen_torch: the engine's prefill steps run eagerly: compiling the forward "
                f"whole (kv.prefill_compile) failed: {err!r}"
            )
            return None
        finally:
            cache._core = None  # (the step is not kept alive by the runner)
        if not self._prefill_ready:
            self._prefill_ready = True
            gc_watch.refreeze("the engine's prefill forward's compile")
        self.prefill_compiled += 1
        return out.logits[0, : len(kept)]


def _kept(rows) -> list[int]:
    """The packed indices of the step's tokens whose logits are kept: each row that keeps one
    (a prompt's last chunk, a decoding row), its last token."""
    keep, at = [], 0
    for row in rows:
        at += row.n
        if row.keep:
            keep.append(at - 1)
    return keep


def _vocab(model) -> int:
    """The logits' width: the output embedding's rows (the config's vocab_size may differ)."""
    out = model.get_output_embeddings()
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Engine}
_engines_lock = threading.Lock()


def engine_for(model, cfg, text=None) -> Engine:
    """The engine of `model` for this configuration's KV pool, precision and tiles (one thread
    each); a new one after a fork (threads do not cross fork) or after its close. `text`: the
    model's text config, when the caller has it."""
    key = _engine_key(model, cfg, text)
    made = False
    with _engines_lock:
        group = _engines.setdefault(model, {})
        if cfg.kernel.fuse_projections and group and projections.report(model) is None:
            _fuse_too_late(model)
        eng = group.get(key)
        if eng is None or eng.closed or eng.pid != os.getpid():
            # kv.prefill_chunk_tokens bounds a step's tokens too: the activations of a long
            # prefill decide how large a batch fits
            if not group:  # the model's first engine: they all stop when the model goes
                weakref.finalize(model, _stop_orphans)
                if cfg.kernel.fuse_projections:
                    _fuse_projections(model)
            eng = group[key] = Engine(
                HFRunner(model, cfg), cfg.scheduler, type(model).__name__,
                step_tokens=cfg.kv.prefill_chunk_tokens,
            )  # fmt: skip
            _live.add(eng)
            made = True
    if made and cfg.scheduler.gc_freeze and eng.runner.device.type == "cuda":
        gc_watch.freeze_once()  # (outside the lock: a collection runs finalizers)
    return eng


def _fuse_too_late(model) -> None:
    """kernel.fuse_projections asked for a model whose first engine was made with it off: its
    engines' graphs read the weights where they are, so the layout stays (said once a class)."""
    if not _left_apart.get(model):  # (those were told why at their first engine)
        _patching.warn_once(
            f"oxygen_torch: kernel.fuse_projections: not applied to this "
            f"{type(model).__name__}: its first engine was made with the setting off (the "
            "layout is chosen once, before any engine's graph reads the weights)"
        )


_left_apart: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> True (warned)


def _fuse_projections(model) -> None:
    """kernel.fuse_projections, before the model's first engine captures anything: its q / k / v
    and gate / up weights as one buffer each (projections.py). Not when a single call's decode
    graphs were captured on the model already (they would read the old, freed tensors); under
    their lock, so that none is made meanwhile."""
    with graphs._lock:
        mg = graphs._graphs.get(model)
        if mg is not None and mg.graphs:
            _patching.warn_once(
                "oxygen_torch: kernel.fuse_projections: left off for this model: decode graphs "
                "were captured on its weights before its first engine"
            )
            _left_apart[model] = True
            return
        done = projections.make_adjacent(model)
    left = {k: v for k, v in done.items() if k not in ("joined", "already adjacent")}
    if left:
        _patching.warn_once(
            f"oxygen_torch: kernel.fuse_projections: groups left apart in "
            f"{type(model).__name__}: {dict(left)}"
        )


# every engine not yet garbage, its model's entry in _engines gone or not: close_all() ends them
_live: weakref.WeakSet = weakref.WeakSet()


def _stop_orphans() -> None:
    """A model was collected: the threads of engines whose model is gone end (each held its
    runner, and the runner its KV pool, for STOP_AFTER_IDLE_S otherwise: memory release_pools()
    could not free). Nothing here holds an engine: a closed one goes with its last reference."""
    for eng in list(_live):
        if eng.runner._model() is None:
            eng.stop()


_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(cfg, ...): key}


def _engine_key(model, cfg, text=None) -> tuple:
    """Which engine of `model` serves `cfg`: its KV pool, precision and tiles, read off a probe
    cache once per configuration and geometry (a probe costs ~0.4 ms, every call otherwise)."""
    text = text if text is not None else model.config.get_text_config(decoder=True)
    geometry = _geometry(model, text)
    # by identity (hashing a configuration walks all its fields); the entry keeps its objects,
    # so their ids are not reused while it lives
    memo_key = (id(cfg), id(text), text.num_hidden_layers, geometry)
    with _engines_lock:
        hit = _keys.setdefault(model, {}).get(memo_key)
    if hit is not None and hit[0] is cfg and hit[1] is text:
        return hit[2]
    core = PagedKVCache(config=text, cfg=cfg)._core
    # cfg.kv whole: the runner reads kv.* settings beyond the pool's (fresh_prefill, the step's
    # tokens, the decode graphs' fusion...), so a configuration that changes one of them gets an
    # engine that follows it rather than an earlier one that silently would not
    key = (core.pool_key(*geometry), core.precision, core.tiles, cfg.scheduler, cfg.kv)
    with _engines_lock:
        memo = _keys.setdefault(model, {})
        if len(memo) >= 16:  # (configurations a model is called with: a bound)
            memo.clear()
        memo[memo_key] = (cfg, text, key)
    return key


@atexit.register
def close_all() -> None:
    """Ends every engine thread (disable()): calls still waiting get a clear error."""
    with _engines_lock:
        engines = {e for group in _engines.values() for e in group.values()} | set(_live)
        _engines.clear()
    for e in engines:
        e.close()


def graphs_of(model) -> list:
    """The decode graphs (MergedGraphs) of `model`'s engines."""
    with _engines_lock:
        return [e.runner.graphs for e in _engines.get(model, {}).values()]


def mixed_graphs_of(model) -> list:
    """The mixed steps' graphs (MixedGraphs, kv.mixed_graphs) of `model`'s engines."""
    with _engines_lock:
        return [e.runner.mixed for e in _engines.get(model, {}).values()]


def engine_stats(model=None) -> dict:
    """The engines' figures (of `model`'s, when given), summed (the longest of each "_max_s")."""
    with _engines_lock:
        if model is not None:
            engines = list(_engines.get(model, {}).values())
        else:
            engines = [e for group in _engines.values() for e in group.values()]
    total: dict = {}
    for e in engines:
        for k, v in e.snapshot().items():
            total[k] = max(total.get(k, 0), v) if k.endswith("_max_s") else total.get(k, 0) + v
    if engines:  # the process's collection pauses since its first engine (engine/gc_watch.py)
        total["gc_s"], total["gc_full"] = gc_watch.pause_s, gc_watch.full
    return total
