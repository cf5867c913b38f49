"""The interpreter's garbage-collection pauses, as the engine sees them.

A full (generation 2) collection walks every tracked object of the process: with torch,
transformers and a model loaded, hundreds of thousands, 0.2-0.5 s during which no thread runs
Python: not the engine's launches, not its callers. Many generate() calls at once make objects
fast enough to set one off in the first steps of a burst. So the engine counts the pauses
(engine_stats() "gc_s", "gc_full"; each step's share in its timeline entry), and by default
(`scheduler.gc_freeze`) the first engine on a GPU collects once and freezes what survives
(``gc.freeze()``, as vLLM and SGLang do after loading): later full collections walk only the
objects made since. What was frozen is never collected as cyclic garbage (freed by reference
counting as usual); ``gc.unfreeze()`` undoes it. A cache that was live when the heap froze
and later left in a reference cycle would so keep its pool (and the pool's CPU tier) for good:
``release_pools()`` (disable(), tests) thaws the heap around its collections (kv/pool.py).

The first engine is made before its graphs are compiled, and a compile leaves far more
long-lived objects than the model did (on the CPU machine, the tiny model's first steps
through kv.cpu_decode_graphs "fuse": 120,000-216,000 tracked objects outside the freeze, then
full collections of 95-133 ms in the bursts that followed, against 14 ms once they were
frozen too). So a process that froze collects and freezes again after each compiled capture
(`refreeze`): the compile took seconds, the collection takes a fraction of that.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("oxygen_torch")

_lock = threading.Lock()
_installed = False
_frozen = False
_began: float | None = None  # when the collection under way started (one runs at a time)
# totals since the watch was installed: pause seconds (all generations), full collections
pause_s = 0.0
full = 0


def _callback(phase: str, info: dict) -> None:
    global pause_s, full, _began
    if phase == "start":
        _began = time.perf_counter()
        return
    if _began is not None:
        pause_s += time.perf_counter() - _began
        _began = None
    if info.get("generation") == 2:
        full += 1


def install() -> None:
    """Starts counting collections (once per process; an engine's creation calls it)."""
    global _installed
    with _lock:
        if not _installed:
            gc.callbacks.append(_callback)
            _installed = True


def installed() -> bool:
    return _installed


def freeze_once() -> bool:
    """Collects and freezes the heap, once per process; True when this call did."""
    global _frozen
    with _lock:
        if _frozen:
            return False
        _frozen = True
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "oxygen_torch: froze %d objects for the garbage collector in %.0f ms "
        "(scheduler.gc_freeze; engine/gc_watch.py)",
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - t),
    )
    return True


def refreeze(why: str) -> bool:
    """After a compile made many long-lived objects: collects and freezes again, when this
    process froze once (freeze_once: scheduler.gc_freeze on a GPU); True when it did."""
    if not _frozen:
        return False
    t = time.perf_counter()
    before = gc.get_freeze_count()
    gc.collect()  # (no lock held: a collection runs finalizers)
    gc.freeze()
    log.info(
        "oxygen_torch: froze %d more objects after %s in %.0f ms (scheduler.gc_freeze; "
        "engine/gc_watch.py)",
        gc.get_freeze_count() - before,
        why,
        1e3 * (time.perf_counter() - t),
    )
    return True
