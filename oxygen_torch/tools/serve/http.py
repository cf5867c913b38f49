"""uvicorn with deadlines on what a client owes the server.

uvicorn times out an idle keep-alive connection after a response (``timeout_keep_alive``), but
a connection that never sends a complete request head (nothing at all, or headers a byte at a
time) it keeps forever. Here every connection must send a whole request head within
``header_timeout_s`` of opening or of its previous response, or it is closed. (The body has its
own deadline in the app, answered with 408; connections are capped by ``max_connections``,
past which uvicorn answers 503.) Idle connections hold no worker: generate() threads are only
taken by admitted requests.
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class HttpConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    header_timeout_s: float = 10.0
    keep_alive_s: int = 5
    max_connections: int = 1024
    log_level: str = "info"
    # on shutdown, streams still open after this are cut (their calls end at the next step)
    shutdown_timeout_s: int = 10

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not allowed; allowed: 0 to 65535")
        for name in ("header_timeout_s", "keep_alive_s", "max_connections"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: {getattr(self, name)} is not allowed; allowed: > 0")


class _DeadlineH11(H11Protocol):
    """H11Protocol whose connections owe a request head within `header_timeout_s`."""

    header_timeout_s = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # before super(): a pipelined request it starts disarms it
        super().on_response_complete()

    def handle_events(self) -> None:
        super().handle_events()
        if self._serving():
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a Content-Length that is no number, a broken head): 400
        with OpenAI's error object, as every other refusal, then the connection closes."""
        body = json.dumps({"error": {"message": f"invalid HTTP request: {msg}",
                                     "type": "invalid_request_error", "param": None,
                                     "code": None}}).encode()  # fmt: skip
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                (b"connection", b"close")]  # fmt: skip
        for event in (h11.Response(status_code=400, headers=head, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):  # fmt: skip
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self._serving() and not self.transport.is_closing():
            self.transport.close()


def protocol(header_timeout_s: float) -> type:
    return type("DeadlineH11", (_DeadlineH11,), {"header_timeout_s": header_timeout_s})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one, read back with getsockname())."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def server(app, http: HttpConfig):
    """A uvicorn.Server for `app`; run it with ``.run(sockets=[bind(host, port)])``."""
    import uvicorn

    config = uvicorn.Config(
        app, host=http.host, port=http.port, http=protocol(http.header_timeout_s),
        timeout_keep_alive=http.keep_alive_s, limit_concurrency=http.max_connections,
        log_level=http.log_level, access_log=http.log_level in ("debug", "trace"),
        lifespan="on", timeout_graceful_shutdown=http.shutdown_timeout_s,
    )  # fmt: skip
    return uvicorn.Server(config)
