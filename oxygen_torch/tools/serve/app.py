"""The FastAPI app: OpenAI's endpoints over one model, with limits on everything a client sends.

    POST /v1/completions        prompt: text, texts, token ids or lists of them
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the one model served
    GET  /health, GET /metrics  liveness; Prometheus text (oxygen's figures and the server's)

A request is checked (protocol.py), admitted (at most ``max_queue`` waiting for a first token,
else 429 with Retry-After), tokenised on a thread, checked against the model's context and the
KV pool (400 naming the limit), then run as one generate() call: in the engine process
(engine_process.py, what the command runs: the model's steps do not share an interpreter lock
with the HTTP side) or on a worker thread of this process (jobs.py's ThreadRunner,
`build_app`). The server watches the client while the call runs: a client that leaves ends
its call at the engine's next step. Every refusal is OpenAI's error object with a 4xx status;
a 5xx means the server failed, never that the client sent something wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .answers import Answer, error_event
from .jobs import Admission, Job, RemoteError, ThreadRunner, describe
from .protocol import ApiError, Limits, chat_request, completion_request, parse_json
from .served import Served

log = logging.getLogger("oxygen_torch.serve")


@dataclass(frozen=True)
class ServeConfig:
    """The server's own settings (the engine's are oxygen's configuration)."""

    model_name: str = "model"
    api_key: str | None = None  # None: no authentication
    max_queue: int = 256  # requests waiting for their first token before 429
    max_body_bytes: int = 8 << 20  # a 128k-token prompt as JSON ids is ~1 MiB
    body_timeout_s: float = 30.0  # the whole body must arrive within this
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    workers: int | None = None  # generate() threads; None: scheduler.max_step_seqs + max_queue
    retry_after_s: int = 1
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self):
        checks = {  # name: (holds, what is allowed)
            "max_queue": (self.max_queue >= 1, ">= 1"),
            "max_body_bytes": (self.max_body_bytes >= 1024, ">= 1024"),
            "body_timeout_s": (self.body_timeout_s > 0, "> 0"),
            "retry_after_s": (self.retry_after_s >= 0, ">= 0"),
            "max_model_len": (self.max_model_len is None or self.max_model_len >= 2, ">= 2"),
            "workers": (self.workers is None or self.workers >= 1, ">= 1"),
            "api_key": (self.api_key is None or bool(self.api_key), "a non-empty string"),
        }
        for name, (ok, allowed) in checks.items():
            if not ok:
                raise ValueError(
                    f"ServeConfig.{name}: {getattr(self, name)!r} is not allowed; allowed: "
                    f"{allowed}"
                )


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _from_generate(err: BaseException) -> ApiError:
    """What generate() raised, as the client's answer."""
    kind, name, message = describe(err)
    if kind == "kv":
        return ApiError(400, f"the request does not fit the KV pool: {message}")
    if kind == "value":  # transformers refusing the settings
        return ApiError(400, f"generate() refused the request: {message[:500]}")
    if kind == "oom":
        return ApiError(503, "the device is out of memory; retry later",
                        headers={"Retry-After": "1"})  # fmt: skip
    if kind == "gone":
        return ApiError(503, message)
    if kind == "other" and not isinstance(err, RemoteError):  # (the engine process logs its)
        log.error("generate() failed", exc_info=err)
    return ApiError(500, f"the server failed: {name}")


async def _read_body(request: Request, cfg: ServeConfig) -> bytes:
    """The body, at most max_body_bytes (413), whole within body_timeout_s (408)."""
    size = request.headers.get("content-length")
    if size is not None:
        if not size.isdigit():
            raise ApiError(400, f"Content-Length: {size[:40]!r} is not a number")
        if len(size) > 15 or int(size) > cfg.max_body_bytes:
            raise ApiError(413, f"the body is larger than this server's {cfg.max_body_bytes} bytes")

    async def read() -> bytes:
        chunks, got = [], 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > cfg.max_body_bytes:
                raise ApiError(413, f"the body is larger than {cfg.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), cfg.body_timeout_s)
    except TimeoutError:
        raise ApiError(408, f"the body did not arrive within {cfg.body_timeout_s:g} s",
                       headers={"Connection": "close"}) from None  # fmt: skip


async def _client_left(request: Request) -> None:
    """Returns when the client disconnects."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next_or_left(job: Job, request: Request):
    """The job's next item, or None when the client left first (the job is then cancelled)."""
    get = asyncio.ensure_future(job.queue.get())
    left = asyncio.ensure_future(_client_left(request))
    try:
        done, _ = await asyncio.wait({get, left}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
    if get in done:
        return get.result()
    get.cancel()
    job.cancel()
    return None


def worker_count(cfg: ServeConfig) -> int:
    """generate() threads: cfg.workers, else a step's rows plus the queue (this process's
    oxygen configuration: the engine's, where the threads run)."""
    import oxygen_torch

    active = oxygen_torch.active_config()
    seqs = active.scheduler.max_step_seqs if active is not None else 256
    return cfg.workers or seqs + cfg.max_queue


class Server:
    """The app's state: what it knows of the model, the admission counter, the runner that runs
    the calls (ThreadRunner, or engine_process.EngineProcess)."""

    def __init__(self, served: Served, runner, cfg: ServeConfig):
        self.cfg, self.served, self.runner = cfg, served, runner
        self.admission = Admission(cfg.max_queue, cfg.retry_after_s)
        self.started = int(time.time())

    def authorize(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.cfg.api_key.encode()
        ):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer <key>",
                           code="invalid_api_key")  # fmt: skip

    async def generate(self, request: Request, chat: bool) -> Response:
        self.authorize(request)
        raw = await _read_body(request, self.cfg)
        # on a thread: an 8 MiB body of token ids takes ~1 s to parse and check, every stream's
        # chunks would wait that long for the event loop
        req = await asyncio.to_thread(self._check, raw, request.headers.get("x-priority"), chat)
        if req.model is not None and req.model != self.cfg.model_name:
            raise ApiError(404, f"model: {req.model[:100]!r} does not exist here; this server "
                           f"serves {self.cfg.model_name!r}", param="model",
                           code="model_not_found")  # fmt: skip
        if (gone := self.runner.alive()) is not None:
            raise ApiError(503, gone)
        self.admission.enter()
        try:
            call = await asyncio.to_thread(self._prepare, req)
        except BaseException:
            self.admission.leave(False, "refused")
            raise
        job = Job(call, self.admission, asyncio.get_running_loop(), req.sampling.stream)
        answer = Answer(call, self.cfg.model_name, chat, req.sampling.return_token_ids)
        self.runner.start(job)
        first = await _next_or_left(job, request)
        if first is None:
            return Response(status_code=499)  # nobody reads it: the client has gone
        if first[0] == "error":
            raise _from_generate(first[1])
        if not req.sampling.stream:
            return JSONResponse(answer.whole())
        return StreamingResponse(
            self._events(job, answer, first, req.sampling.include_usage),
            media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
        )  # fmt: skip

    def _check(self, raw: bytes, prio: str | None, chat: bool):
        """The body as a checked request (protocol.py)."""
        body, lim = parse_json(raw), self.cfg.limits
        if chat:
            return chat_request(body, lim, prio)
        return completion_request(body, lim, self.served.vocab, prio)

    def _prepare(self, req):
        """Tokenises and checks the request (a thread: long texts take a while)."""
        return self.served.call(req, self.served.encode(req))

    async def _events(self, job: Job, answer: Answer, item, include_usage: bool):
        """The stream: text chunks as they come, then finish reasons, usage, [DONE]. Starlette
        ends this generator when the client disconnects: the job is cancelled on the way out."""
        try:
            for chunk in answer.opening():
                yield chunk
            while True:
                kind, data = item
                if kind == "text":
                    if any(deltas := job.take_text()):
                        yield answer.texts(deltas)
                elif kind == "done":
                    for chunk in answer.closing(include_usage):
                        yield chunk
                    return
                else:  # the call failed after its first token: say so in the stream
                    yield error_event(_from_generate(data).body())
                    yield b"data: [DONE]\n\n"
                    return
                item = await job.queue.get()
        finally:
            job.cancel()

    def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    def _model_card(self) -> dict:
        return {"id": self.cfg.model_name, "object": "model", "created": self.started,
                "owned_by": "oxygen_torch", "max_model_len": self.served.max_model_len}  # fmt: skip

    def close(self) -> None:
        self.runner.close()


def build_app(model, tokenizer, cfg: ServeConfig) -> FastAPI:
    """The app over `model` (already on its device, oxygen applied) and its tokenizer, the calls
    run on worker threads of this process."""
    served = Served.of(model, tokenizer, cfg.max_model_len)
    return app_for(Server(served, ThreadRunner(model, served.pad, worker_count(cfg)), cfg))


def app_for(server: Server) -> FastAPI:
    """The FastAPI app of `server`; its runner is closed when the app shuts down."""
    cfg = server.cfg

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        server.close()

    app = FastAPI(title="oxygen_torch", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.state.server = server

    @app.exception_handler(ApiError)
    async def api_error(request, err: ApiError):
        return _error(err)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, err: StarletteHTTPException):
        return _error(ApiError(err.status_code, str(err.detail), headers=err.headers))

    @app.exception_handler(Exception)
    async def server_error(request, err: Exception):
        log.error("request failed", exc_info=err)
        return _error(ApiError(500, f"the server failed: {type(err).__name__}"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.generate(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return server.models()

    @app.get("/v1/models/{name:path}")
    async def model(request: Request, name: str):
        server.authorize(request)
        if name != cfg.model_name:
            raise ApiError(404, f"model {name[:100]!r} does not exist here", param="model",
                           code="model_not_found")  # fmt: skip
        return server._model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers probe with HEAD)
    async def health():
        if (gone := server.runner.alive()) is not None:
            return JSONResponse({"status": "down", "reason": gone}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        from .metrics import text

        oxygen = await asyncio.to_thread(server.runner.oxygen_metrics)
        body = await asyncio.to_thread(text, server.admission, oxygen)
        return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
