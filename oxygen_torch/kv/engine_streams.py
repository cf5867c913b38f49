"""The engine's own CUDA stream (`scheduler.engine_stream`), and the orderings it needs.

On the stream every caller uses, each caller's device read (its inputs on their way to the
host, the user's own copies before generate()) waits for the steps the engine has queued, so
callers that arrive together wake together at a step's end and run their Python beside the
engine's next launch. On a stream of its own the engine's steps order against the callers'
work only where they share memory:

- a step waits for the work queued on its device's default stream when it begins (blocks a
  caller's stream freed, then handed out again by the engine);
- a caller's stream waits for every engine stream of its device before it touches what the
  engine wrote: the output (its cache's blocks, kept scores and logits: `front._output`), the
  rows it gives back (`front._release`, whose pages are retired behind the caller's stream),
  and each forward of a call on the per-call path over the shared KV pool (`after_engines` in
  the paged cache's step begin): blocks the engine freed while a step that writes them was
  queued, and prefix-cache blocks it wrote.

Waits between streams cost no host sync."""

from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_streams: dict[int, list[torch.cuda.Stream]] = {}  # device index -> live engine streams
_local = threading.local()  # .stream: the engine stream of this thread (engine threads only)


def start(device: torch.device) -> torch.cuda.Stream:
    """The calling engine thread's own stream on `device` (registered until `stop`)."""
    stream = torch.cuda.Stream(device)
    with _lock:
        _streams.setdefault(device.index, []).append(stream)
    _local.stream = stream
    return stream


def stop(device: torch.device, stream: torch.cuda.Stream) -> None:
    with _lock:
        live = _streams.get(device.index, [])
        if stream in live:
            live.remove(stream)
    _local.stream = None


def on_engine_thread() -> bool:
    return getattr(_local, "stream", None) is not None


def any_for(device) -> bool:
    return bool(_streams.get(getattr(device, "index", None)))


def after_engines(device) -> None:
    """The current stream of this (non-engine) thread waits for every engine stream of
    `device`: what the engines queued so far is done before what this thread queues next."""
    if device is None or device.type != "cuda" or on_engine_thread():
        return
    with _lock:
        live = list(_streams.get(device.index, ()))
    if live:
        cur = torch.cuda.current_stream(device)
        for s in live:
            cur.wait_stream(s)


def after_callers(device: torch.device) -> None:
    """(An engine thread, at a step's start) its stream waits for the default stream's work and
    for the other engines' streams of the device (two models of one geometry share a KV pool:
    a block one engine freed while its queued step still writes it may go to the other)."""
    s = getattr(_local, "stream", None)
    if s is None:
        return
    s.wait_stream(torch.cuda.default_stream(device))
    with _lock:
        others = [o for o in _streams.get(device.index, ()) if o is not s]
    for o in others:
        s.wait_stream(o)
