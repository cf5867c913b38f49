"""Prometheus exporter: ``start_http_server()`` serves ``/metrics`` with the ``oxygen:`` metrics.

Everything is read at scrape time by one custom collector, from the pools' counters (relaxed
atomics in the native library: a scrape never takes an allocation lock, so it cannot stall a
malloc). Which pools: the global one (``allocator.memory_stats()``) plus every ``VirtualPool``
passed to ``register_pool``. KV-cache, tier and scheduler figures come from sources the later
layers register; until they do, those metrics report zero.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ..engine import gc_watch
from ..engine.stats import BALANCE_BUCKETS
from ..engine.stats import METRICS as ENGINE
from . import metrics_server

DEFAULT_PORT = 9400
# Names follow vLLM/SGLang habits (`vllm:gpu_cache_usage_perc` is a 0..1 fraction despite "perc").
PREFIX = "oxygen:"
# The native map-latency histogram: bucket i counts per-page latencies below 2**i microseconds.
LATENCY_BUCKETS_US = [float(1 << i) for i in range(15)]
# Scheduler weight variance is healthy in 0.9-1.1: buckets dense around 1 (the engine's).
WEIGHT_VARIANCE_BUCKETS = BALANCE_BUCKETS

_lock = threading.Lock()


def _reset_lock_in_child() -> None:
    # A fork while another thread held the lock (a scrape) would leave it held in the child.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_lock_in_child)
# (reference, label): weak references, or strong ones for objects that are not weak-referenceable
_pools: list[tuple[Callable[[], Any], str | None]] = []
_kv_sources: list[Callable[[], dict | None]] = []
_tier_source: Callable[[], dict] | None = None
_scheduler_source: Callable[[], dict] | None = None


# ---------------------------------------------------------------------------------------------
# Sources


def register_pool(pool: Any, name: str | None = None) -> None:
    """Report ``pool`` (anything with ``stats() -> dict``) until it is closed or collected, with
    label ``pool=name`` (default ``pool-<id>``)."""
    try:
        ref = weakref.ref(pool)
    except TypeError:
        ref = lambda p=pool: p  # not weak-referenceable: keep it until unregister_pool
    with _lock:
        _pools.append((ref, name))


def unregister_pool(pool: Any) -> None:
    with _lock:
        _pools[:] = [(r, n) for r, n in _pools if r() is not None and r() is not pool]


def register_kv_source(fn: Callable[[], dict | None]) -> None:
    """``fn()`` -> ``{"device": 0, "tier": {"gpu": frac, "cpu": frac},
    "blocks": {"free": n, "used": n, "shared": n}}``; returning None unregisters it. Until one
    is registered, the pools of ``oxygen_torch.kv`` are reported (with no shared-block count)."""
    with _lock:
        _kv_sources.append(fn)


def unregister_kv_source(fn: Callable[[], dict | None]) -> None:
    with _lock:
        _kv_sources[:] = [f for f in _kv_sources if f is not fn]


def register_tier_source(fn: Callable[[], dict] | None) -> None:
    """``fn()`` -> ``{"hot_zone_hit_ratio": r, "migration_bytes": {"gpu_to_cpu": n, ...}}``."""
    global _tier_source
    _tier_source = fn


def register_scheduler_source(fn: Callable[[], dict] | None) -> None:
    """``fn()`` -> ``{"buckets": [count per WEIGHT_VARIANCE_BUCKETS bound, then +Inf], "sum": s}``
    (counts per bucket, not cumulative)."""
    global _scheduler_source
    _scheduler_source = fn


def pool_snapshots() -> list[tuple[str, dict]]:
    """``[(pool label, stats dict)]``: the global pool of each device, then each registered live
    pool. Stats carry ``map_latency_hist`` (pages per bucket) when the pool has one."""
    out = [("global", s) for s in _global_stats()]
    with _lock:
        _pools[:] = [(r, n) for r, n in _pools if r() is not None]
        pools = [(r(), n) for r, n in _pools]
    for pool, name in pools:
        try:
            stats = dict(pool.stats())
            if hasattr(pool, "latency_histogram"):
                stats["map_latency_hist"] = list(pool.latency_histogram())
        except Exception:  # closed pool: stop reporting it
            unregister_pool(pool)
            continue
        out.append((name or f"pool-{id(pool):x}", stats))
    return out


def _global_stats() -> list[dict]:
    try:
        import torch

        from .. import pool as allocator
    except Exception:  # pool not built here: the exporter must still answer
        return []
    out = []
    for dev in range(max(1, torch.cuda.device_count())):  # counts devices without initialising
        try:
            stats = dict(allocator.memory_stats(dev))
            stats["map_latency_hist"] = [n for _, n in allocator.map_latency_histogram(dev)]
        except Exception:
            continue
        out.append(stats)
    return out


def pool_totals() -> tuple[int, int]:
    """(allocated, mapped) bytes summed over every reported pool (the ``plot`` timeline)."""
    snaps = pool_snapshots()
    return (
        sum(int(s.get("allocated_bytes", 0)) for _, s in snaps),
        sum(int(s.get("mapped_bytes", 0)) for _, s in snaps),
    )


def _kv_figures() -> dict[str, dict]:
    """Per device: blocks summed over caches, tier usage the highest among them (for alerts)."""
    with _lock:
        sources = list(_kv_sources) or [_kv_pools_figures]
    per_dev: dict[str, dict] = {}
    for fn in sources:
        try:
            fig = fn()
        except Exception:
            fig = None
        if fig is None:
            unregister_kv_source(fn)
            continue
        if fig == {}:  # the built-in source with no KV pool yet
            continue
        d = per_dev.setdefault(str(fig.get("device", 0)), {"tier": {}, "blocks": {}})
        for tier, frac in fig.get("tier", {}).items():
            d["tier"][tier] = max(d["tier"].get(tier, 0.0), float(frac))
        for state, n in fig.get("blocks", {}).items():
            d["blocks"][state] = d["blocks"].get(state, 0) + int(n)
    return per_dev or {"0": {"tier": {}, "blocks": {}}}


def _kv_pools_figures() -> dict:
    """Default KV source: oxygen_torch.kv's pools, if the program uses them (never imported here:
    a scrape must not load the KV layer). Blocks summed over pools; tier usage = used / total of
    the pools on GPUs (tier gpu) or on the CPU (tier cpu)."""
    kv_pool = sys.modules.get("oxygen_torch.kv.pool")
    pools = kv_pool.pool_stats() if kv_pool is not None else []
    if not pools:
        return {}
    used = {"gpu": 0, "cpu": 0}
    total = {"gpu": 0, "cpu": 0}
    device = 0
    for p in pools:
        dev = str(p.get("device", "cpu"))
        tier = "cpu" if dev.startswith("cpu") else "gpu"
        device = int(dev.split(":")[1]) if ":" in dev else device
        used[tier] += int(p.get("blocks_used", 0))
        total[tier] += int(p.get("blocks_total", 0))
    n_used, n_total = sum(used.values()), sum(total.values())
    return {
        "device": device,
        "tier": {t: used[t] / total[t] for t in used if total[t]},
        "blocks": {"used": n_used, "free": n_total - n_used, "shared": 0},
    }


def _kv_tier_figures() -> dict:
    """Default tier source: the CPU tiers and prefix caches of oxygen_torch.kv's pools (summed):
    migrated bytes per direction, bytes held per tier, prefix-cache hits / misses, and the
    hot-zone hit ratio (prefix-cache hit blocks found on the device / all hit blocks; 0 before
    any hit)."""
    kv_pool = sys.modules.get("oxygen_torch.kv.pool")
    pools = kv_pool.pool_stats() if kv_pool is not None else []
    moved = {"gpu_to_cpu": 0, "cpu_to_gpu": 0}
    held = {"gpu": 0, "cpu": 0}
    prefix = {"hits": 0, "misses": 0, "gpu_hit_blocks": 0, "cpu_hit_blocks": 0}
    for p in pools:
        dev = str(p.get("device", "cpu"))
        held["cpu" if dev.startswith("cpu") else "gpu"] += int(p.get("blocks_used", 0)) * int(
            p.get("block_bytes_all_layers", 0)
        )
        tier = p.get("cpu_tier") or {}
        moved["gpu_to_cpu"] += int(tier.get("bytes_down", 0))
        moved["cpu_to_gpu"] += int(tier.get("bytes_up", 0))
        held["cpu"] += int(tier.get("used_bytes", 0))
        if tier.get("disk_slots_total"):  # a disk tier behind the CPU tier
            moved["cpu_to_disk"] = moved.get("cpu_to_disk", 0) + int(tier["bytes_to_disk"])
            moved["disk_to_cpu"] = moved.get("disk_to_cpu", 0) + int(tier["bytes_from_disk"])
            held["disk"] = held.get("disk", 0) + int(tier["disk_used_bytes"])
        for k in prefix:
            prefix[k] += int((p.get("prefix_cache") or {}).get(k, 0))
    hit = prefix["gpu_hit_blocks"] + prefix["cpu_hit_blocks"]
    return {
        "migration_bytes": moved,
        "tier_bytes": held,
        "prefix_cache": prefix,
        "hot_zone_hit_ratio": prefix["gpu_hit_blocks"] / hit if hit else 0.0,
    }


# ---------------------------------------------------------------------------------------------
# Collector

_POOL_GAUGES = [
    ("pool_mapped_bytes", "mapped_bytes", "Physical bytes mapped into the pool's virtual range."),
    ("pool_allocated_bytes", "allocated_bytes", "Bytes in live blocks handed out by the pool."),
    ("pool_reserved_va_bytes", "reserved_va_bytes", "Virtual address space reserved (no memory)."),
    ("pool_fragmentation_ratio", "fragmentation", "1 - peak allocated / peak mapped."),
    ("pool_peak_allocated_bytes", "peak_allocated_bytes", "Highest allocated_bytes seen."),
    ("pool_peak_mapped_bytes", "peak_mapped_bytes", "Highest mapped_bytes seen."),
    ("pool_handle_cache_pages", "handle_cache_pages", "Physical pages created, not mapped."),
]
_POOL_COUNTERS = [
    ("pool_maps", "num_maps", "Pages mapped."),
    ("pool_unmaps", "num_unmaps", "Pages unmapped."),
    ("pool_oom", "num_ooms", "Allocations that failed for lack of memory."),
    ("pool_pages_lent", "pages_lent", "Freed pages whose memory went to the stream's next block."),
]


def _latency_histogram(stats: dict) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets (seconds) and the sum, from the pool's per-bucket counts."""
    n = float(stats.get("num_maps", 0))
    total_s = float(stats.get("mean_map_latency_us", 0.0)) * n * 1e-6
    raw = stats.get("map_latency_hist") or stats.get("map_latency_histogram")
    if not raw:  # no histogram from this pool: everything lands in +Inf, sum still right
        return [("+Inf", n)], total_s
    buckets, running = [], 0.0
    for bound_us, count in zip(LATENCY_BUCKETS_US, raw[:-1]):
        running += float(count)
        buckets.append((repr(bound_us * 1e-6), running))
    buckets.append(("+Inf", running + float(sum(raw[len(LATENCY_BUCKETS_US) :]))))
    return buckets, total_s


def _pool_metrics(snaps: list[tuple[str, dict]]) -> Iterator[Metric]:
    labels = ["device", "pool", "backend"]
    fams: dict[str, Metric] = {}
    for name, _, doc in _POOL_GAUGES:
        fams[name] = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
    for name, _, doc in _POOL_COUNTERS:
        fams[name] = CounterMetricFamily(PREFIX + name, doc, labels=labels)
    hist = HistogramMetricFamily(
        PREFIX + "pool_map_latency_seconds", "Map + set-access time per page.", labels=labels
    )
    for pool, s in snaps:
        values = [str(s.get("device", 0)), pool, str(s.get("backend", "?"))]
        for name, key, _ in _POOL_GAUGES + _POOL_COUNTERS:
            fams[name].add_metric(values, float(s.get(key, 0) or 0))
        buckets, total = _latency_histogram(s)
        hist.add_metric(values, buckets, sum_value=total)
    yield from fams.values()
    yield hist


def _kv_metrics() -> Iterator[Metric]:
    usage = GaugeMetricFamily(
        PREFIX + "kv_cache_usage_perc",
        "Share of the KV budget in use per tier (0..1, 1 = full).",
        labels=["device", "tier"],
    )
    blocks = GaugeMetricFamily(
        PREFIX + "kv_blocks", "KV blocks by state.", labels=["device", "state"]
    )
    for dev, fig in _kv_figures().items():
        for tier in sorted({"gpu", "cpu"} | set(fig["tier"])):
            usage.add_metric([dev, tier], fig["tier"].get(tier, 0.0))
        for state in sorted({"free", "used", "shared"} | set(fig["blocks"])):
            blocks.add_metric([dev, state], fig["blocks"].get(state, 0))
    yield usage
    yield blocks


def _tier_and_scheduler_metrics() -> Iterator[Metric]:
    tier = (_tier_source() if _tier_source else None) or _kv_tier_figures()
    hot = GaugeMetricFamily(
        PREFIX + "hot_zone_hit_ratio",
        "Share of KV accesses served from the hot zone (>0.85).",
        labels=["device"],
    )
    hot.add_metric([str(tier.get("device", 0))], float(tier.get("hot_zone_hit_ratio", 0.0)))
    mig = CounterMetricFamily(
        PREFIX + "migration_bytes", "Bytes moved between tiers.", labels=["device", "direction"]
    )
    moved = {"gpu_to_cpu": 0, "cpu_to_gpu": 0, **tier.get("migration_bytes", {})}
    for direction, n in sorted(moved.items()):
        mig.add_metric([str(tier.get("device", 0)), direction], float(n))
    held = GaugeMetricFamily(
        PREFIX + "tier_bytes", "KV bytes held per tier.", labels=["device", "tier"]
    )
    for name, n in sorted({"gpu": 0, "cpu": 0, **tier.get("tier_bytes", {})}.items()):
        held.add_metric([str(tier.get("device", 0)), name], float(n))
    prefix = CounterMetricFamily(
        PREFIX + "prefix_cache_lookups",
        "Prompt rows looked up in the prefix cache, by result.",
        labels=["device", "result"],
    )
    for result, key in (("hit", "hits"), ("miss", "misses")):
        n = tier.get("prefix_cache", {}).get(key, 0)
        prefix.add_metric([str(tier.get("device", 0)), result], float(n))
    hit_blocks = CounterMetricFamily(
        PREFIX + "prefix_cache_hit_blocks",
        "Prefix-cache blocks a hit took, by where they were found (gpu: hot, cpu: the CPU tier).",
        labels=["device", "zone"],
    )
    for zone in ("gpu", "cpu"):
        n = tier.get("prefix_cache", {}).get(zone + "_hit_blocks", 0)
        hit_blocks.add_metric([str(tier.get("device", 0)), zone], float(n))
    sched = (_scheduler_source() if _scheduler_source else None) or {}
    if not sched:  # the multi-task engine's own figure
        _, counts, total = ENGINE.snapshot()["balance"]
        sched = {"buckets": counts, "sum": total}
    counts = list(sched.get("buckets", [])) or [0] * (len(WEIGHT_VARIANCE_BUCKETS) + 1)
    var = _histogram(
        "scheduler_weight_variance",
        "Achieved / intended share per task and round (healthy 0.9-1.1).",
        ["device"],
        [([str(sched.get("device", 0))], (WEIGHT_VARIANCE_BUCKETS, counts, sched.get("sum", 0)))],
    )
    yield from (hot, mig, held, prefix, hit_blocks, var)


def _histogram(name: str, doc: str, labels: list[str], series) -> HistogramMetricFamily:
    """series: [(label values, (bounds, counts per bucket then +Inf, sum))]."""
    fam = HistogramMetricFamily(PREFIX + name, doc, labels=labels)
    for values, (bounds, counts, total) in series:
        cumulative, running = [], 0.0
        for bound, count in zip([*map(repr, map(float, bounds)), "+Inf"], counts):
            running += float(count)
            cumulative.append((bound, running))
        fam.add_metric(values, cumulative, sum_value=float(total))
    return fam


def _engine_metrics() -> Iterator[Metric]:
    """The multi-task engine (concurrent generate() calls merged step by step)."""
    snap = ENGINE.snapshot()
    yield _histogram(
        "task_time_to_first_token_seconds", "Time from a generate() call to its first token.",
        ["class"], [([k], v) for k, v in sorted(snap["ttft"].items())],
    )  # fmt: skip
    yield _histogram(
        "task_time_per_output_token_seconds", "Time between a call's tokens after the first.",
        ["class"], [([k], v) for k, v in sorted(snap["tpot"].items())],
    )  # fmt: skip
    yield _histogram("engine_step_batch_size", "Sequences served per merged step.", [],
                     [([], snap["batch"])])  # fmt: skip
    g = snap["gauges"]
    depth = GaugeMetricFamily(PREFIX + "engine_queue_depth", "Requests waiting for a step.")
    depth.add_metric([], float(g["queued"]))
    tasks = GaugeMetricFamily(
        PREFIX + "engine_tasks", "Live generate() calls by state.", labels=["state"]
    )
    for state in ("running", "waiting", "preempted"):
        tasks.add_metric([state], float(g[state]))
    c = snap["counters"]
    steps = CounterMetricFamily(PREFIX + "engine_steps", "Merged steps run.")
    steps.add_metric([], float(c["steps"]))
    pre = CounterMetricFamily(PREFIX + "engine_preemptions", "Calls preempted (KV recomputed).")
    pre.add_metric([], float(c["preemptions"]))
    tokens = CounterMetricFamily(PREFIX + "engine_tokens", "Tokens computed by engine steps.")
    tokens.add_metric([], float(c["tokens"]))
    yield from (depth, tasks, steps, pre, tokens)
    yield _histogram(
        "engine_step_seconds",
        "An engine step: its period (one step's tokens read to the next's), its host work "
        "(choose, build, launch) and its GPU time.",
        ["part"], [([k], v) for k, v in sorted(snap["step_time"].items())],
    )  # fmt: skip
    yield _histogram("engine_step_rows", "Rows an engine step serves.", [],
                     [([], snap["step_rows"])])  # fmt: skip
    yield _histogram("engine_step_tokens", "Tokens an engine step computes.", [],
                     [([], snap["step_tokens"])])  # fmt: skip
    gpu = snap["gpu"]
    busy = CounterMetricFamily(
        PREFIX + "engine_gpu_seconds",
        "GPU time of engine steps, and the GPU's idle gaps between back-to-back steps.",
        labels=["state"],
    )
    busy.add_metric(["busy"], gpu["busy_seconds"])
    busy.add_metric(["idle"], gpu["idle_seconds"])
    total = gpu["busy_seconds"] + gpu["idle_seconds"]
    frac = GaugeMetricFamily(
        PREFIX + "engine_gpu_idle_fraction",
        "The GPU's idle share between back-to-back engine steps since start (goal: <= 0.1).",
    )
    frac.add_metric([], gpu["idle_seconds"] / total if total else 0.0)
    yield from (busy, frac)
    if gc_watch.installed():  # (an engine was made: engine/gc_watch.py)
        pauses = CounterMetricFamily(
            PREFIX + "gc_pause_seconds",
            "The interpreter's garbage-collection pauses since the first engine (every thread "
            "stops for them).",
        )
        pauses.add_metric([], gc_watch.pause_s)
        full = CounterMetricFamily(
            PREFIX + "gc_full_collections",
            "Full (generation 2) collections since the first engine.",
        )
        full.add_metric([], float(gc_watch.full))
        yield from (pauses, full)


class OxygenCollector:
    """Reads every source when scraped; holds no state of its own."""

    def collect(self) -> Iterator[Metric]:
        yield from _pool_metrics(pool_snapshots())
        yield from _kv_metrics()
        yield from _tier_and_scheduler_metrics()
        yield from _engine_metrics()


_registry = CollectorRegistry(auto_describe=False)
_registry.register(OxygenCollector())
_servers: list[Any] = []


def registry() -> CollectorRegistry:
    """The registry holding oxygen's collector (separate from prometheus_client's default)."""
    return _registry


def scrape() -> str:
    """The exposition text ``/metrics`` would serve now."""
    return generate_latest(_registry).decode()


def start_http_server(port: int = DEFAULT_PORT, addr: str = "127.0.0.1", **limits: Any) -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the server
    (``.server_address``, ``.shutdown()``). Loopback only unless ``addr`` says otherwise:
    the figures describe the machine's memory and need no wider audience by default.
    ``port=0`` picks a free port. Threads and idle connections are bounded (metrics_server.py;
    ``limits``: workers, idle_timeout_s, request_timeout_s, max_waiting)."""
    server = metrics_server.serve(addr, port, make_wsgi_app(_registry), **limits)
    _servers.append(server)
    return server


def stop_http_servers() -> None:
    while _servers:
        server = _servers.pop()
        server.shutdown()
        server.server_close()
