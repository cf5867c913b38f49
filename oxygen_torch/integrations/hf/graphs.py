"""generate()'s decode steps on the paged cache, replayed from CUDA graphs.

Eager decode is bound by the host: a 16-layer model launches a few hundred kernels a step, and
each launch costs the host more than the GPU spends on it. A one-token step of a forward on a
PagedKVCache (CUDA, `kv.decode_graphs`, on by default; the model's forward router sends it here)
is captured once and replayed (on a CPU, with `kv.cpu_decode_graphs`, a stand-in runs the same
path, its "replay" running the captured forward again):

- The host plans the step before the forward (blocks reserved, slots and lengths computed:
  `PagedKVCore.begin_graph_step`), then copies the block table, lengths and slots into the
  graph's buffers in one pinned host-to-device copy, and input_ids / cache_position into the
  graph's inputs. The graph reads only those buffers, the weights and the pool's K/V, so one
  graph serves every cache of the same pool and batch size.
- The block table has a fixed width per graph: enough blocks for generate()'s max_length,
  rounded up to WIDTH_STEP blocks, so a whole generate() call replays one graph.
- The first step of a new graph runs the forward on the graph's buffers (warm-up: Triton and
  the compile run) and then captures it, through the one CUDA-graph runner
  (compile.cudagraphs.GraphRunner, warm_capture): a decode step is idempotent (the same K/V to
  the same slots), so capturing does not disturb the cache. Later steps replay.
- The attention mask is not an input: oxygen's decode never reads it (padding was never stored).

Graphs are kept per model (at most MAX_GRAPHS_PER_MODEL, least recently used dropped) and are
dropped when a parameter or buffer of the model moves, when the pool goes, and on disable().
A step the graph cannot take (output_attentions, an input it does not know, grad mode) runs
eagerly, with one warning naming why when the reason is the caller's choice.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from ... import _patching, context
from ...compile.cudagraphs import CaptureError, GraphRunner
from ...engine import gc_watch
from . import fuse, trace_guard
from .cache import PagedKVCache

WIDTH_STEP = 16  # graph table widths are multiples of this many blocks


def table_width(blocks: int) -> int:
    """An engine graph's table width for `blocks` blocks: a power of two, WIDTH_STEP at least."""
    return max(WIDTH_STEP, 1 << (max(1, blocks) - 1).bit_length())


MAX_GRAPHS_PER_MODEL = 4
# forward() arguments a decode graph knows: everything else makes the step eager
_STATIC_INPUTS = ("input_ids", "position_ids", "cache_position")
_KNOWN = frozenset(
    (*_STATIC_INPUTS, "cache", "past_key_values", "attention_mask", "use_cache", "return_dict")
    + ("logits_to_keep", "output_attentions", "output_hidden_states")
)

_lock = threading.RLock()
_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelGraphs


class Staging:
    """The host side of a graph's int32 input buffer: two pinned buffers, so that one may still
    be in flight while the other is filled, written through numpy views (a numpy store costs a
    fraction of a torch op's host time), each sent in one non-blocking copy."""

    def __init__(self, device_buf: torch.Tensor):
        self.device_buf = device_buf
        pinned = device_buf.device.type == "cuda"
        self._bufs = []
        for _ in range(2):
            host = torch.empty(device_buf.numel(), dtype=device_buf.dtype, pin_memory=pinned)
            self._bufs.append((host, host.numpy(), torch.cuda.Event() if pinned else None))
        self._turn = 0

    def fill(self) -> np.ndarray:
        """The next host buffer, once its copy two sends ago has finished: safe to write."""
        _, view, done = self._bufs[self._turn]
        if done is not None:
            done.synchronize()
        return view

    def send(self) -> None:
        """Copies the buffer `fill()` gave into the device buffer (queued, not waited for)."""
        host, _, done = self._bufs[self._turn]
        self._turn ^= 1
        self.device_buf.copy_(host, non_blocking=True)
        if done is not None:
            done.record()


class DecodeGraph:
    """One captured decode step: batch B, block table W blocks wide, over one pool."""

    def __init__(self, batch: int, width: int, pool, device: torch.device):
        self.batch, self.width, self.device = batch, width, device
        self.pool_ref = weakref.ref(pool)
        # one int32 buffer: table [B, W] | lengths [B] | slots [B] | position (one int64, for
        # a model that does not get position_ids: B * W is even, so it is 8-byte aligned)
        n = batch * width
        self._size = n + 2 * batch + 2
        self.buf = torch.empty(self._size, dtype=torch.int32, device=device)
        self.table = self.buf[:n].view(batch, width)
        self.seq_lens = self.buf[n : n + batch]
        self.slots = self.buf[n + batch : n + 2 * batch]
        self.position = self.buf[n + 2 * batch :].view(torch.int64).view(1, 1)
        self.inputs: dict[str, torch.Tensor] = {}
        self._staging = Staging(self.buf)
        self.runner: GraphRunner | None = None
        self.replays = 0
        self.fusion = None  # "compiled" (whole forward) or "modules" (fuse.fused) or None
        self.out_type = None
        self._call = None  # this step's forward arguments (the CPU stand-in re-runs them)
        self.lock = threading.Lock()

    def stage(self, core, kw: dict) -> None:
        """Plans the step on the host and queues the copies into the graph's buffers."""
        position = core.length  # what the model would take from get_seq_length()
        table, ints = core.begin_graph_step(self.width)
        view = self._staging.fill()
        n, b = self.batch * self.width, self.batch
        view[:n].reshape(b, self.width)[:] = table.numpy()
        view[n : n + 2 * b] = ints
        view[n + 2 * b :].view(np.int64)[0] = position
        self._staging.send()
        for name, static in self.inputs.items():
            static.copy_(kw[name])
        core.lend(self.table, self.seq_lens, self.slots)

    def run(self, model, forward, core, kw: dict, cache_name: str, fuse_on: bool):
        """One decode step: plan, then replay (or warm up and capture on first use, with the
        model's elementwise work compiled when `fuse_on`)."""
        with self.lock:
            self.stage(core, kw)
            # position_ids always given: the model would compute them from the cache length,
            # a host int that a graph would freeze at its capture step
            self._call = {
                **kw, "position_ids": self.position, **self.inputs, "attention_mask": None
            }  # fmt: skip
            try:
                if self.runner is None:
                    logits = self._first(model, forward, core, kw[cache_name], fuse_on)
                else:
                    logits = self.runner(*self.inputs.values())
                    self.replays += 1
            finally:
                self._call = None  # it holds this step's cache
                context.forget(core)  # the replay runs no op; a failed step must not keep it
            core.end_graph_step()
            return self.out_type(logits=logits, **{cache_name: kw[cache_name]})

    def _first(self, model, forward, core, cache: PagedKVCache, fuse_on: bool):
        """Warm-up and capture: compiled whole by backend "oxygen" when `fuse_on`, else (or when
        that compile fails) with the fusible modules compiled, else unfused; each failure warns
        once. The step is idempotent, so a failed try leaves nothing to undo."""
        options = cache.compile_options
        for how, fusion in fuse.tries(fuse_on, cache.cfg.kv.decode_graph_compile):
            try:  # (no engine step beside the compile: trace_guard.py)
                with trace_guard.GUARD.compile(), fusion(model, forward, core, options) as fn:
                    logits = self._warm_and_capture(fn, core)
                self.fusion = how
                return logits
            except CaptureError:
                raise
            except Exception as err:
                _patching.warn_once(f"oxygen_torch: decode-graph fusion ({how}) failed: {err!r}")
                self.runner = None
                core.lend(self.table, self.seq_lens, self.slots)
        return self._warm_and_capture(forward, core)

    def _warm_and_capture(self, forward, core):
        def step(*_static_inputs):
            with context.tracing():  # a compiled forward's guards expect it
                out = forward(**self._call)
            self.out_type = type(out)
            # the logits only: the output object also holds the cache, which must not outlive it
            return out.logits

        self.runner = GraphRunner(
            step,
            frozenset(),
            device_type=self.device.type,
            static=frozenset(range(len(self.inputs))),
            warm_capture=True,
            between=lambda: core.lend(self.table, self.seq_lens, self.slots),
            strict=True,
        )
        return self.runner(*self.inputs.values())


class _ModelGraphs:
    def __init__(self):
        self.graphs: OrderedDict[tuple, DecodeGraph] = OrderedDict()
        self.failed: set[tuple] = set()
        self.fingerprint: tuple = ()
        self.checked = None  # weak reference to the cache the fingerprint was last checked for
        self.captures = 0


def _fingerprint(model) -> tuple:
    """The addresses of the model's parameters and buffers (a tied one as often as it is
    held): a graph captured on them is stale once one moves or is replaced. A walk of the
    modules' own dicts, a third of the time of parameters() and buffers() (their generators
    and names: ~0.37 ms on a 16-layer Llama on the CPU machine); checked at each change of
    the engine's rows."""
    out, stack = [], [model]
    while stack:
        mod = stack.pop()
        out.extend(t.data_ptr() for t in mod._parameters.values() if t is not None)
        out.extend(t.data_ptr() for t in mod._buffers.values() if t is not None)
        stack.extend(m for m in mod._modules.values() if m is not None)
    return tuple(out)


def graph_width(cache: PagedKVCache) -> int:
    """Table width for this cache's next step: generate()'s max_length rounded up to WIDTH_STEP
    blocks, or (no max_length known) what the sequences need, rounded up to a power of two."""
    core = cache._core
    bt = core.block_tokens
    tokens = max(cache.max_cache_len_hint, max(core.seqs.lens, default=0) + 1)
    need = -(-tokens // bt)
    if not cache.max_cache_len_hint:  # unknown end: powers of two, few graphs as it grows
        return max(WIDTH_STEP, 1 << (need - 1).bit_length())
    return -(-need // WIDTH_STEP) * WIDTH_STEP


def _eager_reason(kw: dict) -> str | None:
    """Why this one-token step cannot replay a graph (None when it can)."""
    if torch.is_grad_enabled():
        return "grad mode is on"
    if kw.get("output_attentions") or kw.get("output_hidden_states"):
        return "output_attentions / output_hidden_states"
    extra = sorted(k for k, v in kw.items() if v is not None and k not in _KNOWN)
    if extra:
        return f"forward() arguments {extra}"
    return None


def usable(device: torch.device, cache: PagedKVCache) -> bool:
    """Whether decode steps on `cache` (inputs on `device`) may go through graphs at all: on a
    CPU only with the stand-in kv.cpu_decode_graphs asks for."""
    kv = cache.cfg.kv
    if not kv.decode_graphs or not cache._deferred():
        return False
    return device.type == "cuda" or (device.type == "cpu" and kv.cpu_decode_graphs != "off")


def _graph_for(model, cache: PagedKVCache, kw: dict, ids: torch.Tensor):
    """The DecodeGraph for this step's signature (new if needed), or None when it failed."""
    core = cache._core
    width = graph_width(cache)
    ltk = kw.get("logits_to_keep")
    present = tuple(n for n in _STATIC_INPUTS if isinstance(kw.get(n), torch.Tensor))
    key = (ids.shape[0], width, present, ltk if not isinstance(ltk, torch.Tensor) else None)
    key += (id(core.pool), tuple((kw[n].dtype, tuple(kw[n].shape)) for n in present))
    if cache.compile_options is not None:  # a compile_config's options: a graph of their own
        key += (repr(sorted(cache.compile_options.as_dict().items())),)
    with _lock:
        mg = _graphs.setdefault(model, _ModelGraphs())
        if mg.checked is None or mg.checked() is not cache:  # once per cache (generate() call):
            fp = _fingerprint(model)  # ~200 parameters' addresses: ~0.1 ms of host a step
            if fp != mg.fingerprint:  # weights or buffers moved: the graphs read stale addresses
                mg.graphs.clear()
                mg.failed.clear()
                mg.fingerprint = fp
            mg.checked = weakref.ref(cache)
        if key in mg.failed or isinstance(ltk, torch.Tensor):
            return None, mg, key
        g = mg.graphs.get(key)
        if g is not None and g.pool_ref() is not core.pool:
            g = None
        if g is None:
            g = DecodeGraph(ids.shape[0], width, core.pool, ids.device)
            g.inputs = {n: torch.empty_like(kw[n]) for n in present}
            mg.graphs[key] = g
            while len(mg.graphs) > MAX_GRAPHS_PER_MODEL:
                mg.graphs.popitem(last=False)
        mg.graphs.move_to_end(key)
    return g, mg, key


def decode_step(model, forward, kw: dict, cache: PagedKVCache, cache_name: str):
    """A one-token forward of `model` on `cache` through a decode graph, or None to run it
    eagerly (`forward` is the model's uncompiled forward)."""
    ids = kw.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1:
        return None
    if not usable(ids.device, cache):
        return None
    core = cache._core
    if core.seqs is None or core.debug or ids.shape[0] != len(core.seqs):
        return None
    reason = _eager_reason(kw)
    if reason is not None:
        _patching.warn_once(f"oxygen_torch: decode steps run without CUDA graphs: {reason}")
        return None
    g, mg, key = _graph_for(model, cache, kw, ids)
    if g is None:
        return None
    try:
        fresh = g.runner is None  # the fusion setting matters only to a capture
        kv = cache.cfg.kv
        fuse_here = ids.device.type == "cuda" or kv.cpu_decode_graphs == "fuse"
        fuse_on = fuse_here and kv.decode_graph_fusion
        out = g.run(model, forward, core, kw, cache_name=cache_name, fuse_on=fresh and fuse_on)
        mg.captures += fresh
        if fresh and fuse_on:  # its compile's objects out of later full collections
            gc_watch.refreeze("a decode graph's compile")
        return out
    except CaptureError as failed:  # this signature stays eager; the step itself was done
        with _lock:
            mg.failed.add(key)
            mg.graphs.pop(key, None)
        _patching.warn_once(
            "oxygen_torch: decode CUDA-graph capture failed, these steps run eagerly: "
            f"{failed.__cause__!r}"
        )
        core.end_graph_step()
        return g.out_type(logits=failed.result, **{cache_name: cache})


def clear() -> None:
    """Drops every decode graph (disable(), pools released)."""
    with _lock:
        _graphs.clear()


def stats(model) -> dict:
    """Decode graphs of `model`: held now, captured so far, replays of those held, input
    signatures that failed to capture (they run eagerly), and of those held, how many were
    captured from the forward compiled whole by backend "oxygen" (compiled) or with only its
    RMSNorm / MLP / rotary modules compiled (fused)."""
    mg = _graphs.get(model)
    held = list(mg.graphs.values()) if mg is not None else []
    return {
        "graphs": len(held),
        "captures": mg.captures if mg is not None else 0,
        "replays": sum(g.replays for g in held),
        "failed": len(mg.failed) if mg is not None else 0,
        "compiled": sum(g.fusion == "compiled" for g in held),
        "fused": sum(g.fusion == "modules" for g in held),
    }
