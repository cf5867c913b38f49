"""`python -m oxygen_torch stats`: in-process and through a running process's endpoint."""

import json
import subprocess
import sys

import pytest

from oxygen_torch.pool import VirtualPool
from oxygen_torch.tools import cli, cli_stats, metrics

MiB = 1 << 20


@pytest.fixture
def pool():
    p = VirtualPool(backend="host", capacity=64 * MiB)
    metrics.register_pool(p, name="stats-test")
    ptr = p.malloc(6 * MiB)
    yield p
    p.free(ptr)
    metrics.unregister_pool(p)
    p.close()


def test_in_process_table_shows_the_pool(pool, capsys):
    assert cli.main(["stats"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[0] == "statistic" and "stats-test" in header and "global" in header
    row = next(line for line in out.splitlines() if line.startswith("allocated_bytes "))
    assert "6.0 MiB" in row  # 6 MiB live in the test pool, shown readable
    assert any(line.startswith("mapped_bytes ") for line in out.splitlines())


def test_stats_from_a_running_endpoint(pool):
    server = metrics.start_http_server(port=0)
    url = f"http://127.0.0.1:{server.socket.getsockname()[1]}/metrics"
    try:
        # A separate process reads this one's endpoint, as a user would.
        r = subprocess.run(
            [sys.executable, "-m", "oxygen_torch", "stats", "--url", url, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        remote = json.loads(r.stdout)["stats-test"]
        local = pool.stats()
        for key in ("allocated_bytes", "mapped_bytes", "reserved_va_bytes", "num_maps"):
            assert remote[key] == local[key], key
        assert remote["backend"] == "host" and remote["device"] == 0
        assert remote["mean_map_latency_us"] == pytest.approx(local["mean_map_latency_us"])
        assert "kv_blocks[free]" in json.loads(r.stdout)["kv/tiers"]
        table = cli_stats.render(url)
        assert "stats-test" in table.splitlines()[0]
    finally:
        metrics.stop_http_servers()


def test_stats_reports_an_unreachable_endpoint(capsys):
    assert cli.main(["stats", "--url", "http://127.0.0.1:9/metrics"]) == 1
    assert "cannot read" in capsys.readouterr().out
    assert cli.main(["stats", "--url", "file:///etc/passwd"]) == 1


def test_human_readable_figures():
    assert cli_stats._human("mapped_bytes", 3 * MiB) == "3.0 MiB"
    assert cli_stats._human("mapped_bytes", 100) == "100 B"
    assert cli_stats._human("num_maps", 12345) == "12,345"
    assert cli_stats._human("fragmentation", 0.123456) == "0.1235"
