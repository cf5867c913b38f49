"""The HTTP server behind ``metrics.start_http_server``, with its threads and its connections
bounded.

prometheus_client's own server starts one thread per connection and keeps it for as long as the
client keeps the connection open, idle or not: 200 idle connections made 203 threads. Here a new
connection waits in one watcher thread (a selector, no thread of its own) until it sends
something, and is closed after ``idle_timeout_s`` of silence; requests are then served by at most
``workers`` threads, each read and write under ``request_timeout_s``, so a client that sends half a
request and stops holds a worker that long at most. At most ``max_waiting`` connections wait at
once; beyond that the oldest is closed.
"""

from __future__ import annotations

import queue
import selectors
import socket
import threading
import time
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

IDLE_TIMEOUT_S = 10.0  # Prometheus sends its request at once; 10 s of silence is not a scrape
REQUEST_TIMEOUT_S = 5.0
WORKERS = 4
MAX_WAITING = 256


class _Handler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s  # StreamRequestHandler sets it on the socket
        super().setup()

    def log_message(self, *args: Any) -> None:  # a scrape every few seconds is not news
        pass


class BoundedWSGIServer(WSGIServer):
    """A WSGI server whose threads are the serving loop, one watcher and at most ``workers``."""

    # listen() backlog: socketserver's default of 5 made the kernel drop the SYNs of a burst of
    # clients, each of which then waited a second or more to retry
    request_queue_size = 1024

    def __init__(
        self,
        addr: str,
        port: int,
        app: Any,
        workers: int = WORKERS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_waiting: int = MAX_WAITING,
    ):
        if isinstance(port, bool) or not isinstance(port, int):
            raise ValueError(f"oxygen metrics: port {port!r} is not an integer from 0 to 65535")
        if not 0 <= port <= 65535:
            raise ValueError(
                f"oxygen metrics: port {port} is out of range; allowed: 0 to 65535 (0: a free one)"
            )
        self.address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self.request_timeout_s = request_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._max_waiting = max_waiting
        self._max_workers = workers
        self._lock = threading.Lock()
        self._arrived: list[tuple[socket.socket, Any]] = []  # accepted, not yet watched
        self._waiting: dict[socket.socket, tuple[Any, float]] = {}  # watcher thread only
        self._ready: queue.Queue = queue.Queue()  # connections that sent something
        self._workers: list[threading.Thread] = []
        self._idle_workers = 0
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._watcher = threading.Thread(
            target=self._watch, name="oxygen-metrics-idle", daemon=True
        )
        # everything server_close() closes is set before bind(): socketserver calls it when
        # bind() fails
        try:
            super().__init__((addr, port), _Handler)
        except OSError as exc:
            raise OSError(
                exc.errno, f"oxygen metrics: cannot serve on {addr}:{port}: {exc.strerror or exc}"
            ) from exc
        self.set_app(app)
        self._watcher.start()

    # -- called on the serve_forever thread after accept() -------------------------------------

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        with self._lock:
            self._arrived.append((request, client_address))
        self._wake()

    # -- the watcher: every waiting connection, none with a thread of its own ------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed: the server is shutting down
            pass

    def _watch(self) -> None:
        while not self._closed.is_set():
            for key, _ in self._selector.select(self._next_deadline()):
                if key.fileobj is self._wake_r:
                    self._wake_r.recv(4096)
                    continue
                sock = key.fileobj
                self._selector.unregister(sock)
                addr, _ = self._waiting.pop(sock)
                self._hand_to_worker(sock, addr)
            self._adopt_arrived()
            self._close_idle()
        for sock in list(self._waiting):
            self.shutdown_request(sock)

    def _next_deadline(self) -> float:
        if not self._waiting:
            return self._idle_timeout_s
        oldest = min(t for _, t in self._waiting.values())
        return max(0.0, oldest + self._idle_timeout_s - time.monotonic())

    def _adopt_arrived(self) -> None:
        with self._lock:
            arrived, self._arrived = self._arrived, []
        for sock, addr in arrived:
            if len(self._waiting) >= self._max_waiting:
                oldest = min(self._waiting, key=lambda s: self._waiting[s][1])
                self._drop(oldest)
            self._waiting[sock] = (addr, time.monotonic())
            self._selector.register(sock, selectors.EVENT_READ)

    def _close_idle(self) -> None:
        now = time.monotonic()
        for sock, (_, since) in list(self._waiting.items()):
            if now - since >= self._idle_timeout_s:
                self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._selector.unregister(sock)
        del self._waiting[sock]
        self.shutdown_request(sock)

    # -- workers: started as needed, never more than max_workers ------------------------------

    def _hand_to_worker(self, sock: socket.socket, addr: Any) -> None:
        self._ready.put((sock, addr))
        with self._lock:
            start = self._idle_workers == 0 and len(self._workers) < self._max_workers
            if start:
                t = threading.Thread(target=self._work, name="oxygen-metrics", daemon=True)
                self._workers.append(t)
        if start:
            t.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle_workers += 1
            item = self._ready.get()
            with self._lock:
                self._idle_workers -= 1
            if item is None:
                return
            sock, addr = item
            try:
                self.finish_request(sock, addr)
            except Exception:  # a broken or timed-out client: close it, keep serving
                pass
            finally:
                self.shutdown_request(sock)

    def server_close(self) -> None:
        self._closed.set()
        self._wake()
        if self._watcher.ident is not None:  # (not started when bind() failed)
            self._watcher.join(timeout=5)
        for _ in self._workers:
            self._ready.put(None)
        self._wake_w.close()
        self._wake_r.close()
        self._selector.close()
        super().server_close()


def serve(addr: str, port: int, app: Any, **limits: Any) -> BoundedWSGIServer:
    """Start serving ``app`` on ``addr:port`` from a daemon thread; returns the server."""
    server = BoundedWSGIServer(addr, port, app, **limits)
    threading.Thread(target=server.serve_forever, name="oxygen-metrics-accept", daemon=True).start()
    return server
