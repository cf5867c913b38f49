"""The multi-task engine's merged decode steps, replayed from CUDA graphs by batch-size bucket.

A merged step in which every row of every call decodes one token (no prefill chunk, no
recompute) has the same shape as any other such step with as many rows: one packed row [1, R]
of ids and positions over a block table [R, W]. It is captured once per (rows bucket, table
width, pool) and replayed, through the one CUDA-graph runner (compile.cudagraphs.GraphRunner,
warm_capture, strict), like a single call's decode step (graphs.py):

- R is rounded up to a bucket (BUCKETS, then multiples of 64); the rows beyond R are padding:
  they read and write GUARD_BLOCK (always mapped, never handed out) at position 0, and their
  logits are dropped.
- The table width is the widest call's graph width (graphs.graph_width: its generate()'s
  max_length in WIDTH_STEP blocks), so the calls' whole decode phases replay few graphs.
- The host plans the step as an eager merged step does (MergedStep.reserve, every core's own
  blocks), then copies table, lengths, slots and positions into the graph's buffer in one pinned
  copy and the callers' ids into the graph's ids; the graph reads only those, the weights and
  the pool's K/V. After the replay MergedStep.commit() leaves each core as its eager step would.

The capture runs the model's forward compiled whole by backend "oxygen" (fuse.compiled:
attention becomes oxygen::paged_step over the graph's core, Inductor fuses the norms, rotary,
residual adds and activations), as a single call's decode graphs do, where
`kv.decode_graph_fusion` and `kv.decode_graph_compile` are on (the engine's graphs; on a CPU
with `kv.cpu_decode_graphs` "fuse"): its sizes symbolic from the first compile
(batched._symbolic: every logit kept by index, so the mixed steps' graphs and the compiled
prefill run the same compile), so later buckets only capture; a one-row bucket compiles its
own (a static forward: replaying the two-row graph with a padding row instead, one compile a
process, took 1.71 ms a decode step against its 1.63 on an H100, 1B shape with a 128k vocabulary:
5 % of a call alone's speed for a one-time ~15 s that Inductor's cache mostly saves). If that
compile fails, the fusible modules are compiled instead (fuse.fused), else the eager forward is
captured; each failure warns once. On the H200 the engine's unfused capture took 2.34 ms a
decode step at 16 rows (Llama-1.1B shape) where a single call's compiled graph had taken
1.86-1.90.

Graphs are kept per Merger or engine (at most MAX_GRAPHS, least recently used dropped), dropped
when the model's weights move; a signature whose capture fails runs eagerly, with one warning.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from contextlib import nullcontext

import torch

from ... import _patching, context
from ...compile.cudagraphs import CaptureError, GraphRunner
from ...engine import gc_watch
from ...kv.merged import MergedStep
from ...kv.plan import StepPlan
from ...kv.storage import GUARD_BLOCK
from . import fuse, graphs

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MAX_GRAPHS = 8
# A signature not captured yet replays the smallest captured graph that holds it (more rows,
# a wider table: padding) until it has been asked for this many times, then gets its own. A
# capture costs 60-100 ms on the H200 (1B shape; 130-190 ms each on the H100 in the arrival
# trace, where this count at 16 let 19 captures take ~3 s of a 15.8 s run and the high class's
# slowest tokens), a padded replay next to nothing up to ~64 rows (the step's matmuls read the
# weights once however many rows), and the rows buckets a batch passes through as its calls
# finish are each asked for a few steps only.
CAPTURE_AFTER = 256


def bucket(rows: int) -> int:
    """The graph batch a merged decode step of `rows` rows replays."""
    for b in BUCKETS:
        if rows <= b:
            return b
    return -(-rows // 64) * 64


class _GraphStep:
    """The duck-typed core a captured forward runs on: MergedStep's write and attend over the
    graph's static buffers (the replay reads whatever the host copied there)."""

    length = 0
    seqs = None
    debug = False
    # no narrowed-window guard at capture: the replays serve later steps, and every core already
    # checked each layer's window in its own eager prefill before any block was narrowed
    # (kv/window.py _check_window)
    _narrowed = None
    write = MergedStep.write
    attend = MergedStep.attend

    def step(self, layer, q, k, v, *, scale, sliding_window) -> torch.Tensor:
        """One layer of the step, as a compiled forward's oxygen::paged_step runs it: stores
        the packed k/v ([1, Hkv, R, D]) and attends q ([1, Hq, R, D]) -> [1, R, Hq, D]."""
        plan = self.write(layer, k, v)
        return self.attend(layer, q, plan, scale=scale, sliding_window=sliding_window)

    def __init__(self, graph: MergedDecodeGraph, pool, precision, tiles):
        self._pool = weakref.ref(pool)  # a graph must not keep a released pool's memory alive
        self.precision, self.tiles = precision, tiles
        self.tokens = graph.rows
        self.table, self.seq_lens = graph.table, graph.seq_lens
        self._plan = StepPlan(1, graph.slots, None, None)

    @property
    def pool(self):
        pool = self._pool()
        if pool is None:
            raise RuntimeError("oxygen_torch: a merged decode graph outlived its KV pool")
        return pool


class MergedDecodeGraph:
    """One captured merged decode step: `rows` rows (padding included), table `width` wide."""

    def __init__(self, rows: int, width: int, step: MergedStep, device: torch.device):
        self.rows, self.width = rows, width
        self.key = (rows, width, id(step.pool))  # (its MergedGraphs' key)
        n = rows * width
        # one int32 buffer: table [rows, W] | lengths | slots | positions
        self.buf = torch.empty(n + 3 * rows, dtype=torch.int32, device=device)
        self.table = self.buf[:n].view(rows, width)
        self.seq_lens = self.buf[n : n + rows]
        self.slots = self.buf[n + rows : n + 2 * rows]
        self.positions = self.buf[n + 2 * rows :]
        self._start(rows, _GraphStep(self, step.pool, step.precision, step.tiles))

    def _start(self, tokens: int, core) -> None:
        """What every graph of the engine has beside its buffer `buf` (made first): ids of
        `tokens` tokens, the staging of `buf`, the core its forward runs on, no runner yet."""
        self.ids = torch.zeros(1, tokens, dtype=torch.int64, device=self.buf.device)
        self._staging = graphs.Staging(self.buf)
        self.core = core
        self.runner: GraphRunner | None = None
        self.out_type = None
        self.replays = 0
        self.fusion: str | None = None  # how the captured forward was fused (None: eager)
        self.lock = threading.Lock()
        self.capture_ctx = None  # a capture context (mixed steps' graphs: one shared pool)
        self.copy_out = True  # a replay's logits copied out (MergedGraphs' copy_out)

    def stage(self, step: MergedStep, ids: list[torch.Tensor], pos: list[int], keep=None) -> int:
        """Copies the reserved `step` into the graph's buffers; returns its real rows (every
        row's logit is kept: `keep` is for the mixed steps' graphs, mixed_graphs.py)."""
        table, slots, lens, _ = step.host_plan()
        r, rows, w = len(lens), self.rows, self.width
        view = self._staging.fill()
        n = rows * w
        grid = view[:n].reshape(rows, w)
        grid[:] = GUARD_BLOCK
        grid[:r, : table.shape[1]] = table.numpy()
        view[n : n + rows] = 1  # padding rows: one token, in GUARD_BLOCK's slot 0
        view[n : n + r] = lens
        view[n + rows : n + 2 * rows] = GUARD_BLOCK * step.pool.key.block_tokens
        view[n + rows : n + rows + r] = slots
        view[n + 2 * rows :] = 0
        view[n + 2 * rows : n + 2 * rows + r] = pos
        self._staging.send()
        self.ids[0, :r].copy_(_packed(ids))
        if r < rows:
            self.ids[0, r:].zero_()
        return r

    def run(self, model, forward, fuse_on: bool = False, compile_whole: bool = True,
            new_cache=None):  # fmt: skip
        """Replays (or warms up and captures on first use); the logits [rows, V]. The capture
        runs the forward compiled whole by backend "oxygen" when `fuse_on` and
        `compile_whole` (over the cache new_cache(core, model) makes), else (or when that
        compile fails) with the fusible modules compiled when `fuse_on`, else unfused; each
        failure warns once (as a single call's graphs do)."""
        if self.runner is not None:
            self.replays += 1
            return self.runner(self.ids, self.buf)[0]
        for how, fusion in fuse.tries(fuse_on, compile_whole and new_cache is not None):
            try:
                bound = type(model).forward.__get__(model)
                with fusion(model, bound, self.core, dynamic=None) as fn:
                    whole = fn if how == "compiled" else None
                    logits = self._capture(model, forward, whole, new_cache)
                self.fusion = how
                return logits
            except CaptureError:
                raise
            except Exception as err:  # noqa: BLE001 - the next try (the step is idempotent)
                _patching.warn_once(
                    f"oxygen_torch: merged decode-graph fusion ({how}) failed: {err!r}"
                )
                self.runner = None
        return self._capture(model, forward, None)

    def _capture(self, model, forward, compiled, new_cache=None) -> torch.Tensor:
        """Warm-up and capture of the step; `compiled`: the model's forward compiled whole (its
        attention is oxygen::paged_step over this graph's core, lent while it runs), run on the
        cache new_cache(core, model) makes."""
        # the one cache object the warm-up and the capture both run on (a compiled forward
        # guards on its inputs: a new object a run would be compiled again)
        cache = new_cache(self.core, model) if compiled is not None else None

        def step(ids, buf):
            pos = self.positions.to(torch.int64).view(1, -1)
            context.lend(self.core)
            try:  # (a CPU's stand-in replays run this again: a compiled forward's guards
                # expect the tracing flag then too)
                with context.tracing() if compiled is not None else nullcontext():
                    out = forward(model, self.core, ids, pos, compiled, cache)
            finally:
                context.forget(self.core)
            self.out_type = type(out)
            return out.logits  # (not the output: it holds the step's cache)

        self.runner = GraphRunner(
            step,
            frozenset(),
            capture=self.capture_ctx,
            device_type=self.ids.device.type,
            static=frozenset({0, 1}),
            warm_capture=True,
            strict=True,
            copy_out=self.copy_out,
        )
        try:
            return self.runner(self.ids, self.buf)[0]
        except CaptureError:
            raise  # (play() drops this graph)
        except BaseException:
            self.runner = None  # its warm-up failed: not captured, tried again as a new one
            raise


def _packed(ids: list[torch.Tensor]) -> torch.Tensor:
    """The step's ids one after the other, flat: the one tensor itself when there is one (a
    decode step's; the copy into the graph's ids converts)."""
    if len(ids) == 1:
        x = ids[0]
        return x if x.dim() == 1 else x.reshape(-1)
    return torch.cat([x.reshape(-1) for x in ids])


class MergedGraphs:
    """The merged decode graphs of one Merger."""

    def __init__(self, max_graphs: int = MAX_GRAPHS, copy_out: bool = True):
        """copy_out False (the engine's): a replay hands back its graph's own logits, no copy
        of [rows, V] a step. For an owner that queues every use of a step's logits (the draw,
        a kept row's copy) before it replays the next step, on the same stream; each decode
        graph's memory is its own. (Not the per-call merged steps: a caller reads its rows on
        its own thread, maybe after the next replay.)"""
        self.max_graphs = max_graphs
        self.copy_out = copy_out
        self.graphs: OrderedDict[tuple, MergedDecodeGraph] = OrderedDict()
        self.failed: set[tuple] = set()
        self.fingerprint: tuple = ()
        self.captures = 0
        self.padded = 0  # replays of a larger graph for a signature not captured yet
        self._asked: dict[tuple, int] = {}
        self.out_type = None  # the model's output class (what a replay's logits are given in)
        # a whole-forward compile failed once: later captures go straight to the next fusion
        # (each try of a compile that fails costs seconds)
        self.compile_failed = False
        self._checked: list = []  # the cores (weakly) the fingerprint was last checked for
        self._lock = threading.Lock()

    def run(self, model, step: MergedStep, width: int, ids, pos, forward):
        """The logits [R, V] of the reserved decode `step` (R rows), or None when this
        signature runs eagerly (its capture failed before: the step is not run); captured
        from the eager forward."""
        g = self.pick(model, step, width, len(pos))
        return None if g is None else self.play(g, model, step, ids, pos, forward)

    def pick(self, model, step: MergedStep, width: int, rows: int, exact: bool = False):
        """The graph a decode step of `rows` rows and a table `width` wide replays (one not
        captured yet: its `runner` is None), or None when this signature runs eagerly. `exact`
        (oxygen_torch.warm_up): a rows bucket not captured yet gets its own graph now instead
        of padded replays of a larger one."""
        rows = bucket(rows)
        key = (rows, width, id(step.pool))
        with self._lock:
            self._check(model, step)
            if key in self.failed:
                return None
            g = self.graphs.get(key)
            if g is not None and g.core._pool() is not step.pool:  # a new pool at the same id
                g = None
            if g is None:  # a wider table costs only its copy: never a capture of its own
                g = self._larger(rows, width, step.pool, same_rows=True)
                if g is not None:
                    self.padded += 1
                    key = (g.rows, g.width, id(step.pool))
            if g is None:
                asked = self._asked[key] = self._asked.get(key, 0) + 1
                pad = asked <= CAPTURE_AFTER and not exact
                g = self._larger(rows, width, step.pool) if pad else None
                if g is not None:
                    self.padded += 1
                    key = (g.rows, g.width, id(step.pool))
            if g is None:
                self._asked.pop(key, None)
                # as wide as the widest captured so far: narrower tables later replay it
                width = max([width] + [w for (_, w, p) in self.graphs if p == id(step.pool)])
                key = (rows, width, id(step.pool))
                if key in self.failed:  # (that width's capture failed: eager, not again)
                    return None
                g = self.graphs[key] = MergedDecodeGraph(rows, width, step, step.pool.key.device)
                g.copy_out = self.copy_out
                while len(self.graphs) > self.max_graphs:
                    self.graphs.popitem(last=False)
            self.graphs.move_to_end(key)
            return g

    def _check(self, model, step) -> None:
        """Drops every graph when the model's weights or buffers moved (stale addresses):
        checked once per set of cores, as a single call's graphs do. Under self._lock."""
        cores = getattr(step, "cores", None) or [p.core for p in step.parts]
        same = len(cores) == len(self._checked) and all(
            r() is c for r, c in zip(self._checked, cores)
        )
        if not same:
            fp = graphs._fingerprint(model)  # (~200 addresses: ~0.1 ms of host time)
            if fp != self.fingerprint:
                self.graphs.clear()
                self.failed.clear()
                self.fingerprint = fp
            self._checked = [weakref.ref(c) for c in cores]

    def play(self, g: MergedDecodeGraph, model, step: MergedStep, ids, pos, forward,
             fuse_on=False, compile_whole=True, new_cache=None, keep=None):  # fmt: skip
        """The step's logits [R, V] through `g` (pick's), or None when its capture failed
        (the signature runs eagerly from now on: the step is not run). A capture fuses as
        MergedDecodeGraph.run says. `keep`: a mixed step's kept logits (mixed_graphs.py)."""
        key = g.key
        with g.lock:
            r = g.stage(step, ids, pos, keep)
            fresh = g.runner is None
            whole = compile_whole and not self.compile_failed
            try:
                logits = g.run(model, forward, fuse_on=fresh and fuse_on, compile_whole=whole,
                               new_cache=new_cache)  # fmt: skip
                if fresh and fuse_on and whole and new_cache is not None:
                    self.compile_failed = g.fusion != "compiled"
            except CaptureError as failed:  # this signature stays eager; the step was done
                with self._lock:
                    self.failed.add(key)
                    self.graphs.pop(key, None)
                _patching.warn_once(
                    "oxygen_torch: merged decode CUDA-graph capture failed, these steps run "
                    f"eagerly: {failed.__cause__!r}"
                )
                logits = failed.result[0]
            self.captures += fresh
            if fresh and fuse_on:  # its compile's objects out of later full collections
                gc_watch.refreeze("a merged decode graph's compile")
            self.out_type = g.out_type
            return logits[:r]

    def _larger(self, rows: int, width: int, pool, same_rows: bool = False):
        """The smallest captured graph of at least `rows` rows (`same_rows`: exactly) and
        `width` blocks on `pool`."""
        best = None
        for (r, w, _), g in self.graphs.items():
            fits = r == rows if same_rows else r >= rows
            if fits and w >= width and g.runner is not None and g.core._pool() is pool:
                if best is None or (r * w, r) < (best.rows * best.width, best.rows):
                    best = g
        return best

    def clear(self) -> None:
        with self._lock:
            self._asked.clear()
            self.graphs.clear()
            self.failed.clear()
            self._checked = []

    def stats(self) -> dict:
        held = list(self.graphs.values())
        return {
            "graphs": len(held),
            "captures": self.captures,
            "replays": sum(g.replays for g in held),
            "padded": self.padded,
            "failed": len(self.failed),
            "compiled": sum(g.fusion == "compiled" for g in held),
            "fused": sum(g.fusion == "modules" for g in held),
        }


def summed(held: list[MergedGraphs]) -> dict:
    """The figures of several MergedGraphs (MergedGraphs.stats), summed."""
    total = dict.fromkeys(MergedGraphs().stats(), 0)
    for g in held:
        for k, v in g.stats().items():
            total[k] += v
    return total
