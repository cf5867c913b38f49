"""One request's generate() call on a worker thread, and what it hands to the event loop.

The job is the call's streamer: generate() puts the prompt first, then one tensor of new tokens
a step (one per row), on the worker thread. There the tokens become text (text.py); a streamed
request's text goes to the event loop as it comes (steps that come while the loop is busy
join one chunk). A job cancelled (its client left)
raises from its next put(): the engine ends the call at its next step and its KV blocks come
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
    """The streamer of one call, and the bridge from its worker thread to the event loop."""

    def __init__(self, call: Call, admission: Admission, loop: asyncio.AbstractEventLoop,
                 stream: bool):  # fmt: skip
        self.call, self.admission, self.loop, self.stream = call, admission, loop, stream
        self._poster = poster_for(loop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        # text not yet taken by the event loop: steps that come while the loop is busy join one
        # chunk (one wake-up of the loop and one write per chunk, not per step and request)
        self._lock = threading.Lock()
        self._pending: list[str] | None = None
        self.prompt_seen = False
        self.first_token_at: float | None = None
        self.error: BaseException | None = None

    # --- the worker thread ---------------------------------------------------------------

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
        pass  # run() flushes the rows once generate() has returned

    def run(self, model, pad: int) -> None:
        """The worker: generate() under the request's task tags; posts "done" or an error."""
        outcome = "cancelled"
        try:
            if self.cancelled.is_set():  # the client left while the job waited for a thread
                return
            import oxygen_torch

            ids, mask = self.call.inputs(pad, model.device)
            # a call nobody reads as it comes (not streamed, no stop string in the text) has no
            # streamer: the task's cancel event ends it (no wake-up of this thread a step); its
            # tokens go through put() once it returns
            live = self.stream or any(r.incremental for r in self.call.rows)
            with (
                oxygen_torch.task(
                    priority=self.call.priority,
                    seed=self.call.seed,
                    name="serve",
                    cancel=self.cancelled,
                ),
                torch.no_grad(),
            ):
                out = model.generate(ids, attention_mask=mask, streamer=self if live else None,
                                     **self.call.gen)  # fmt: skip
            if not live:
                self.put(ids)
                for column in out[:, ids.shape[1] :].t():
                    self.put(column)
            outcome = "ok"
        except AllStopped:
            outcome = "ok"
        except (ClientLeft, Cancelled):
            pass
        except Exception as err:  # noqa: BLE001 - the request's error, told to its client
            self.error, outcome = err, "error"
        finally:
            self.admission.leave(self.first_token_at is not None, outcome)
            if outcome == "ok":
                deltas = [row.end() for row in self.call.rows]
                if self.stream and any(deltas):
                    self._add_text(deltas)
            self._post(("error", self.error) if self.error is not None else ("done", None))

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
