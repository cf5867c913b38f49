"""The engine in a process of its own: the model's steps do not share an interpreter lock with
the HTTP side.

vLLM's API server and engine core are two processes for this reason: at tens of streams the
HTTP side's Python (the event loop, JSON, detokenising, a chunk a stream and wake) is a large
share of a second of interpreter time a second, and under one lock it delays the engine's
launches (H200, one process: 64 requests a second streamed at 0.77x the same server not
streaming, TPOT P50 18 ms against 7 at 16 a second).

The front (HTTP, tokenizer, text: the server's process) and the engine process (the model,
oxygen, a generate() thread a call) talk over one pipe in pickled messages:

  front -> engine   ("run", rid, spec, live)  ("cancel", rid)  ("metrics", token)  ("close",)
  engine -> front   once: ("ready", facts, kv_tokens, engine_on) or ("failed", message);
                    then lists of events: ("ids", rid, columns)  ("end", rid, outcome, error)
                    ("kv_tokens", n)  ("metrics", token, text)

The engine sends what its calls' threads hand it in batches (one message a wake of its sender
thread: a step's tokens for every stream at once); the front's receiver thread turns them into
text and posts them to the event loop (jobs.Poster). The engine process is a fresh interpreter
(`python -c`, the pipe's end passed as a file descriptor: CUDA does not survive a fork, and
unlike multiprocessing's spawn it never runs the caller's main script again) and ends when the
pipe closes: the front exiting, even killed, leaves no engine behind.
"""

from __future__ import annotations

import itertools
import logging
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from pathlib import Path

from .jobs import Call, ClientLeft, Job, RemoteError, describe, run_call
from .protocol import ApiError
from .served import local_kv_tokens, model_facts

log = logging.getLogger("oxygen_torch.serve")

METRICS_TIMEOUT_S = 10.0  # /metrics waits this long for the engine's figures, then 503
CLOSE_TIMEOUT_S = 30.0  # the engine's calls end at their next step; then it is terminated


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process loads and how (the command line's part of it)."""

    path: str
    dtype: str = "auto"
    device: str | None = None
    conf: str = ""  # --conf, over OXYGEN_CONF / the file (the environment is inherited)
    warm_up: bool = True
    workers: int | None = None  # generate() threads; None: scheduler.max_step_seqs + max_queue
    max_queue: int = 256
    log_level: str = "info"
    max_model_len: int | None = None  # --max-model-len: the warm-up's graph tables' length


class EngineFailed(RuntimeError):
    """The engine process could not start: its reason (a bad checkpoint, a bad configuration)."""


# --- the engine process ----------------------------------------------------------------------


class _Outbox:
    """Events of every call, sent by one thread: what has come while it sent goes in its next
    message (a step's tokens of many calls in one pickled message and one pipe write)."""

    def __init__(self, conn):
        self.conn = conn
        self._lock = threading.Lock()
        self._items: list[tuple] = []
        self._ready = threading.Event()
        self._closed = False
        self.thread = threading.Thread(target=self._send, name="oxygen-engine-sender", daemon=True)
        self.thread.start()

    def add(self, item: tuple) -> None:
        with self._lock:
            self._items.append(item)
            first = len(self._items) == 1
        if first:
            self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._ready.set()
        self.thread.join(CLOSE_TIMEOUT_S)

    def _send(self) -> None:
        while True:
            self._ready.wait()
            self._ready.clear()
            with self._lock:
                items, self._items = self._items, []
            if items:
                try:
                    self.conn.send(items)
                except (OSError, ValueError):  # the front has gone: nobody to tell
                    return
            if self._closed and not self._items:
                return


class _Call:
    """One call in the engine process: its streamer, the tokens to the outbox (no text here:
    the front decodes). Run on the engine's thread at each delivery (oxygen_engine_thread): no
    wake of the call's own thread a step; a cancelled call ends by its task's cancel event."""

    oxygen_engine_thread = True

    def __init__(self, rid: int, call: Call, live: bool, outbox: _Outbox):
        self.rid, self.call, self.live, self.outbox = rid, call, live, outbox
        self.cancelled = threading.Event()
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # generate() puts the prompt first
            self.prompt_seen = True
            if self.cancelled.is_set():
                raise ClientLeft()
            return
        self.oxygen_put_ids([value.view(-1).tolist()])

    def oxygen_put_ids(self, columns: list[list[int]]) -> None:
        if not self.cancelled.is_set():  # (never raises: the engine's thread calls it)
            self.outbox.add(("ids", self.rid, columns))

    def end(self) -> None:
        pass

    def run(self, model, pad: int, ended) -> None:
        outcome, error = "cancelled", None
        try:
            took = lambda columns: self.outbox.add(("ids", self.rid, columns))  # noqa: E731
            outcome, err = run_call(model, self.call, pad, self if self.live else None,
                                    self.cancelled, took)  # fmt: skip
            if err is not None:
                error = describe(err)
                if error[0] == "other":
                    log.error("generate() failed", exc_info=err)
        finally:
            self.outbox.add(("end", self.rid, outcome, error))
            ended(self)


class _Engine:
    """The engine process's main thread: reads the front's messages, runs each call on a
    generate() thread."""

    def __init__(self, conn, model, tokenizer, pad: int, workers: int, kv_tokens):
        from concurrent.futures import ThreadPoolExecutor

        self.conn, self.model, self.tok, self.pad = conn, model, tokenizer, pad
        self.outbox = _Outbox(conn)
        self.executor = ThreadPoolExecutor(workers, "serve")
        self.calls: dict[int, _Call] = {}
        self.lock = threading.Lock()
        self.kv_tokens = kv_tokens

    def serve(self) -> None:
        try:
            while True:
                try:
                    msg = self.conn.recv()
                except (EOFError, OSError):  # the front has gone
                    break
                if msg[0] == "close":
                    break
                self._handle(msg)
        finally:
            with self.lock:
                calls = list(self.calls.values())
            for c in calls:
                c.cancelled.set()
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.outbox.close()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "run":
            _, rid, (prompts, n, gen, priority, seed), live = msg
            if "stop_strings" in gen:
                gen = {**gen, "tokenizer": self.tok}
            call = _Call(rid, Call(prompts, n, gen, priority, seed), live, self.outbox)
            with self.lock:
                self.calls[rid] = call
            self.executor.submit(call.run, self.model, self.pad, self._ended)
        elif kind == "cancel":
            with self.lock:
                call = self.calls.get(msg[1])
            if call is not None:
                call.cancelled.set()
        elif kind == "metrics":
            from .. import metrics

            self.outbox.add(("metrics", msg[1], metrics.scrape()))

    def _ended(self, call: _Call) -> None:
        with self.lock:
            self.calls.pop(call.rid, None)
        if self.kv_tokens is None:  # (no warm-up: the pool exists after the first call)
            self.kv_tokens = local_kv_tokens(str(self.model.device))
            if self.kv_tokens is not None:
                self.outbox.add(("kv_tokens", self.kv_tokens))


def engine_main(fd: int) -> None:
    """The engine process (`fd`: its end of the pipe): load, warm up, say ready, serve until
    the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front's: it closes the pipe
    conn = Connection(fd)
    spec: EngineSpec = conn.recv()
    logging.basicConfig(level=spec.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        from .app import ServeConfig, worker_count
        from .loading import configure_oxygen, load, warm_up

        oxygen = configure_oxygen(spec.conf)
        model, tokenizer = load(spec.path, spec.dtype, spec.device)
        facts = model_facts(model, tokenizer)
        if spec.warm_up:
            warm_up(model, facts.pad, spec.max_model_len)
        workers = worker_count(ServeConfig(workers=spec.workers, max_queue=spec.max_queue))
    except BaseException as err:  # noqa: BLE001 - told to the front, which says it and exits
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    kv = local_kv_tokens(facts.device)
    conn.send(("ready", facts, kv, bool(oxygen.scheduler.engine)))
    _Engine(conn, model, tokenizer, facts.pad, workers, kv).serve()


# --- the front (the server's process) ---------------------------------------------------------


class EngineProcess:
    """The runner of the server's calls in the engine process (jobs.ThreadRunner's interface):
    start(job), alive(), oxygen_metrics(), close(); `facts` and kv_tokens() for Served."""

    def __init__(self, spec: EngineSpec):
        self._conn, child = Pipe()
        # this oxygen_torch, where the child's path does not already lead to it (a checkout)
        root = str(Path(__file__).resolve().parents[3])
        code = (f"import sys; r = {root!r}; r in sys.path or sys.path.insert(0, r); "
                f"from {__name__} import engine_main; engine_main({child.fileno()})")  # fmt: skip
        self.process = subprocess.Popen([sys.executable, "-c", code],
                                        pass_fds=[child.fileno()])  # fmt: skip
        child.close()
        self._conn.send(spec)
        first = self._first()
        if first[0] != "ready":
            self._join(CLOSE_TIMEOUT_S)
            raise EngineFailed(first[1])
        self.facts, self._kv_tokens, self.engine_on = first[1:4]
        self.jobs: dict[int, Job] = {}
        self._closed = False
        self._ids = itertools.count()
        self._lock = threading.Lock()  # jobs
        self._send_lock = threading.Lock()  # (a long prompt's send holds no receiver back)
        self._gone: str | None = None
        self._asked: dict[int, list] = {}  # metrics token -> [event, text]
        self.receiver = threading.Thread(target=self._receive, name="oxygen-engine-receiver",
                                         daemon=True)  # fmt: skip
        self.receiver.start()

    def _first(self) -> tuple:
        while not self._conn.poll(0.2):
            if self.process.poll() is not None:
                return ("failed", f"the engine process exited (exit code "
                        f"{self.process.returncode}) before it was ready")  # fmt: skip
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return ("failed", f"the engine process exited (exit code {self._join(5)})")

    def _join(self, timeout: float) -> int | None:
        """The engine's exit code once it has exited within `timeout` s, else None."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    # --- the runner's interface ------------------------------------------------------------

    def kv_tokens(self) -> int | None:
        return self._kv_tokens

    def alive(self) -> str | None:
        """None while the engine serves; else why not."""
        return self._gone

    def start(self, job: Job) -> None:
        rid = next(self._ids)
        job.on_cancel = lambda _job: self._send(("cancel", rid))
        with self._lock:
            self.jobs[rid] = job
        if not self._send(("run", rid, job.call.spec(), job.live)):
            self._end(rid, "error", RemoteError("gone", "EngineExited", self._gone or "gone"))

    def oxygen_metrics(self) -> str:
        """The engine process's oxygen figures (metrics.scrape() there)."""
        token, done = next(self._ids), threading.Event()
        self._asked[token] = [done, None]
        try:
            if self._send(("metrics", token)) and done.wait(METRICS_TIMEOUT_S):
                text = self._asked[token][1]
                if text is not None:
                    return text
            raise ApiError(503, self._gone or f"the engine process did not send its figures "
                           f"within {METRICS_TIMEOUT_S:g} s")  # fmt: skip
        finally:
            self._asked.pop(token, None)

    def close(self) -> None:
        """Ends the engine: its calls end at their next step, then it exits (terminated past
        CLOSE_TIMEOUT_S). Every job still open gets an error. Once: later calls return."""
        if self._closed:
            return
        self._closed = True
        self._send(("close",))
        if self._join(CLOSE_TIMEOUT_S) is None:
            log.warning("the engine process did not exit within %g s: killed", CLOSE_TIMEOUT_S)
            self.process.kill()
            self._join(5)
        self._conn.close()
        self.receiver.join(CLOSE_TIMEOUT_S)

    # --- the pipe ---------------------------------------------------------------------------

    def _send(self, msg: tuple) -> bool:
        with self._send_lock:
            if self._gone is not None:
                return False
            try:
                self._conn.send(msg)
                return True
            except (OSError, ValueError):  # (closed: the receiver says why)
                return False

    def _receive(self) -> None:
        while True:
            try:
                events = self._conn.recv()
            except (EOFError, OSError):
                break
            for ev in events:
                self._event(ev)
        code = self._join(CLOSE_TIMEOUT_S)
        with self._lock:
            self._gone = f"the engine process has exited (exit code {code})"
            jobs, self.jobs = list(self.jobs.items()), {}
        for _rid, job in jobs:
            job.finish("error", RemoteError("gone", "EngineExited", self._gone))
        for done, _ in list(self._asked.values()):
            done.set()

    def _event(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "ids":
            with self._lock:
                job = self.jobs.get(ev[1])
            if job is not None and not job.receive(ev[2]):
                self._send(("cancel", ev[1]))  # every row ended at a stop string
        elif kind == "end":
            _, rid, outcome, error = ev
            self._end(rid, outcome, RemoteError(*error) if error is not None else None)
        elif kind == "kv_tokens":
            self._kv_tokens = ev[1]
        elif kind == "metrics" and (asked := self._asked.get(ev[1])) is not None:
            asked[1] = ev[2]
            asked[0].set()

    def _end(self, rid: int, outcome: str, error: BaseException | None) -> None:
        with self._lock:
            job = self.jobs.pop(rid, None)
        if job is not None:
            job.finish(outcome, error)
