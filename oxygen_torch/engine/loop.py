"""The engine loop: one thread per model and KV pool owns the decode loop of every call.

Each step: choose the rows (schedule.py) -> build every row's inputs at once (one host-to-device
copy; a decoding row's input is its last draw, read on the device) -> the runner's forward
(decode steps replayed from CUDA graphs) -> processors and the draw for every row on the device
(sampling.py) -> one device-to-host copy of the new tokens. The host work of step n+1 (choosing,
building, launching) runs while the GPU computes step n: step n's tokens are read, stops checked
and tokens delivered only after step n+1 is launched. A row that stopped at step n (an EOS) has
one more token computed at n+1, which is dropped.

The engine knows nothing of transformers: it counts its rows' KV blocks itself (kv_rows.py), and
the runner (integrations/hf/engine_runner.py) makes a row's empty KV and runs a step's forward.
Callers meet the engine through Groups (request.py): `submit` queues a call's rows, the caller's
thread waits on its group.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..config import SchedulerConfig
from ..kv import engine_streams as streams
from ..kv.transfer import put_value
from . import door, gc_watch, switching
from . import policy as policies
from .deliver import Delivery, Inflight
from .kv_rows import RowKV
from .request import Group, Request
from .rows import Rows, upload
from .sampling import RowSample, Sampler
from .schedule import Budget, StepRow, choose
from .stats import METRICS
from .task import PRIORITIES, Cancelled
from .thread_clock import ThreadClock, spent

log = logging.getLogger("oxygen_torch")

IDLE_S = 0.5  # an idle engine thread looks again this often (a submit wakes it at once)
# an idle engine waits for a burst's callers at most this many times scheduler.burst_gather_ms
# (the gather goes on while they keep passing: _gather_burst)
BURST_CAP = 10
NORMAL = PRIORITIES["normal"]  # a call above this level ends a burst's gathering
STOP_AFTER_IDLE_S = 30.0  # an engine idle this long lets its thread end (a submit restarts it)


class Runner(Protocol):
    """What the engine asks of a model: rows' empty KV cores, their accounting, a forward."""

    device: torch.device
    vocab: int
    kv_rows: RowKV  # the rows' KV accounting (engine/kv_rows.py)

    def new_kv(self) -> Any: ...  # an empty PagedKVCore of one sequence
    # the logits [K, V] of the rows that keep one, in order; ids [T] int64 on the device, every
    # row's tokens one after another, their positions `pos`
    def forward(self, rows: list[StepRow], ids: torch.Tensor, pos: list[int]) -> torch.Tensor: ...


@dataclass
class EngineStats:
    steps: int = 0
    tokens: int = 0  # tokens computed (prefill and decode)
    drawn: int = 0  # tokens drawn (delivered or dropped)
    preemptions: int = 0
    swaps: int = 0  # preemptions that moved the KV to the CPU tier (no recompute)
    forwards: int = 0  # forwards run (one a step)
    host_s: float = 0.0  # host time spent choosing, building and launching steps
    gpu_s: float = 0.0  # GPU time of the steps (CUDA events)
    gpu_idle_s: float = 0.0  # the GPU's gaps between back-to-back steps (CUDA events)
    choose_s: float = 0.0  # of which choosing the rows
    complete_s: float = 0.0  # host time reading steps' tokens, stops, delivery (waits included)
    wait_s: float = 0.0  # host time spent waiting for a step's tokens
    # callers' time from their generate() call to their submission (the front door: resolving
    # the call's settings in the caller's thread, device syncs of its inputs included)
    door_s: float = 0.0
    doors: int = 0
    door_max_s: float = 0.0
    burst_waits: int = 0  # an idle engine waited for callers at the door (burst_gather_ms)
    burst_wait_s: float = 0.0  # how long, in all
    burst_wait_max_s: float = 0.0  # the longest one
    rows: deque = field(default_factory=lambda: deque(maxlen=1024))  # rows a step, the last
    # the last steps' [start, rows, tokens, choose s, launch s, complete s (of the step
    # before), GPU s, the GPU's idle s before it, the engine thread's CPU s in the launch]
    # (GPU s and idle s once the step is read, on a GPU; else None): where time goes, the
    # host's launch told apart from the GPU's own time, and a launch that waited (for the
    # interpreter lock, other threads' Python, a device sync) from one that worked (its CPU s);
    # then the interpreter's collection pauses (any thread's) from the step's start to the
    # previous step's completion, s (engine/gc_watch.py); then the engine thread's CPU s in
    # the choosing (its inbox, the door, the choice: a choosing far longer than its CPU waited,
    # for the interpreter lock or a lock), and of the choosing's wall the wait at the door for a
    # caller's front-door Python inside it, s; then of the launch: the engine thread's wait in
    # the OS run queue s (None where unknown), its blocks (voluntary context switches: waits
    # for the interpreter lock, a lock, a sync) and preemptions (engine/thread_clock.py)
    timeline: deque = field(default_factory=lambda: deque(maxlen=4096))


class _PinnedPair:
    """Two pinned int64 host buffers used in turn, grown as needed: a step's copy to or from
    one is done before the step after next is launched (the step between is waited for)."""

    def __init__(self):
        self._bufs: list = [None, None]
        self._turn = 0

    def take(self, n: int):
        """(the next buffer's first n entries, the whole buffer as an array)."""
        self._turn ^= 1
        held = self._bufs[self._turn]
        if held is None or held[0].shape[0] < n:
            buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
            held = self._bufs[self._turn] = (buf, buf.numpy())
        return held[0][:n], held[1]

    def drop(self) -> None:
        """Both let go (a copy from one may still be queued: fresh ones from now on)."""
        self._bufs = [None, None]


class Engine(Rows, Delivery):
    """The loop of one model and KV pool (see the module docstring)."""

    def __init__(
        self, runner: Runner, cfg: SchedulerConfig, name: str = "engine", step_tokens: int = 0
    ):
        self.runner, self.cfg, self.name = runner, cfg, name
        self.kvs = runner.kv_rows
        # tokens a step computes at most (prefill chunks beside the decodes)
        self.step_tokens = min(step_tokens or cfg.max_step_tokens, cfg.max_step_tokens)
        self.policy = policies.make(cfg.policy, cfg.alpha, cfg.beta)
        self.sampler = Sampler(runner.vocab, runner.device, cfg.sampling_kernel)
        self.stats = EngineStats()
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self._cond = threading.Condition()
        self._inbox: list[Group] = []
        self._groups: set[Group] = set()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._free_slots: list[int] = []
        self._slots = 0
        self.last = torch.zeros(0, dtype=torch.int64, device=runner.device)
        self.pid = os.getpid()
        self._host_bufs = _PinnedPair()  # a step's drawn tokens on their way down
        self._slot_bufs = _PinnedPair()  # a decode step's slots on their way up (a GPU's)
        self._kept: list[Request] = []  # ended rows holding KV for their unfinished call
        # rows that ended while a step's tokens are delivered: their KV goes to the prefix cache
        # in one insert after the step's rows are read (Rows.ending), not one a row
        self._ending: list[tuple[Request, str]] | None = None
        self._suspects: dict[Group, Exception] = {}  # calls of a failed step, to run alone
        self._held: set[Group] = set()  # streams with tokens not yet told (stream_interval_ms)
        self._last_done: float | None = None  # when the last step's tokens were read
        self._prev_end = None  # the last step's end event (CUDA): the GPU's gap to the next
        gc_watch.install()
        METRICS.attach_engine(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def snapshot(self) -> dict:
        """The engine's figures (engine_stats())."""
        st = self.stats
        rows = st.rows or [0]
        return {
            "engines": 1, "steps": st.steps, "forwards": st.forwards, "tokens": st.tokens,
            "drawn": st.drawn, "preemptions": st.preemptions, "swaps": st.swaps,
            "host_s": st.host_s,
            "wait_s": st.wait_s, "choose_s": st.choose_s, "complete_s": st.complete_s,
            "gpu_s": st.gpu_s, "gpu_idle_s": st.gpu_idle_s,
            "door_s": st.door_s, "doors": st.doors, "door_max_s": st.door_max_s,
            "burst_waits": st.burst_waits,
            "burst_wait_s": st.burst_wait_s, "burst_wait_max_s": st.burst_wait_max_s,
            "running": len(self.running), "waiting": len(self.waiting),
            "rows_per_step": sum(rows) / len(rows),
        }  # fmt: skip

    # --- the caller's side ----------------------------------------------------------------

    def submit(self, group: Group) -> None:
        """Queues a call's rows; the engine thread starts if it is not running."""
        with self._cond:
            if self._closed:
                raise RuntimeError("oxygen_torch: the engine was closed (oxygen_torch.disable())")
            self._inbox.append(group)
            if group.entered is not None:
                st, took = self.stats, time.perf_counter() - group.entered
                st.door_s, st.doors = st.door_s + took, st.doors + 1
                st.door_max_s = max(st.door_max_s, took)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._main, name=f"oxygen-{self.name}", daemon=True
                )
                self._thread.start()
            self._cond.notify_all()

    def cancel(self, group: Group) -> None:
        """The call left (interrupted, or it raised): its rows end at the next step and their
        blocks come back."""
        group.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def close(self, err: BaseException | None = None) -> None:
        """Ends the thread after the step in flight; calls still waiting get `err` (default: a
        RuntimeError saying oxygen was disabled under them) and their rows' blocks come back."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=60)
        self._fail_all(err or RuntimeError(
            "oxygen_torch: oxygen_torch.disable() ran while this generate() call waited for the "
            "engine; it did not finish"
        ))  # fmt: skip

    def stop(self) -> None:
        """Asks the thread to end after the step in flight, without waiting (its model is gone:
        no call can be waiting, since a caller holds its model)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def live(self) -> int:
        with self._cond:
            return len(self._groups) + len(self._inbox)

    # --- the thread ---------------------------------------------------------------------------

    def _main(self) -> None:
        device, stream = self.runner.device, None
        switching.hold(self.cfg.switch_interval_ms)  # (engine/switching.py)
        self._clock = ThreadClock()  # (this thread's own: its launches' waits told apart)
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                if self.cfg.engine_stream:  # (kv/engine_streams.py)
                    stream = streams.start(device)
            with torch.no_grad(), torch.cuda.stream(stream) if stream else nullcontext():
                self._loop()
        except BaseException as err:  # noqa: BLE001 - every waiting call gets it
            log.exception("oxygen_torch: the engine thread failed")
            self._fail_all(err)
        finally:
            switching.release()
            self._clock.close()
            if stream is not None:
                streams.stop(device, stream)

    def _loop(self) -> None:
        inflight: Inflight | None = None
        idle_since = time.monotonic()
        clock = self._clock
        while True:
            if inflight is None and not self.running and not self.waiting:
                self._gather_burst()
            start, paused = time.perf_counter(), gc_watch.pause_s
            picked = time.thread_time()
            with self._cond:
                if self._closed:
                    break
                self._take_inbox()
            at_door = time.perf_counter()
            with door.launch(self.runner.device):  # callers' front-door Python waits
                opened = time.perf_counter()
                self._drop_cancelled()
                rows = choose(self, Budget(self.step_tokens, self.cfg.max_step_seqs,
                                           *self.kvs.step_blocks()))  # fmt: skip
                chosen, at = time.perf_counter(), clock.read()
                picked = at[0] - picked
                try:
                    launched = self._launch(rows) if rows else None
                except Exception as err:  # noqa: BLE001 - given to the call(s) it belongs to
                    launched = None
                    self._slot_bufs.drop()  # (a copy from one may still be queued)
                    self._step_failed(rows, err)
                done = time.perf_counter()
                cpu, runq, blocks, preempted = spent(at, clock.read())
            st = self.stats
            st.host_s += done - start
            st.choose_s += chosen - start
            if inflight is not None:
                self._complete(inflight)
                st.complete_s += time.perf_counter() - done
            if launched is not None:
                launched.host_s = done - start
                tokens = sum(r.n for r in rows)
                took = time.perf_counter() - done
                launched.entry = [start, len(rows), tokens, chosen - start, done - chosen, took,
                                  None, None, cpu, gc_watch.pause_s - paused, picked,
                                  opened - at_door, runq, blocks, preempted]  # fmt: skip
                st.timeline.append(launched.entry)
            inflight = launched
            if launched is not None:
                idle_since = time.monotonic()
                continue
            self._last_done = self._prev_end = None  # a pause: no step period, no GPU gap
            with self._cond:
                if self._inbox or self._closed:
                    continue
                if not self.running and not self.waiting:
                    if time.monotonic() - idle_since > STOP_AFTER_IDLE_S:
                        self._thread = None
                        return
                self._cond.wait(IDLE_S if not (self.running or self.waiting) else 0.005)

    def _gather_burst(self) -> None:
        """An idle engine with calls on their way in (door.coming: from their generate()'s start
        to their rows' submission) waits while they keep coming (asleep: the interpreter lock is
        theirs): until none has passed for scheduler.burst_gather_ms, all have come, the calls
        in hand fill a step, or BURST_CAP times burst_gather_ms have gone by. Otherwise the first
        caller of a burst gets a step of its own and the others' Python runs beside its launch,
        which then takes several times its own time (on the H200 at 256 calls: 6 rows, ~250 ms
        of wall for ~65 ms of CPU; at 64 calls a fixed 20 ms wait ended with 5 calls in, their
        step took 86 ms, and the other 59 prefilled in the next). A call in hand of a priority
        above normal ends the wait: a burst's gathering is throughput, its first token latency."""
        gap = self.cfg.burst_gather_ms / 1000
        device = self.runner.device
        if gap <= 0 or not door.coming(device):
            return
        start = time.monotonic()
        deadline, cap = start + gap, start + BURST_CAP * gap
        seen, tokens, coming = 0, 0, door.coming(device)
        while coming and time.monotonic() < deadline:
            with self._cond:
                if self._closed:
                    return
                new = self._inbox[seen:]
            tokens += sum(len(r.prompt) for g in new for r in g.requests)
            if tokens >= self.step_tokens:
                return
            if any(g.level > NORMAL for g in new):
                break  # a call above the normal priority: its first token waits for no burst
            time.sleep(0.0005)
            if new:  # a caller of this engine passed: wait for the next (door.coming counts
                # every engine's callers: another model's burst keeps this one no longer)
                deadline = min(cap, max(deadline, time.monotonic() + gap))
            seen, coming = seen + len(new), door.coming(device)
        took, st = time.monotonic() - start, self.stats
        st.burst_waits += 1
        st.burst_wait_s += took
        st.burst_wait_max_s = max(st.burst_wait_max_s, took)

    def _step_failed(self, rows: list[StepRow], err: Exception) -> None:
        """A step raised before it was launched (its KV reservations undone): a step of one
        call's rows gives that call the error; a step of several calls' rows runs them again
        one call a step (`allowed`), so the error reaches only a call that fails alone."""
        groups = list(dict.fromkeys(row.req.group for row in rows))
        if len(groups) == 1:
            (g,) = groups
            log.debug("oxygen_torch: a generate() call's step failed: %r", err)
            for r in g.requests:
                if r.finished is None:
                    self._end(r, "error")
            g.fail(err)
            self._groups.discard(g)
            self._suspects.pop(g, None)
            return
        for g in groups:
            self._suspects.setdefault(g, err)

    def allowed(self, r: Request) -> bool:
        """Whether a row may join the next step: after a step of several calls failed, its
        calls step one at a time until each has stepped alone (schedule.choose)."""
        if not self._suspects:
            return True
        return r.group is next(iter(self._suspects))

    def _take_inbox(self) -> None:
        for g in self._inbox:
            self._groups.add(g)
            for r in g.requests:
                r.account = policies.Account(r.task, arrived=r.arrived)
                self.policy.join(r.account, [x.account for x in self.running])
                self.waiting.append(r)
        self._inbox.clear()

    def _drop_cancelled(self) -> None:
        for g in self._groups:
            if g.cancel is not None and g.error is None and g.cancel.is_set():
                g.fail(Cancelled("oxygen_torch: this generate() was cancelled (its task's "
                                 "cancel event was set)"))  # fmt: skip
        for g in [g for g in self._groups if g.cancelled or g.error is not None]:
            for r in g.requests:
                if r.finished is None:
                    self._end(r, "cancelled")
            self._groups.discard(g)
            self._suspects.pop(g, None)

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            groups = list(self._groups) + self._inbox
            self._inbox.clear()
            self._thread = None
        for r in list(self.running) + list(self.waiting):
            self._end(r, "error")
        for g in groups:
            g.fail(err)
        self._groups.clear()
        self._held.clear()

    # --- one step -------------------------------------------------------------------------------

    def _inputs(self, rows: list[StepRow]) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """The step's ids [T] on the device (a decode row's: its last draw, gathered there),
        positions, every row's tokens one after the other, and for a step of decodes only its
        rows' slots on the device (every row keeps its draw: the draws go back there)."""
        device = self.runner.device
        if all(row.ids is None for row in rows):  # decode only: one gather
            slots = self._slots_up([row.req.slot for row in rows], device)
            return self.last.index_select(0, slots), [row.start for row in rows], slots
        ids_host, pos, dec_at, dec_slots = [], [], [], []
        for row in rows:
            if row.ids is None:
                dec_at.append(len(ids_host))
                dec_slots.append(row.req.slot)
                ids_host.append(0)
            else:
                ids_host.extend(row.ids)
            pos.extend(range(row.start, row.start + row.n))
        ids = upload(ids_host + dec_at + dec_slots, device)
        t, d = len(ids_host), len(dec_at)
        flat = ids[:t]
        if d:
            flat = flat.index_copy(0, ids[t : t + d], self.last.index_select(0, ids[t + d :]))
        return flat, pos, None

    def _draw(self, logits: torch.Tensor, kept: list[StepRow]):
        """(tokens [K], processed scores or None) for the kept rows: a plain argmax when every
        row is greedy with nothing to process, else the sampler."""
        reqs = [row.req for row in kept]
        if all(r.plain or (r.plain is None and r.sampled >= r.stop.min_new) for r in reqs):
            return logits.argmax(-1), None
        if all(r.plain is not False and not r.keep_logits for r in reqs):
            # greedy rows with EOS suppressed until their min_new tokens, no scores or raw
            # logits kept: the ids masked in the logits themselves (a graph's output buffer,
            # rewritten by the next replay), not in a float32 copy of [K, V] (at 256 rows and
            # a 128k vocabulary, 128 MiB written and read a step)
            pairs = [(i, t) for i, r in enumerate(reqs) if r.sampled < r.stop.min_new
                     for t in self._suppressed(r)]  # fmt: skip
            if pairs:
                at = upload([i for i, _ in pairs] + [t for _, t in pairs], logits.device)
                put_value(logits, (at[: len(pairs)], at[len(pairs) :]), float("-inf"))
            return logits.argmax(-1), None
        samples = [RowSample(r.params, r.sampled, r.slot, self._suppressed(r)) for r in reqs]
        return self.sampler(logits, samples, any(r.keep_scores for r in reqs))

    def _launch(self, rows: list[StepRow]) -> Inflight:
        device = self.runner.device
        began = None
        if device.type == "cuda":
            streams.after_callers(device)  # (an engine stream of its own: blocks callers freed)
            began = torch.cuda.Event(enable_timing=True)
            began.record()
        flat, pos, slots = self._inputs(rows)
        logits = self.runner.forward(rows, flat, pos)
        kept = [row for row in rows if row.keep]
        tokens, scores = self._draw(logits, kept)
        if slots is None or len(kept) != len(rows):
            slots = upload([row.req.slot for row in kept], device)
        self.last.index_copy_(0, slots, tokens)
        pen = [i for i, row in enumerate(kept) if row.req.params.penalised]
        if pen:
            at = upload(pen, device)
            self.sampler.note(slots.index_select(0, at), tokens.index_select(0, at))
        for i, row in enumerate(kept):
            req = row.req
            if req.keep_scores:
                req.scores.append(scores[i].clone())
            if req.keep_logits:
                req.logits.append(logits[i].float().clone())
            req.sampled += 1
        charge = self.policy.charge
        for row in rows:
            row.req.computed += row.n
            charge(row.req.account, row.n)
        host, event = tokens, None
        if device.type == "cuda":
            host = self._host_bufs.take(tokens.shape[0])[0]
            host.copy_(tokens, non_blocking=True)
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        st = self.stats
        st.steps += 1
        st.forwards += 1
        st.tokens += sum(row.n for row in rows)
        st.rows.append(len(rows))
        return Inflight(rows, kept, host, event, began)

    def _slots_up(self, values: list[int], device: torch.device) -> torch.Tensor:
        """A decode step's slots on the device: on a GPU through _slot_bufs (written as an
        array: one torch call, the copy, where upload() makes and pins a host tensor first; a
        failed launch drops both buffers)."""
        if device.type != "cuda":
            return upload(values, device)
        buf, arr = self._slot_bufs.take(len(values))
        arr[: len(values)] = values
        return buf.to(device, non_blocking=True)

    @staticmethod
    def _suppressed(r: Request) -> tuple[int, ...]:
        """EOS ids are not drawn before the row's min_new tokens."""
        return r.stop.eos if r.sampled < r.stop.min_new else ()
