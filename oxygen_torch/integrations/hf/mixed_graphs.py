"""The engine's steps with prompt tokens, replayed from CUDA graphs (kv.mixed_graphs).

A step that carries prompt tokens (a prefill chunk, alone or beside decoding rows) is a
MergedStep: T tokens of R rows packed into one sequence, each row's new tokens attending over
its blocks through the paged prefill kernel (one launch a layer, its grid set by T and R).
Eagerly its forward costs the engine thread's Python for every op of every layer whatever T is
(25-47 ms for the 16-layer 1B shape on the H100 in bench_multitask.py's arrival trace), and
every decoding row of the step waits through it. Here such a step is captured once per (tokens
bucket, rows bucket, table width, pool) and replayed, as merged_graphs.py does for decode steps:

- T is rounded up to a power of two (TOKENS_MIN at least) and R + 1 up to a rows bucket
  (merged_graphs.bucket). The padding tokens form one more sequence, in the row after the real
  ones: its table row is GUARD_BLOCK only, its length its token count, its slots in
  GUARD_BLOCK (always mapped, never handed out), so the table is at least T tokens wide; the
  rows after it have no token (the kernel gives them no tile). Padding logits are dropped.
- The logits kept are the rows' that keep one (a prompt's last chunk, a decoding row), by an
  index in the graph's buffer: [R, V] out, the first K real.
- Table, lengths, cumulative token counts, slots, positions and kept indices go to the graph's
  buffer in one pinned copy, the step's ids into the graph's ids; MergedStep.commit() after the
  replay leaves each core as its eager step would.
- Capture and fusion as merged decode graphs (the forward compiled whole by backend "oxygen"
  where kv.decode_graph_fusion / decode_graph_compile say; a failed capture runs that
  signature eagerly, with one warning; after MAX_FAILED such signatures the others are not
  tried). A signature not captured yet replays the smallest captured graph of its tokens
  bucket that holds it (more rows, a wider table: padding rows cost next to nothing, padding
  tokens what real ones do, so never a larger tokens bucket) until it has been asked for
  merged_graphs.CAPTURE_AFTER times; oxygen_torch.warm_up captures one graph a tokens bucket at
  the most rows first (integrations/hf/warm.py).
- Only steps whose rows narrowed no sliding window (a hybrid model's eager step checks each
  layer's reads against the narrowed pages; a graph would not) and with at most kv.mixed_graphs
  tokens; the others run eagerly (or compiled: kv.prefill_compile).

On a GPU the graphs share one memory pool (one replays at a time, its logits copied out
before the next): they hold the largest one's working memory plus each one's logits (320 rows
of a 128k vocabulary in bf16: 80 MiB). On by default, up to 2,048 tokens a step (measured on an
H100: benchmarks/RESULTS.md, time to first token and the engine's trace).
"""

from __future__ import annotations

import functools
import weakref

import numpy as np
import torch

from ...kv.merged import MergedStep
from ...kv.plan import StepPlan
from ...kv.storage import GUARD_BLOCK
from . import graphs
from . import merged_graphs as _merged
from .batched import _forward
from .merged_graphs import MergedDecodeGraph, MergedGraphs, _GraphStep, bucket

TOKENS_MIN = 16
MAX_FAILED = 4  # signatures whose capture failed before the rest run eagerly (or padded)


def token_bucket(tokens: int) -> int:
    """The tokens a mixed step of `tokens` tokens replays: a power of two, TOKENS_MIN at least."""
    return max(TOKENS_MIN, 1 << (max(1, tokens) - 1).bit_length())


def rows_bucket(rows: int) -> int:
    """The rows of a mixed step of `rows` real rows' graph: one more for the padding tokens."""
    return bucket(rows + 1)


def mixed_forward(model, core, ids, pos, forward=None, cache=None):
    """A mixed step graph's forward over its static buffers: the kept rows' logits [1, R, V]."""
    return _forward(model, core, ids, pos, core.keep.to(torch.int64), forward, cache)


class _MixedGraphStep(_GraphStep):
    """The duck-typed core a captured mixed step runs on (the graph's static buffers)."""

    def __init__(self, graph: MixedGraph, pool, precision, tiles):
        self._pool = weakref.ref(pool)
        self.precision, self.tiles = precision, tiles
        self.tokens = graph.tokens
        self.table, self.seq_lens = graph.table, graph.seq_lens
        self.keep = graph.keep
        self._plan = StepPlan(0, graph.slots, graph.cu, None)

    def _prefill_path(self, q, sliding_window, have_kv) -> tuple[str, str]:
        return "paged", "a mixed-step graph"  # (the dense path reads host lengths)


class MixedGraph(MergedDecodeGraph):
    """One captured mixed step: `tokens` tokens of `rows` rows (padding included), table `width`
    blocks wide."""

    def __init__(self, tokens: int, rows: int, width: int, step: MergedStep, device):
        self.tokens, self.rows, self.width = tokens, rows, width
        self.key = (tokens, rows, width, id(step.pool))
        n = rows * width
        # one int32 buffer: table [R, W] | lengths [R] | cumulative counts [R + 1] |
        # slots [T] | positions [T] | kept indices [R]
        at = np.cumsum([0, n, rows, rows + 1, tokens, tokens, rows])
        self._at = at
        self.buf = torch.empty(int(at[-1]), dtype=torch.int32, device=device)
        self.table = self.buf[: at[1]].view(rows, width)
        self.seq_lens = self.buf[at[1] : at[2]]
        self.cu = self.buf[at[2] : at[3]]
        self.slots = self.buf[at[3] : at[4]]
        self.positions = self.buf[at[4] : at[5]]
        self.keep = self.buf[at[5] : at[6]]
        self._start(tokens, _MixedGraphStep(self, step.pool, step.precision, step.tiles))

    def stage(self, step: MergedStep, ids: list[torch.Tensor], pos: list[int], keep=None) -> int:
        """Copies the reserved `step` (its packed ids and positions, the packed indices of the
        logits it keeps) into the graph's buffers; returns how many logits it keeps."""
        table, slots, lens, counts = step.host_plan()
        r, t, k = len(lens), len(slots), len(keep)
        rows, width, tokens, at = self.rows, self.width, self.tokens, self._at
        pad = tokens - t
        bt = step.pool.key.block_tokens
        view = self._staging.fill()
        grid = view[: at[1]].reshape(rows, width)
        grid[:] = GUARD_BLOCK
        grid[:r, : table.shape[1]] = table.numpy()
        lens_v = view[at[1] : at[2]]
        lens_v[:] = 1  # the rows after the padding one: no token (their length is not read)
        lens_v[:r] = lens
        lens_v[r] = max(pad, 1)
        cu = view[at[2] : at[3]]
        cu[0] = 0
        cu[1 : r + 1] = np.cumsum(counts)
        cu[r + 1 :] = tokens
        view[at[3] : at[3] + t] = slots
        view[at[3] + t : at[4]] = GUARD_BLOCK * bt + np.arange(pad) % bt
        view[at[4] : at[4] + t] = pos
        view[at[4] + t : at[5]] = np.arange(pad)
        kept = view[at[5] : at[6]]
        kept[:] = 0
        kept[:k] = keep
        self._staging.send()
        self.ids[0, :t].copy_(_merged._packed(ids))
        if pad:
            self.ids[0, t:].zero_()
        return k


class MixedGraphs(MergedGraphs):
    """The mixed steps' graphs of one engine (MergedGraphs' capture, replay and policy)."""

    def __init__(self, max_graphs: int = _merged.MAX_GRAPHS):
        super().__init__(max_graphs)
        self._mem_pool = None  # (a CUDA graph pool handle, at the first capture)

    def pick(self, model, step: MergedStep, width: int, rows: int, tokens: int = 0):
        """The graph a mixed step of `tokens` tokens, `rows` rows and a table `width` blocks
        wide replays (one not captured yet: its runner is None), or None (eager)."""
        t, r = token_bucket(tokens), rows_bucket(rows)
        bt = step.pool.key.block_tokens
        width = max(width, graphs.table_width(-(-t // bt)))
        pool = id(step.pool)
        key = (t, r, width, pool)
        with self._lock:
            self._check(model, step)
            g = self.graphs.get(key)
            if g is not None and g.core._pool() is not step.pool:
                g = None
            if g is None:  # the same tokens and rows, a wider table: only its copy costs
                g = self._holder(t, r, width, step.pool, same=True)
            if g is None:
                asked = self._asked[key] = self._asked.get(key, 0) + 1
                # a signature whose capture failed, or after MAX_FAILED failures any: a larger
                # captured graph, else eager (a forward that cannot be captured is not tried
                # again for each of the ~100 signatures)
                gave_up = key in self.failed or len(self.failed) >= MAX_FAILED
                if asked <= _merged.CAPTURE_AFTER or gave_up:
                    g = self._holder(t, r, width, step.pool)
                if g is None and gave_up:
                    return None
            if g is not None:
                if g.key != key:
                    self.padded += 1
            else:
                self._asked.pop(key, None)
                width = max([width] + [k[2] for k in self.graphs if k[3] == pool])
                key = (t, r, width, pool)
                if key in self.failed:
                    return None
                g = self.graphs[key] = MixedGraph(t, r, width, step, step.pool.key.device)
                g.capture_ctx = self._capture_ctx(step.pool.key.device)
                while len(self.graphs) > self.max_graphs:
                    self.graphs.popitem(last=False)
            self.graphs.move_to_end(g.key)
            return g

    def _capture_ctx(self, device: torch.device):
        """On a GPU, capture into one memory pool shared by all this engine's mixed graphs: one
        replays at a time on the engine's stream and its logits are copied out before the next
        (GraphRunner clones its outputs), so a graph's working memory is free for the others
        between replays; warm_up captures the largest first. None on a CPU."""
        if device.type != "cuda":
            return None
        if self._mem_pool is None:
            self._mem_pool = torch.cuda.graph_pool_handle()
        return functools.partial(
            torch.cuda.graph, pool=self._mem_pool, capture_error_mode="thread_local"
        )

    def _holder(self, tokens: int, rows: int, width: int, pool, same: bool = False):
        """The smallest captured graph of `tokens` tokens, at least `rows` rows (`same`:
        exactly) and `width` blocks on `pool`. Never one of more tokens: a padding token costs
        what a real one does (a padding row next to nothing: no token, one logit)."""
        best = None
        for (t, r, w, _), g in self.graphs.items():
            fits = t == tokens and (r == rows if same else r >= rows)
            if fits and w >= width and g.runner is not None and g.core._pool() is pool:
                if best is None or (r, w) < (best.rows, best.width):
                    best = g
        return best
