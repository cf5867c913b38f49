"""The engine's deliveries: a step's tokens read, stops checked, calls told; its figures.

Part of Engine (loop.py): runs on the engine thread after the next step is launched."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from . import policy as policies
from .request import Group, Request
from .rows import upload
from .schedule import StepRow
from .stats import METRICS


@dataclass
class Inflight:
    """A step launched: its rows, the kept ones (a draw each), its tokens on their way."""

    rows: list[StepRow]
    kept: list[StepRow]
    host: torch.Tensor  # the drawn tokens, on the host once `event` has passed
    event: Any
    began: Any = None  # an event recorded before the step's first kernel (CUDA)
    host_s: float = 0.0  # the host time choosing and launching it
    entry: list | None = None  # its line of EngineStats.timeline (GPU figures filled when read)


class Delivery:
    """Engine's delivery of a step's tokens (a mixin: the state lives in Engine.__init__)."""

    def _complete(self, f: Inflight) -> None:
        if self._suspects:  # a call that stepped alone and did not fail is cleared
            for g in {row.req.group for row in f.rows}:
                self._suspects.pop(g, None)
        start = time.perf_counter()
        if f.event is not None:
            f.event.synchronize()
        self.stats.wait_s += time.perf_counter() - start
        toks = f.host.tolist()
        now = time.monotonic()
        self._observe(f, now)
        touched, padded = set(), []
        self.stats.drawn += len(toks)
        with self.ending():  # (the rows that end give their KV to the prefix cache at once)
            for row, tok in zip(f.kept, toks):
                r = row.req
                if r.finished is not None:
                    continue  # a row that stopped a step ago: this token is dropped
                if r.stopped is not None:  # a lockstep row that stopped: pad, as stock does
                    r.out.append(r.pad_id)
                    padded.append(r)
                    if len(r.out) >= r.stop.max_new:
                        self._end(r, r.stopped)
                        touched.add(r.group)
                    continue
                r.out.append(tok)
                if r.first_token_at is None:
                    r.first_token_at = now
                stop = r.stop
                why = (
                    "eos" if tok in stop.eos
                    else "stop" if stop.strings and _stopped(r)
                    else "length" if len(r.out) >= stop.max_new
                    else None
                )  # fmt: skip
                if why is not None:
                    if r.lockstep and len(r.out) < r.stop.max_new and self._others_run(r):
                        r.stopped = why  # the call's other rows go on: this one steps with pad
                        padded.append(r)
                    else:
                        self._end(r, why)
                        if r.lockstep:
                            self._end_lockstep(r.group)
                    touched.add(r.group)
                elif r.group.streaming:
                    touched.add(r.group)
        for pad in {r.pad_id for r in padded if r.slot >= 0}:
            # their next input is the pad token (the step in flight already read their draw)
            slots = [r.slot for r in padded if r.pad_id == pad and r.slot >= 0]
            self.last.index_fill_(0, upload(slots, self.runner.device), pad)
        if isinstance(self.policy, policies.WFQ) and self.running:
            self.policy.reweigh([r.account for r in self.running])
        # a caller wakes for its tokens only when it streams them (its first at once, then at
        # most every scheduler.stream_interval_ms; lower_stream_interval_ms for a call below
        # the highest priority level live), or at its end
        gap = self._stream_gaps()
        held = self._held
        if held:  # streams whose interval has passed since their last wake, new tokens or not
            touched.update(g for g in held if now - g.told_at >= gap(g))
        for g in touched:
            if g.done:
                self._groups.discard(g)
                self._kept = [r for r in self._kept if r.group is not g]  # (the caller's now)
            elif g.told_at is not None and now - g.told_at < gap(g):
                held.add(g)
                continue
            held.discard(g)
            g.told_at = now
            g.notify()

    def _stream_gaps(self):
        """group -> seconds its caller's wakes for new tokens are apart at least."""
        interval = self.cfg.stream_interval_ms / 1000
        lower = self.cfg.lower_stream_interval_ms / 1000
        if lower <= interval:
            return lambda g: interval
        top = max((g.level for g in self._groups if not g.done), default=None)
        return lambda g: lower if top is not None and g.level < top else interval

    def _observe(self, f: Inflight, now: float) -> None:
        """The step's figures for the metrics: its period (since the step before was read),
        host time, GPU time and the GPU's idle gap since the step before (CUDA events); per
        class, first tokens and later ones."""
        period = now - self._last_done if self._last_done is not None else None
        self._last_done = now
        gpu = idle = None
        if f.began is not None:
            gpu = f.began.elapsed_time(f.event) / 1e3
            if self._prev_end is not None:
                idle = max(0.0, self._prev_end.elapsed_time(f.began) / 1e3)
            self._prev_end = f.event
            st = self.stats
            st.gpu_s += gpu
            st.gpu_idle_s += idle or 0.0
            if f.entry is not None:
                f.entry[6:8] = gpu, idle
        METRICS.engine_step(len(f.rows), sum(r.n for r in f.rows), period, f.host_s, gpu, idle)
        first, gaps = [], {}
        for row in f.kept:
            r = row.req
            if r.finished is not None or r.stopped is not None:
                continue
            label = r.task.priority_class
            if not r.out:
                first.append((label, now - r.arrived))
            else:
                gaps[label] = gaps.get(label, 0) + 1
        METRICS.engine_tokens(first, gaps, period)

    @staticmethod
    def _others_run(r: Request) -> bool:
        return any(x.finished is None and x.stopped is None for x in r.group.requests if x is not r)

    def _end_lockstep(self, group: Group) -> None:
        """A row of a lockstep call ended: the rows of it that stopped before end with it when
        no row of it still runs (rows that run end by their own tokens)."""
        if any(x.finished is None and x.stopped is None for x in group.requests):
            return
        for x in group.requests:
            if x.finished is None:
                self._end(x, x.stopped)


def _stopped(r: Request) -> bool:
    """Whether the row's text now ends in one of its stop strings (stock's rule). A check that
    raises (the call's tokenizer) fails that call alone: its error is its call's."""
    if r.stop.text_of is None:
        return False
    try:
        return bool(r.stop.text_of(r.seq()))
    except Exception as err:  # noqa: BLE001 - given to the row's call
        r.group.fail(err)
        return True
