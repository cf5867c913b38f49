"""The Prometheus exporter: every named metric with its type, values that follow a host pool,
loopback-only binding, and the KV / tier / scheduler sources."""

import socket
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from oxygen_torch.pool import VirtualPool
from oxygen_torch.tools import metrics

MiB = 1 << 20

EXPECTED_TYPES = {
    "oxygen:pool_mapped_bytes": "gauge",
    "oxygen:pool_allocated_bytes": "gauge",
    "oxygen:pool_reserved_va_bytes": "gauge",
    "oxygen:pool_fragmentation_ratio": "gauge",
    "oxygen:pool_maps": "counter",  # the parser strips _total from counter family names
    "oxygen:pool_unmaps": "counter",
    "oxygen:pool_map_latency_seconds": "histogram",
    "oxygen:pool_oom": "counter",
    "oxygen:pool_pages_lent": "counter",
    "oxygen:kv_cache_usage_perc": "gauge",
    "oxygen:kv_blocks": "gauge",
    "oxygen:hot_zone_hit_ratio": "gauge",
    "oxygen:migration_bytes": "counter",
    "oxygen:scheduler_weight_variance": "histogram",
}


@pytest.fixture
def pool():
    p = VirtualPool(backend="host", capacity=128 * MiB)
    metrics.register_pool(p, name="test")
    yield p
    metrics.unregister_pool(p)
    p.close()


def families(text=None):
    return {f.name: f for f in text_string_to_metric_families(text or metrics.scrape())}


def value(fams, family, sample_name=None, **labels):
    """The one sample of ``family`` whose labels include ``labels``."""
    found = [
        s.value
        for s in fams[family].samples
        if (sample_name is None or s.name == sample_name)
        and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (family, labels, fams[family].samples)
    return found[0]


def test_every_named_metric_is_served_with_its_type(pool):
    fams = families()
    for name, kind in EXPECTED_TYPES.items():
        assert name in fams, f"{name} missing"
        assert fams[name].type == kind, (name, fams[name].type)
        assert fams[name].samples, f"{name} has no sample"
        assert all("device" in s.labels for s in fams[name].samples), name
    text = metrics.scrape()
    for counter in ("pool_maps", "pool_unmaps", "pool_oom", "migration_bytes"):
        assert f"oxygen:{counter}_total{{" in text


def test_values_follow_a_host_pool(pool):
    before = families()
    ptr = pool.malloc(8 * MiB)
    during = families()
    assert value(during, "oxygen:pool_allocated_bytes", pool="test") >= 8 * MiB
    assert value(during, "oxygen:pool_mapped_bytes", pool="test") >= 8 * MiB
    assert value(during, "oxygen:pool_reserved_va_bytes", pool="test") >= 128 * MiB
    maps = value(during, "oxygen:pool_maps", "oxygen:pool_maps_total", pool="test")
    assert maps >= 4 > value(before, "oxygen:pool_maps", "oxygen:pool_maps_total", pool="test")
    count = "oxygen:pool_map_latency_seconds_count"
    assert value(during, "oxygen:pool_map_latency_seconds", count, pool="test") == maps
    inf = value(
        during,
        "oxygen:pool_map_latency_seconds",
        "oxygen:pool_map_latency_seconds_bucket",
        pool="test",
        le="+Inf",
    )
    assert inf == maps  # the histogram's buckets account for every mapped page
    pool.free(ptr)
    pool.empty_cache()
    after = families()
    assert value(after, "oxygen:pool_allocated_bytes", pool="test") == 0
    assert value(after, "oxygen:pool_mapped_bytes", pool="test") == 0
    assert value(after, "oxygen:pool_unmaps", "oxygen:pool_unmaps_total", pool="test") >= 4
    assert value(after, "oxygen:pool_peak_allocated_bytes", pool="test") >= 8 * MiB


def test_closed_pool_is_no_longer_reported():
    p = VirtualPool(backend="host", capacity=64 * MiB)
    metrics.register_pool(p, name="closing")
    assert 'pool="closing"' in metrics.scrape()
    p.close()
    assert 'pool="closing"' not in metrics.scrape()


def test_server_answers_on_loopback_only(pool):
    server = metrics.start_http_server(port=0)
    try:
        host, port = server.socket.getsockname()[:2]
        assert host == "127.0.0.1"  # bound to loopback, not 0.0.0.0 or a public address
        assert server.socket.family == socket.AF_INET
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert value(families(text), "oxygen:pool_reserved_va_bytes", pool="test") > 0
        assert _listening_addresses(port) == {"127.0.0.1"}
        for addr in _non_loopback_addresses():
            with pytest.raises(OSError):
                socket.create_connection((addr, port), timeout=1).close()
    finally:
        metrics.stop_http_servers()


def _listening_addresses(port):
    """Local addresses of the sockets listening on ``port``, as the kernel lists them."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:  # 0A: TCP_LISTEN
                raw = bytes.fromhex(addr)
                if len(raw) == 4:
                    found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                else:
                    found.add(table + ":" + addr)  # any IPv6 listener is a failure here
    return found


def _non_loopback_addresses():
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return []
    return sorted({i[4][0] for i in infos if not i[4][0].startswith("127.")})


def test_kv_source_is_reported_and_dropped_when_it_returns_none():
    figures = {"device": 0, "tier": {"gpu": 0.25}, "blocks": {"free": 30, "used": 10, "shared": 2}}
    answers = [figures, None]
    fn = lambda: answers[0]
    fams = families()
    assert value(fams, "oxygen:kv_blocks", state="used") == 0  # nothing registered: zeros
    metrics.register_kv_source(fn)
    try:
        fams = families()
        assert value(fams, "oxygen:kv_blocks", state="used") == 10
        assert value(fams, "oxygen:kv_blocks", state="shared") == 2
        assert value(fams, "oxygen:kv_cache_usage_perc", tier="gpu") == 0.25
        assert value(fams, "oxygen:kv_cache_usage_perc", tier="cpu") == 0.0
        answers.pop(0)
        families()  # the source answers None: unregistered
        assert fn not in metrics._kv_sources
    finally:
        metrics.unregister_kv_source(fn)


def test_tier_and_scheduler_sources():
    metrics.register_tier_source(
        lambda: {"hot_zone_hit_ratio": 0.9, "migration_bytes": {"gpu_to_cpu": 4096}}
    )
    counts = [0, 0, 0, 1, 5, 3, 1, 0, 0, 0, 0]  # one per bound, then +Inf
    metrics.register_scheduler_source(lambda: {"buckets": counts, "sum": 10.0})
    try:
        fams = families()
        assert value(fams, "oxygen:hot_zone_hit_ratio") == 0.9
        mig = "oxygen:migration_bytes_total"
        assert value(fams, "oxygen:migration_bytes", mig, direction="gpu_to_cpu") == 4096
        assert value(fams, "oxygen:migration_bytes", mig, direction="cpu_to_gpu") == 0
        var = "oxygen:scheduler_weight_variance"
        assert value(fams, var, var + "_bucket", le="1.1") == 10
        assert value(fams, var, var + "_count") == 10
    finally:
        metrics.register_tier_source(None)
        metrics.register_scheduler_source(None)
    assert value(families(), "oxygen:hot_zone_hit_ratio") == 0.0


def test_latency_histogram_from_native_buckets():
    raw = [0] * 16
    raw[3], raw[5], raw[15] = 2, 1, 1  # < 8 us, < 32 us, slower than 2**14 us
    buckets, total = metrics._latency_histogram(
        {"num_maps": 4, "mean_map_latency_us": 10.0, "map_latency_hist": raw}
    )
    as_dict = dict(buckets)
    assert as_dict[repr(8e-6)] == 2 and as_dict[repr(16e-6)] == 2 and as_dict[repr(32e-6)] == 3
    assert as_dict["+Inf"] == 4 and len(buckets) == 16
    assert total == pytest.approx(40e-6)


def test_kv_pools_are_reported_until_a_source_registers(monkeypatch):
    import types

    fake = types.SimpleNamespace(
        pool_stats=lambda: [
            {"device": "cuda:0", "blocks_total": 100, "blocks_used": 25},
            {"device": "cpu", "blocks_total": 10, "blocks_used": 5},
        ]
    )
    monkeypatch.setitem(sys.modules, "oxygen_torch.kv.pool", fake)
    fams = families()
    assert value(fams, "oxygen:kv_blocks", state="used") == 30
    assert value(fams, "oxygen:kv_blocks", state="free") == 80
    assert value(fams, "oxygen:kv_cache_usage_perc", tier="gpu") == 0.25
    assert value(fams, "oxygen:kv_cache_usage_perc", tier="cpu") == 0.5


def _scrape(port, timeout=5):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as r:
        return r.read().decode()


def test_idle_connections_neither_make_threads_nor_stay_open(pool):
    """prometheus_client's own server kept one thread per idle connection: 200 idle connections
    made 203 threads, for as long as the clients wanted."""
    import threading
    import time

    before = threading.active_count()
    server = metrics.start_http_server(port=0, idle_timeout_s=1.5, request_timeout_s=1.0)
    port = server.socket.getsockname()[1]
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(200)]
    half = socket.create_connection(("127.0.0.1", port), timeout=5)
    half.sendall(b"GET /metrics HTTP/1.1\r\n")  # half a request, then silence
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        text = _scrape(port)  # served at once, 201 connections notwithstanding
        assert time.monotonic() - t0 < 1.0
        assert value(families(text), "oxygen:pool_reserved_va_bytes", pool="test") > 0
        assert threading.active_count() - before <= 2 + 4  # accept loop, watcher, <= 4 workers
        time.sleep(2.0)  # past both timeouts: the server has closed all of them
        for s in [*idle, half]:
            s.settimeout(1)
            assert s.recv(1) == b"", "an idle connection is still open"
        assert threading.active_count() - before <= 6
        assert "oxygen:pool_mapped_bytes" in _scrape(port)
    finally:
        for s in [*idle, half]:
            s.close()
        metrics.stop_http_servers()
    time.sleep(0.2)
    assert threading.active_count() <= before + 1


@pytest.mark.parametrize("port", ["in use", -1, 70000])
def test_a_port_in_use_or_out_of_range_is_an_error_naming_it(port):
    """socketserver calls server_close() when bind() fails, before the server's own __init__ had
    set what that closes: an AttributeError ('_closed') came out instead of these."""
    import errno
    import threading

    before = set(threading.enumerate())
    taken = socket.socket()
    try:
        if port == "in use":
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(OSError, match=f"127.0.0.1:{port}: .*in use") as info:
                metrics.start_http_server(port=port)
            assert info.value.errno == errno.EADDRINUSE
        else:
            with pytest.raises(ValueError, match=f"port {port} is out of range; allowed: 0 to"):
                metrics.start_http_server(port=port)
    finally:
        taken.close()
    assert not set(threading.enumerate()) - before  # no watcher left behind
    server = metrics.start_http_server(port=0)  # the next one starts as usual
    try:
        assert "oxygen:pool_mapped_bytes" in _scrape(server.socket.getsockname()[1])
    finally:
        metrics.stop_http_servers()
