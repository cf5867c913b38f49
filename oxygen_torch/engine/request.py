"""What crosses the engine's front seam: a Request per row, a Group per generate() call.

A Request is plain data: its prompt ids (real tokens only: padding is never computed), its
sampling settings, its stop rule, its task tags. The engine thread writes its tokens and
state; the caller's thread reads them through its Group, which it waits on. A call with B rows
(or num_return_sequences) is B requests in one group; the group is done when every row is.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .policy import Account
from .sampling import SamplingParams
from .task import Task


@dataclass(frozen=True)
class StopRule:
    """When a row stops: an EOS id (not before `min_new` tokens: EOS is suppressed until
    then), `max_new` tokens, or a stop string (`strings`, checked by `text_of`: tokens -> text
    of the row's tail, given by the front door's tokenizer)."""

    max_new: int
    eos: tuple[int, ...] = ()
    min_new: int = 0
    strings: tuple[str, ...] = ()
    text_of: Any = None  # callable(list[int]) -> str

    def __post_init__(self):
        if self.max_new < 1:
            raise ValueError(f"max_new_tokens: {self.max_new}; allowed: an integer >= 1")


@dataclass(eq=False)
class Request:
    """One row of a call. The engine owns everything below `task` while the row is live."""

    prompt: list[int]
    params: SamplingParams
    stop: StopRule
    task: Task
    group: Group | None = None
    row: int = 0
    keep_scores: bool = False  # output_scores: the processed scores of every step
    keep_logits: bool = False  # output_logits: the raw logits of every step
    penalty_ids: Any = None  # the ids the repetition penalty starts from (padding included)
    keep_kv: bool = False  # a row that ends well hands its KV to the caller (the output's cache)
    # a row of a call that keeps scores or logits steps until the call's last row stops, fed
    # the pad token after its own end, as stock's batch does (its scores are stock's then; with
    # a repetition penalty, the draw made while its end was read counts as held, not the pad)
    lockstep: bool = False
    pad_id: int = 0
    # --- engine state ---
    account: Account | None = None
    kv: Any = None  # the runner's per-row KV (a PagedKVCore)
    slot: int = -1  # the row's line in the engine's device buffers
    computed: int = 0  # tokens of `seq()` whose K/V are written (or being written)
    sampled: int = 0  # tokens drawn so far, delivered or in flight
    out: list[int] = field(default_factory=list)  # tokens delivered
    scores: list = field(default_factory=list)
    logits: list = field(default_factory=list)
    finished: str | None = None  # "eos", "length", "stop", "cancelled", "error"
    stopped: str | None = None  # a lockstep row's stop, while the call's other rows go on
    swapped: bool = False  # preempted to the CPU tier: its KV comes back as it was
    recompute: int = 0  # tokens to compute again after a preemption (prompt + delivered)
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # its draws are the logits' argmax with nothing to process: True always, None once it has
    # its min_new tokens (EOS is suppressed before), False never (sampling, a penalty, scores)
    plain: bool | None = field(init=False)

    def __post_init__(self):
        simple = self.params.plain and not self.keep_scores
        self.plain = (simple and (not self.stop.eos or not self.stop.min_new)) or (
            None if simple else False
        )

    def seq(self) -> list[int]:
        return self.prompt + self.out

    @property
    def target(self) -> int:
        """Tokens whose K/V must be written before the row can draw its next token."""
        return self.recompute or len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.computed < self.target

    @property
    def pending(self) -> int:
        """Tokens drawn and not yet delivered (the steps in flight)."""
        return self.sampled - len(self.out)

    @property
    def wants_draw(self) -> bool:  # (a lockstep row that stopped still draws: pad)
        """Whether the row still draws tokens (max_new not reached, not finished)."""
        return self.finished is None and self.sampled < self.stop.max_new


class Group:
    """The requests of one generate() call, and the caller's side of their delivery: the
    engine thread appends and notifies; the caller waits (and runs its streamer) in its own
    thread."""

    def __init__(self, requests: list[Request], streaming: bool = False, cancel=None):
        self.requests = requests
        self.cancel = cancel  # an event: set, the call ends at the engine's next step
        self.streaming = streaming  # the caller reads tokens as they come (else: at the end)
        for i, r in enumerate(requests):
            r.group, r.row = self, i
        # The caller's bell: held while the caller has seen every delivery; a delivery releases
        # it, the caller's wait takes it back. A lock's acquire and release run in C, where a
        # Condition's wait and notify_all run some forty lines of Python each: with hundreds of
        # streaming calls woken every step those lines took the interpreter lock from the
        # engine's launches (the loaded trace on an H100: callers held it in 51 % of samples,
        # most of them in Condition.wait).
        self._bell = threading.Lock()
        self._bell.acquire()
        self._ringing = threading.Lock()  # one ringer at a time (the engine; a failing thread)
        self.error: BaseException | None = None
        self.cancelled = False
        self.version = 0  # bumped at each delivery (the caller's wait predicate)
        self.entered: float | None = None  # perf_counter when its generate() was called
        self.told_at: float | None = None  # monotonic time of its last wake for new tokens
        # run on the engine thread at each delivery of a streaming call, in place of waking its
        # caller (woken then only at its end): a streamer that just hands ids on (front.py)
        self.sink = None

    @property
    def done(self) -> bool:
        return self.error is not None or all(r.finished is not None for r in self.requests)

    @property
    def level(self) -> int:
        """The call's priority level (its task's)."""
        return self.requests[0].task.level

    def notify(self) -> None:
        if self.sink is not None:
            try:
                self.sink()
            except Exception as err:  # noqa: BLE001 - the call's own error: it fails alone
                self.fail(err)
                return
            if not self.done:
                return
        self._ring()

    def fail(self, err: BaseException) -> None:
        with self._ringing:
            if self.error is None:
                self.error = err
        self._ring()

    def _ring(self) -> None:
        with self._ringing:
            self.version += 1
            if self._bell.locked():
                self._bell.release()

    def wait(self, seen: int, timeout: float) -> int:
        """Blocks until a delivery after version `seen` (or `timeout` s); the version now. (A
        ring the caller had already seen may end one wait early: its loop waits again.)"""
        if self.version == seen and not self.done:
            self._bell.acquire(True, timeout)
        return self.version
