"""generate()'s decode steps on the paged cache, replayed from CUDA graphs.

Eager decode is bound by the host: a 16-layer model launches a few hundred kernels a step, and
each launch costs the host more than the GPU spends on it. During generate() on a PagedKVCache
(CUDA, `kv.decode_graphs`, on by default) the model's forward for a one-token step is captured
once and replayed:

- The host plans the step before the forward (blocks reserved, slots and lengths computed:
  `PagedKVCore.begin_graph_step`), then copies the block table, lengths and slots into the
  graph's buffers in one pinned host-to-device copy, and input_ids / position_ids /
  cache_position into the graph's inputs. The graph reads only those buffers, the weights and
  the pool's K/V, so one graph serves every cache of the same pool and batch size.
- The block table has a fixed width per graph: enough blocks for generate()'s max_length,
  rounded up to WIDTH_STEP blocks, so a whole generate() call replays one graph.
- The first step of a new graph runs the forward eagerly on the graph's buffers (warm-up: Triton
  compiles for that width) and then captures it; a decode step is idempotent (the same K/V to
  the same slots), so capturing does not disturb the cache. Later steps replay.
- The attention mask is not an input: oxygen's decode never reads it (padding was never stored).

Graphs are kept per model (at most MAX_GRAPHS_PER_MODEL, least recently used dropped) and are
dropped when a parameter or buffer of the model moves, when the pool goes, and on disable().
A step the graph cannot take (output_attentions, an input it does not know, grad mode) runs
eagerly, with one warning naming why when the reason is the caller's choice.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import OrderedDict

import numpy as np
import torch

from ... import context
from . import fuse as hf_fuse
from .cache import PagedKVCache, _cfg_value, tracing_step

WIDTH_STEP = 16  # graph table widths are multiples of this many blocks
MAX_GRAPHS_PER_MODEL = 4
# forward() arguments a decode graph knows: everything else makes the step eager
_STATIC_INPUTS = ("input_ids", "position_ids", "cache_position")
_KNOWN = frozenset(
    (*_STATIC_INPUTS, "past_key_values", "attention_mask", "use_cache", "return_dict")
    + ("logits_to_keep", "output_attentions", "output_hidden_states")
)
CPU_RERUN = False  # tests: run the bookkeeping on CPU, "replay" re-running the forward
CPU_FUSE = False  # tests: with CPU_RERUN, fuse on CPU too (the compiled forward's trace)

_lock = threading.RLock()
_graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> _ModelGraphs


def _warn_once(msg: str) -> None:
    from .integration import (
        _warn_once,  # the integration's one warn-once set (hf imports this module)
    )

    _warn_once(msg)


class _Rerun:
    """Stands in for a CUDA graph on CPU (tests): replay runs the captured function again."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


class _CaptureFailed(Exception):
    """Capture failed after the warm-up forward had done the step; carries its output."""

    def __init__(self, output):
        super().__init__("decode graph capture failed")
        self.output = output


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
        pinned = device.type == "cuda"
        # two staging buffers: one may still be in flight while the other is filled; written
        # through numpy views (a numpy store costs a fraction of a torch op's host time)
        self._staging = []
        for _ in range(2):
            host = torch.empty(self._size, dtype=torch.int32, pin_memory=pinned)
            self._staging.append((host, host.numpy(), _event(device)))
        self._turn = 0
        self.graph = None
        self.replays = 0
        self.fusion = None  # "compiled" (whole forward) or "modules" (hf_fuse) or None
        self.output = None  # (output type, logits living in the graph's memory)
        self._call = None
        self.lock = threading.Lock()

    def stage(self, core, kw: dict) -> None:
        """Plans the step on the host and queues the copies into the graph's buffers."""
        position = core.length  # what the model would take from get_seq_length()
        table, ints = core.begin_graph_step(self.width)
        buf, view, done = self._staging[self._turn]
        self._turn ^= 1
        if done is not None:
            done.synchronize()  # its copy two steps ago has finished: safe to refill
        n, b = self.batch * self.width, self.batch
        view[:n].reshape(b, self.width)[:] = table.numpy()
        view[n : n + 2 * b] = ints
        view[n + 2 * b :].view(np.int64)[0] = position
        self.buf.copy_(buf, non_blocking=True)
        if done is not None:
            done.record()
        for name, static in self.inputs.items():
            static.copy_(kw[name])
        core.lend(self.table, self.seq_lens, self.slots)

    def run(self, model, forward, core, kw: dict, fuse: bool = False):
        """One decode step: plan, then replay (or warm up and capture on first use, with the
        model's elementwise work compiled when `fuse`)."""
        with self.lock:
            self.stage(core, kw)
            # position_ids always given: the model would compute them from the cache length,
            # a host int that a graph would freeze at its capture step
            call = {**kw, "position_ids": self.position, **self.inputs, "attention_mask": None}
            self._call = call  # the CPU stand-in re-runs the forward with this step's cache
            try:
                if self.graph is None:
                    return self._first(model, forward, core, call, fuse)
                self.graph.replay()
            finally:
                self._call = None  # it holds this step's cache
                context.forget(core)  # the replay runs no op; a failed step must not keep it
            core.end_graph_step()
            self.replays += 1
            out_type, logits = self.output
            return out_type(logits=logits.clone(), past_key_values=kw["past_key_values"])

    def _first(self, model, forward, core, call: dict, fuse: bool):
        """Warm-up and capture: compiled whole by backend "oxygen" when `fuse`, else (or when
        that compile fails) with the fusible modules compiled, else unfused; each failure
        warns once. The step is idempotent, so a failed try leaves nothing to undo."""
        tries = [("compiled", hf_fuse.compiled), ("modules", hf_fuse.fused)] if fuse else []
        if fuse and not _cfg_flag("decode_graph_compile"):
            tries = tries[1:]
        for how, fusion in tries:
            try:
                options = call["past_key_values"].compile_options
                with fusion(model, forward, core, options) as fn:
                    out = self._warm_and_capture(fn, core, call)
                self.fusion = how
                return out
            except _CaptureFailed:
                raise
            except Exception as err:
                _warn_once(f"oxygen_torch: decode-graph fusion ({how}) failed: {err!r}")
                core.lend(self.table, self.seq_lens, self.slots)
        return self._warm_and_capture(forward, core, call)

    def _warm_and_capture(self, forward, core, call: dict):
        out = forward(**call)  # warm-up, and the real step
        core.lend(self.table, self.seq_lens, self.slots)
        try:
            self._capture(forward, call)
        except Exception as err:
            raise _CaptureFailed(out) from err
        finally:
            core.end_graph_step()
        return out

    def _capture(self, forward, call: dict) -> None:
        if self.device.type != "cuda":

            def rerun():
                with tracing_step():  # the compiled forward's guards expect it
                    out = forward(**self._call)
                if self.output is not None:
                    self.output[1].copy_(out.logits)
                return out

            out, self.graph = rerun(), _Rerun(rerun)
        else:
            graph = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            # thread_local: the pool's refill thread may call CUDA meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = forward(**call)
            self.graph = graph
        # the logits only: the output object also holds the cache, which must not outlive it
        self.output = (type(out), out.logits)


def _event(device: torch.device):
    return torch.cuda.Event() if device.type == "cuda" else None


class _ModelGraphs:
    def __init__(self):
        self.graphs: OrderedDict[tuple, DecodeGraph] = OrderedDict()
        self.failed: set[tuple] = set()
        self.fingerprint: tuple = ()
        self.captures = 0


def _fingerprint(model) -> tuple:
    return tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))


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


def _decode_step(model, forward, kw: dict):
    """The model's forward for this call: a graph replay, or None to run it eagerly."""
    cache, ids = kw.get("past_key_values"), kw.get("input_ids")
    if (
        not isinstance(cache, PagedKVCache)
        or not isinstance(ids, torch.Tensor)
        or ids.dim() != 2
        or ids.shape[1] != 1
        or not cache._deferred()
    ):
        return None
    core = cache._core
    if core.seqs is None or core.debug or ids.shape[0] != len(core.seqs):
        return None
    reason = _eager_reason(kw)
    if reason is not None:
        _warn_once(f"oxygen_torch: decode steps run without CUDA graphs: {reason}")
        return None
    width = graph_width(cache)
    ltk = kw.get("logits_to_keep")
    present = tuple(n for n in _STATIC_INPUTS if isinstance(kw.get(n), torch.Tensor))
    key = (ids.shape[0], width, present, ltk if not isinstance(ltk, torch.Tensor) else None)
    key += (id(core.pool), tuple((kw[n].dtype, tuple(kw[n].shape)) for n in present))
    if cache.compile_options is not None:  # a compile_config's options: a graph of their own
        key += (repr(sorted(cache.compile_options.as_dict().items())),)
    with _lock:
        mg = _graphs.get(model)
        if mg is None or key in mg.failed or isinstance(ltk, torch.Tensor):
            return None
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
    try:
        fresh = g.graph is None  # the fusion setting matters only to a capture
        on = ids.device.type == "cuda" or CPU_FUSE
        fuse = fresh and on and _cfg_flag("decode_graph_fusion")
        out = g.run(model, forward, core, kw, fuse=fuse)
        mg.captures += fresh
        return out
    except _CaptureFailed as failed:  # this signature stays eager; the step itself was done
        with _lock:
            mg.failed.add(key)
            mg.graphs.pop(key, None)
        _warn_once(
            "oxygen_torch: decode CUDA-graph capture failed, these steps run eagerly: "
            f"{failed.__cause__!r}"
        )
        return failed.output


def _cfg_flag(name: str) -> bool:
    from . import integration as hf

    return bool(_cfg_value(hf.active_cfg(), "kv", name, True))


def _usable(model) -> bool:
    from . import integration as hf

    if not _cfg_flag("decode_graphs") or not hf._uses_oxygen(model):
        return False
    return model.device.type == "cuda" or (CPU_RERUN and model.device.type == "cpu")


_USER_COMPILED = (
    "oxygen_torch: the model's forward is compiled by torch.compile; on the paged cache "
    "generate() runs it uncompiled, and captures the decode steps compiled by backend "
    '"oxygen" in CUDA graphs where it can (kv.decode_graphs). Pass a StaticCache to run your '
    "compiled forward as it is."
)
_set_aside = threading.local()  # .models: [(model, its _compiled_call_impl)] of this thread


def paged_call(model) -> None:
    """generate() has built a PagedKVCache for this call: a `model.compile()` is set aside until
    the call ends (decode_graphs' exit). A PagedKVCache is not traced outside a decode-graph
    step: its host bookkeeping would break the graph at every layer and recompile every step."""
    impl = model.__dict__.get("_compiled_call_impl")
    if impl is not None:
        _warn_once(_USER_COMPILED)
        model._compiled_call_impl = None
        _set_aside.__dict__.setdefault("models", []).append((model, impl))


def _restore_compiled(model) -> None:
    kept = []
    for m, impl in getattr(_set_aside, "models", []):
        if m is model:
            m._compiled_call_impl = impl
        else:
            kept.append((m, impl))
    _set_aside.models = kept


@contextlib.contextmanager
def decode_graphs(model):
    """For one generate() call: one-token steps on a PagedKVCache go through decode graphs, and
    a forward the user compiled runs uncompiled on the paged cache (see paged_call)."""
    from . import integration as hf

    if not hf._uses_oxygen(model):
        yield
        return
    try:
        with _graphed(model):
            yield
    finally:
        _restore_compiled(model)


@contextlib.contextmanager
def _graphed(model):
    own = model.__dict__.get("forward")
    user_compiled = getattr(own, "_torchdynamo_orig_callable", None)
    usable = _usable(model)
    if not usable and user_compiled is None:  # nothing to capture and nothing to set aside
        yield
        return
    if own is not None and user_compiled is None:
        # ours (a generate() inside generate()) or someone else's wrapper
        if getattr(own, "__name__", "") != "graphed_forward":
            _warn_once(
                "oxygen_torch: decode steps run without CUDA graphs: the model's forward is "
                f"replaced on the instance ({own!r}: accelerate hooks or a wrapper)"
            )
        yield
        return
    if usable:
        with _lock:
            mg = _graphs.setdefault(model, _ModelGraphs())
            fp = _fingerprint(model)
            if fp != mg.fingerprint:  # weights or buffers moved: the graphs read stale addresses
                mg.graphs.clear()
                mg.failed.clear()
                mg.fingerprint = fp
    forward = user_compiled if user_compiled is not None else model.forward

    def graphed_forward(*args, **kw):
        paged = isinstance(kw.get("past_key_values"), PagedKVCache)
        if own is not None:
            if not paged:
                return own(*args, **kw)  # the user's compiled forward, on another cache
            _warn_once(_USER_COMPILED)
        out = None if args or not usable else _decode_step(model, forward, kw)
        return forward(*args, **kw) if out is None else out

    model.forward = graphed_forward
    try:
        yield
    finally:
        if model.__dict__.get("forward") is graphed_forward:
            if own is not None:
                model.forward = own
            else:
                del model.forward


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
