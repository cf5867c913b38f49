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
import functools
import os
import threading
import weakref

import torch

from ...engine.loop import Engine
from ...kv import swap
from ...kv.block_manager import KVCacheFull
from ...kv.decode_step import DecodeStep
from ...kv.merged import MergedStep, Part
from ...kv.pool import get_pool
from ...kv.transfer import to_device
from . import graphs, merged_graphs
from . import prefix as prefix_cache
from .batched import _forward, _geometry, _graph_forward
from .cache import PagedKVCache

ENGINE_MAX_GRAPHS = 48  # rows buckets x table widths the engine's decode steps go through


class HFRunner:
    """What the engine (engine/loop.py) asks of a model: rows' KV, block counts, a forward."""

    def __init__(self, model, cfg, kv_dtype: str | None = None, precision=None):
        self._model = weakref.ref(model)
        self.cfg = cfg
        self.text = model.config.get_text_config(decoder=True)
        self.geometry = _geometry(model)
        self.device = self.geometry[3]
        self.vocab = _vocab(model)
        self._kv_dtype, self._precision = kv_dtype, precision
        proto = self.new_kv()
        self.pool = get_pool(proto._core.pool_key(*self.geometry))
        self.block_tokens = proto._core.block_tokens
        self.precision, self.tiles = proto._core.precision, proto._core.tiles
        self.graphs = merged_graphs.MergedGraphs(max_graphs=ENGINE_MAX_GRAPHS)
        self._serial = prefix_cache._serial(model)
        self.replayed = 0

    # --- rows' KV --------------------------------------------------------------------------

    def new_kv(self) -> PagedKVCache:
        return PagedKVCache(
            config=self.text, cfg=self.cfg, kv_dtype=self._kv_dtype, precision=self._precision
        )

    # --- the prefix cache (kv.prefix_cache) ------------------------------------------------

    def _prefix(self):
        """The pool's prefix cache, its zones set from the configuration; None when off."""
        kv = self.cfg.kv
        if not kv.prefix_cache:
            return None
        pc = self.pool.prefix_cache(kv.prefix_cache_bytes)
        if pc is not None:
            zones = self.cfg.pool
            self.pool.cpu_tier_of(zones)
            pc.threshold, pc.hot_ratio = zones.migration_threshold, zones.hot_zone_ratio
        return pc

    def start(self, kv: PagedKVCache, tokens: list[int]) -> int:
        """A new row takes the prefix cache's blocks of its first tokens (at most all but the
        last, whose logits it draws from): their count, 0 on a miss."""
        with self.pool.lock:
            pc = self._prefix()
            if pc is None or len(tokens) < 2:
                return 0
            ns = self._ns(kv)
            # a row about to give blocks back behind its window keeps its tokens' blocks first
            kv._core.before_drop = functools.partial(self._keep_early, ns, list(tokens))
            pc.promote(ns, [tokens])
            bt = self.block_tokens
            take = min(len(pc.peek(ns, tokens)) * bt, len(tokens) - 1)
            blocks = pc.lookup(ns, tokens, use=take)
            if take > 0:
                core = kv._core
                core.bind(1, *self.geometry)
                mine = blocks[: -(-take // bt)]
                self.pool.manager.incref(mine)
                core.seqs.blocks[0], core.seqs.lens[0] = list(mine), take
                core._grow_table(len(mine))
                core._table_host[0, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
                core.length = take
                core._lent = True  # (the device table is built by the step)
            pc.sweep()
        return take

    def keep(self, kv: PagedKVCache | None, tokens: list[int]) -> None:
        """A row's whole blocks join the prefix cache (a later call, or the row itself after a
        preemption, starts on them); not a row that gave blocks back behind its window."""
        core = kv._core if kv is not None else None
        if core is None or core.seqs is None or core.pool is not self.pool:
            return
        with self.pool.lock:
            pc = self._prefix()
            seqs = core.seqs
            if pc is None or seqs.dropped[0] or seqs.narrowed[0]:
                return
            pc.insert(self._ns(kv), tokens[: min(len(tokens), seqs.lens[0])], seqs.blocks[0])
            pc.sweep()

    def _keep_early(self, ns: tuple, tokens: list[int], core, rows: list[int]) -> None:
        """A core's before_drop (pool lock held): the row's first blocks join the prefix cache
        before its window lets them go (its tokens known at admission, as far as computed)."""
        pc, seqs = self.pool.prefix, core.seqs
        if pc is not None and seqs is not None and rows == [0]:
            pc.insert(ns, tokens[: min(len(tokens), seqs.lens[0])], seqs.blocks[0])

    # --- swap preemption (the pool's CPU tier: pool.cpu_tier_bytes) -------------------------

    def swap_out(self, kv: PagedKVCache, low: bool) -> int | None:
        """The row's KV to the CPU tier: the device blocks freed, or None (no tier, no room,
        or a row that narrowed blocks behind its window: it is recomputed instead)."""
        core = kv._core
        if core.seqs is None or core.debug or not any(core.seqs.blocks):
            return None
        with self.pool.lock:
            if self.pool.cpu_tier_of(self.cfg.pool) is None:
                return None
        return swap.swap_out(core, low_priority=low)

    def swap_in(self, kv: PagedKVCache) -> bool:
        try:
            swap.swap_in(kv._core)
        except KVCacheFull:
            return False
        return True

    def swapped_blocks(self, kv: PagedKVCache) -> int:
        s = kv._core._swapped
        return s.blocks_needed() if s is not None else 0

    def _ns(self, kv: PagedKVCache) -> tuple:
        """The namespace of a row's K/V in the prefix cache: the model, precision, tiles and
        stored dtype (as generate()'s per-call prefix cache keys them)."""
        core = kv._core
        return (self._serial, int(core.precision), core.tiles, core.kv_dtype)

    def blocks_for(self, kv: PagedKVCache | None, n: int) -> int:
        """Fresh blocks n more tokens of the row take (a row without KV: from nothing)."""
        core = kv._core if kv is not None else None
        if core is None or core.seqs is None:
            return -(-n // self.block_tokens)
        return core.seqs.blocks_needed(0, n)

    def decode_blocks(self, kvs: list) -> list[int]:
        """blocks_for(kv, 1) of each row, in one pass: a block is due where the last one is
        full, or shared and partly filled (copy-on-write)."""
        bt, refcount = self.block_tokens, self.pool.manager.refcount
        out = []
        for kv in kvs:
            s = kv._core.seqs
            n = s.lens[0]
            out.append(1 if not n % bt else int(refcount(s.blocks[0][-1]) > 1))
        return out

    def free_blocks(self) -> int:
        return self.pool.manager.num_available

    def total_blocks(self) -> int:
        m = self.pool.manager
        return m.num_blocks - m.first_id

    def release(self, kv: PagedKVCache) -> None:
        kv._core.release()

    # --- a step -----------------------------------------------------------------------------

    def forward(self, rows, ids: torch.Tensor, pos: list[int]) -> torch.Tensor:
        """The logits [K, V] of the rows that keep one (engine/loop.py Runner)."""
        model = self._model()
        if model is None:
            raise RuntimeError("oxygen_torch: the model of these generate() calls is gone")
        cores = [row.req.kv._core for row in rows]
        decode = all(row.ids is None for row in rows)
        if decode:  # the steady state: one token for each row, every row bound
            step = DecodeStep(cores)
        else:
            for core in cores:
                if core.pool is None:
                    core.bind(1, *self.geometry)
            step = MergedStep([Part(c, [row.n], row.n) for c, row in zip(cores, rows)])
        replay = self._replayable(rows)
        with step.pool.lock:
            step.reserve(build=not replay)
        try:
            logits = self._replay(model, step, rows, ids, pos) if replay else None
            if logits is None:
                if replay:  # its capture failed before: eager after all
                    step.build()
                logits = self._eager(model, step, rows, ids, pos)
        except BaseException:
            step.abandon()
            raise
        step.commit()
        return logits

    def _replayable(self, rows) -> bool:
        """A step of decodes only, with decode graphs on (kv.decode_graphs, on a GPU)."""
        if any(row.ids is not None for row in rows):
            return False
        kv = rows[0].req.kv
        return graphs.usable(self.device, kv) and not kv._core.debug

    def _replay(self, model, step: MergedStep, rows, ids, pos):
        need = max(len(c.seqs.blocks[0]) for c in step.cores)
        width = max(graphs.WIDTH_STEP, 1 << (need - 1).bit_length())
        logits = self.graphs.run(model, step, width, [ids], pos, _graph_forward)
        self.replayed += logits is not None
        return logits

    def _eager(self, model, step: MergedStep, rows, ids, pos) -> torch.Tensor:
        keep, at = [], 0
        for row in rows:
            at += row.n
            if row.keep:
                keep.append(at - 1)
        dev = to_device(torch.tensor(pos + keep, dtype=torch.int64), self.device)
        n = len(pos)
        out = _forward(model, step, ids.view(1, -1), dev[:n].view(1, -1), dev[n:])
        return out.logits[0]


def _vocab(model) -> int:
    """The logits' width: the output embedding's rows (the config's vocab_size may differ)."""
    out = model.get_output_embeddings()
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    return int(model.config.get_text_config(decoder=True).vocab_size)


_engines: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {key: Engine}
_engines_lock = threading.Lock()


def engine_for(model, cfg) -> Engine:
    """The engine of `model` for this configuration's KV pool, precision and tiles (one thread
    each); a new one after a fork (threads do not cross fork) or after its close."""
    probe = PagedKVCache(config=model.config.get_text_config(decoder=True), cfg=cfg)
    core = probe._core
    key = (core.pool_key(*_geometry(model)), core.precision, core.tiles, cfg.scheduler)
    with _engines_lock:
        group = _engines.setdefault(model, {})
        eng = group.get(key)
        if eng is None or eng.closed or eng.pid != os.getpid():
            # kv.prefill_chunk_tokens bounds a step's tokens too: the activations of a long
            # prefill decide how large a batch fits
            eng = group[key] = Engine(
                HFRunner(model, cfg), cfg.scheduler, type(model).__name__,
                step_tokens=cfg.kv.prefill_chunk_tokens,
            )  # fmt: skip
        return eng


@atexit.register
def close_all() -> None:
    """Ends every engine thread (disable()): calls still waiting get a clear error."""
    with _engines_lock:
        engines = [e for group in _engines.values() for e in group.values()]
        _engines.clear()
    for e in engines:
        e.close()


def engine_stats(model=None) -> dict:
    """The engines' figures (of `model`'s, when given), summed."""
    with _engines_lock:
        if model is not None:
            engines = list(_engines.get(model, {}).values())
        else:
            engines = [e for group in _engines.values() for e in group.values()]
    total: dict = {}
    for e in engines:
        for k, v in e.snapshot().items():
            total[k] = total.get(k, 0) + v
    return total
