"""One request's generate() call, and what it hands to the event loop.

A job is the request's side of its call: the call's new tokens come to it a step (or a few
steps) at a time, become text (text.py), and a streamed request's text goes to the event loop as
it comes (steps that come while the loop is busy join one chunk). Where the call runs is a
runner's business: `ThreadRunner` here (generate() on a worker thread of this process, the job
its streamer), or the engine process (engine_process.py, the tokens sent back to this one). A job
cancelled (its client left) ends its call at the engine's next step and its KV blocks come
back. Admission: at most ``max_queue`` requests wait for their first token; one more is refused
with 429 before anything runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ...engine.task import Cancelled
from .protocol import ApiError
from .text import ChoiceText

log = logging.getLogger("oxygen_torch.serve")


class ClientLeft(Exception):
    """Raised from put(): the client disconnected, the call ends at the engine's next step."""


class AllStopped(Exception):
    """Raised from put(): every row has ended at one of its stop strings (the engine's own stop
    string check ends a row only where the string ends on a token boundary)."""


class Admission:
    """Requests waiting for their first token, bounded; figures for /metrics."""

    def __init__(self, max_queue: int, retry_after_s: int = 1):
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.lock = threading.Lock()
        self.waiting = 0  # admitted, no token yet
        self.running = 0  # admitted, first token given, call not returned
        self.counts: Counter = Counter()  # finished requests by outcome

    def enter(self) -> None:
        with self.lock:
            if self.waiting >= self.max_queue:
                self.counts["rejected"] += 1
                raise ApiError(
                    429,
                    f"the server has {self.waiting} requests waiting for their first token, "
                    f"its limit (--max-queue {self.max_queue}); retry later",
                    code="queue_full", headers={"Retry-After": str(self.retry_after_s)},
                )  # fmt: skip
            self.waiting += 1

    def started(self) -> None:
        with self.lock:
            self.waiting -= 1
            self.running += 1

    def leave(self, started: bool, outcome: str) -> None:
        with self.lock:
            if started:
                self.running -= 1
            else:
                self.waiting -= 1
            self.counts[outcome] += 1


@dataclass
class Call:
    """What one request asks of generate(): rows (each prompt n times), left-padded."""

    prompts: list[list[int]]  # one per prompt
    n: int
    gen: dict  # generate() keyword arguments: max_new_tokens, sampling, stop strings
    priority: str = "normal"
    seed: int | None = None
    rows: list[ChoiceText] = field(default_factory=list)

    def inputs(self, pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention_mask) of every row: prompt i's n rows next to each other."""
        width = max(map(len, self.prompts))
        ids = torch.full((len(self.prompts) * self.n, width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(self.prompts):
            rows = slice(i * self.n, (i + 1) * self.n)
            ids[rows, width - len(p) :] = torch.tensor(p)
            mask[rows, width - len(p) :] = 1
        return ids.to(device), mask.to(device)

    def spec(self) -> tuple:
        """The call without its rows' text state, picklable (the engine process's tokenizer
        is added back for stop strings)."""
        gen = {k: v for k, v in self.gen.items() if k != "tokenizer"}
        return self.prompts, self.n, gen, self.priority, self.seed


def generate(model, call: Call, pad: int, streamer, cancel: threading.Event):
    """The call's generate() under its task tags (priority, seed, cancel event). Returns the new
    tokens as columns (one list a step, a token a row) when no streamer took them, else None."""
    import oxygen_torch

    ids, mask = call.inputs(pad, model.device)
    with (
        oxygen_torch.task(priority=call.priority, seed=call.seed, name="serve", cancel=cancel),
        torch.no_grad(),
    ):
        out = model.generate(ids, attention_mask=mask, streamer=streamer, **call.gen)
    return None if streamer is not None else out[:, ids.shape[1] :].t().tolist()


def run_call(model, call: Call, pad: int, streamer, cancel: threading.Event,
             took) -> tuple[str, BaseException | None]:  # fmt: skip
    """generate() of the call unless it was cancelled while it waited for a thread; `took`
    gets the new tokens' columns when no streamer did. Returns (outcome, error): "ok" (also
    when every row ended at a stop string), "cancelled" (the client left) or "error"."""
    if cancel.is_set():
        return "cancelled", None
    try:
        columns = generate(model, call, pad, streamer, cancel)
        if columns is not None:
            took(columns)
    except AllStopped:
        pass
    except (ClientLeft, Cancelled):
        return "cancelled", None
    except Exception as err:  # noqa: BLE001 - the request's error, told to its client
        return "error", err
    return "ok", None


def describe(err: BaseException) -> tuple[str, str, str]:
    """(kind, type name, message) of what generate() raised, as the client's answer needs it:
    kind "kv" (does not fit the KV pool), "value" (transformers refusing the settings), "oom",
    "gone" (the engine process exited) or "other" (the server failed)."""
    if isinstance(err, RemoteError):
        return err.kind, err.name, str(err)
    name = type(err).__name__
    # KV errors by name: the engine's and the pool's classes (kv/, engine/) are not this layer's
    if name in ("KVCacheFull", "KVBudgetError"):
        kind = "kv"
    elif isinstance(err, (ValueError, TypeError)):
        kind = "value"
    else:
        kind = "oom" if name == "OutOfMemoryError" else "other"
    return kind, name, str(err)


class RemoteError(Exception):
    """What generate() raised in the engine process, as described there (describe())."""

    def __init__(self, kind: str, name: str, message: str):
        super().__init__(message)
        self.kind, self.name = kind, name


class Poster:
    """Hands items from worker threads to one event loop: the items posted before the loop runs
    go in one wake-up of it (a step's tokens reach many streams at once: one write to the
    loop's self-pipe and one callback, not one of each per stream)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, object]] = []
        self.wakes = 0  # loop wake-ups asked for (tests, figures)

    def post(self, queue: asyncio.Queue, item) -> None:
        with self._lock:
            first = not self._items
            self._items.append((queue, item))
            self.wakes += first
        if first:
            try:
                self.loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop has closed (server shutting down): nobody listens
                with self._lock:
                    self._items.clear()

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue, item in items:  # (in the order posted: each queue's items keep theirs)
            queue.put_nowait(item)


_posters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> its Poster
_posters_lock = threading.Lock()


def poster_for(loop: asyncio.AbstractEventLoop) -> Poster:
    with _posters_lock:
        p = _posters.get(loop)
        if p is None:
            p = _posters[loop] = Poster(loop)
        return p


class Job:
    """One request's side of its call: its rows' text, and the bridge to the event loop. In this
    process it is its call's streamer (put / oxygen_put_ids on the worker thread); for the
    engine process, receive() takes the tokens the engine sent."""

    def __init__(self, call: Call, admission: Admission, loop: asyncio.AbstractEventLoop,
                 stream: bool):  # fmt: skip
        self.call, self.admission, self.loop, self.stream = call, admission, loop, stream
        self._poster = poster_for(loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        # a call nobody reads as it comes (not streamed, no stop string in the text) has no
        # streamer: the cancel event ends it (no wake-up of its thread a step); its tokens come
        # once it returns
        self.live = stream or any(r.incremental for r in call.rows)
        # text not yet taken by the event loop: steps that come while the loop is busy join one
        # chunk (one wake-up of the loop and one write per chunk, not per step and request)
        self._lock = threading.Lock()
        self._pending: list[str] | None = None
        self.prompt_seen = False
        self.first_token_at: float | None = None
        self.error: BaseException | None = None
        self.finished = False
        self.on_cancel = None  # the runner's: what else a cancel tells (the engine process)

    # --- the tokens (the worker thread, or the engine process's receiver) -----------------

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() puts the prompt first
            if self.cancelled.is_set():
                raise ClientLeft()
            self.prompt_seen = True
            return
        self.oxygen_put_ids([value.view(-1).tolist()])

    def oxygen_put_ids(self, columns: list[list[int]]) -> None:
        """The new tokens of the steps since the last wake: a column a step, a token a row
        (the engine's front door calls this, not put(), for the tokens after the prompt: no
        tensor made and read back, one decode a row and wake)."""
        if self.cancelled.is_set():
            raise ClientLeft()
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
            self.admission.started()
        rows = self.call.rows
        deltas = [row.add_many([c[i] for c in columns]) for i, row in enumerate(rows)]
        if self.stream and any(deltas):
            self._add_text(deltas)
        if all(r.finish for r in rows) and any(r.stopped for r in rows):
            raise AllStopped()

    def end(self) -> None:
        pass  # finish() flushes the rows once generate() has returned

    def receive(self, columns: list[list[int]]) -> bool:
        """Tokens the engine process sent; False once every row has ended at a stop string
        (the call is then over for the client: the engine's side is to be cancelled)."""
        if self.finished:
            return True  # (the engine's last steps of a call the front has ended)
        try:
            self.oxygen_put_ids(columns)
        except ClientLeft:
            pass  # its end comes from the engine
        except AllStopped:
            self.finish("ok")
            return False
        return True

    def finish(self, outcome: str, error: BaseException | None = None) -> None:
        """The call is over (outcome ok, cancelled or error): admission told, the rows' last
        text flushed, "done" or the error posted. Once: later ends are ignored."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
        self.error = error
        self.admission.leave(self.first_token_at is not None, outcome)
        if outcome == "ok":
            deltas = [row.end() for row in self.call.rows]
            if self.stream and any(deltas):
                self._add_text(deltas)
        self._post(("error", error) if error is not None else ("done", None))

    def run_here(self, model, pad: int) -> None:
        """generate() on this (worker) thread, the job its streamer; then finish()."""
        outcome, error = "cancelled", None
        try:
            outcome, error = run_call(model, self.call, pad, self if self.live else None,
                                      self.cancelled, self.oxygen_put_ids)  # fmt: skip
        finally:
            self.finish(outcome, error)

    def _add_text(self, deltas: list[str]) -> None:
        with self._lock:
            first = self._pending is None
            self._pending = deltas if first else [a + b for a, b in zip(self._pending, deltas)]
        if first:  # the loop takes all that has come by the time it looks
            self._post(("text", None))

    def _post(self, item) -> None:
        self._poster.post(self.queue, item)

    # --- the event loop ------------------------------------------------------------------

    def take_text(self) -> list[str]:
        """The text of each row since the last take (after a "text" item)."""
        with self._lock:
            out, self._pending = self._pending, None
        return out or []

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None and not self.finished:
            self.on_cancel(self)


class ThreadRunner:
    """Calls run in this process: generate() on a worker thread a request."""

    def __init__(self, model, pad: int, workers: int):
        self.model, self.pad = model, pad
        self.executor = ThreadPoolExecutor(workers, "serve")
        self.jobs: set[Job] = set()

    def start(self, job: Job) -> None:
        self.jobs.add(job)
        future = job.loop.run_in_executor(self.executor, job.run_here, self.model, self.pad)
        future.add_done_callback(lambda _: self.jobs.discard(job))

    def alive(self) -> str | None:
        return None  # (a reason when it cannot serve)

    def oxygen_metrics(self) -> str:
        from .. import metrics

        return metrics.scrape()

    def close(self) -> None:
        for job in list(self.jobs):
            job.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
