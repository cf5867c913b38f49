"""python -m oxygen_torch stats [--url URL] [--json]

Prints ``memory_stats()`` as a table: of this process (the global pool and any registered
``VirtualPool``; useful as ``oxygen_torch.tools.cli_stats.render()`` from inside a program), or of a
running process through its metrics endpoint (``--url http://127.0.0.1:9400/metrics``).
"""

from __future__ import annotations

import argparse
import json
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from . import metrics

# Exposition name (without prefix) -> memory_stats() key, for reading an endpoint back.
_FROM_METRIC = {name: key for name, key, _ in metrics._POOL_GAUGES}
_FROM_METRIC.update({name + "_total": key for name, key, _ in metrics._POOL_COUNTERS})
_FROM_METRIC.update({name: key for name, key, _ in metrics._POOL_COUNTERS})


def _human(key: str, value) -> str:
    if isinstance(value, (int, float)) and key.endswith("bytes"):
        v, unit = float(value), "B"
        for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
            if abs(v) < 1024 or unit == "TiB":
                break
            v /= 1024
        return f"{int(value):,} B" if unit == "B" else f"{v:,.1f} {unit}"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ",".join(str(x) for x in value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def format_table(pools: list[tuple[str, dict]]) -> str:
    """One column per pool, one row per statistic, in the order the first pool lists them."""
    if not pools:
        return "no pool in this process (oxygen_torch not enabled, no VirtualPool registered)"
    keys: list[str] = []
    for _, stats in pools:
        keys += [k for k in stats if k not in keys]
    header = ["statistic", *(label for label, _ in pools)]
    rows = [[k, *(_human(k, s[k]) if k in s else "-" for _, s in pools)] for k in keys]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        first = cells[0].ljust(widths[0])
        return "  ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:]))])

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, rows)])


def from_exposition(text: str) -> list[tuple[str, dict]]:
    """Rebuild per-pool statistics (and one ``kv/tiers`` column) from ``/metrics`` text."""
    pools: dict[str, dict] = {}
    extra: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name.removeprefix(metrics.PREFIX)
        for s in fam.samples:
            short = s.name.removeprefix(metrics.PREFIX)
            if "pool" in s.labels:
                st = pools.setdefault(s.labels["pool"], {})
                st.setdefault("backend", s.labels.get("backend", "?"))
                st.setdefault("device", int(s.labels.get("device", 0)))
                if short in _FROM_METRIC:
                    st[_FROM_METRIC[short]] = _number(s.value)
                elif short == "pool_map_latency_seconds_sum":
                    st["_lat_sum"] = s.value
                elif short == "pool_map_latency_seconds_count":
                    st["_lat_count"] = s.value
            elif not short.endswith("_bucket") and not name.startswith("pool_"):
                tag = ",".join(f"{v}" for k, v in sorted(s.labels.items()) if k != "device")
                extra[short + (f"[{tag}]" if tag else "")] = _number(s.value)
    out = []
    for label, st in pools.items():
        n, total = st.pop("_lat_count", 0), st.pop("_lat_sum", 0.0)
        st["mean_map_latency_us"] = total / n * 1e6 if n else 0.0
        out.append((label, st))
    if extra:
        out.append(("kv/tiers", extra))
    return out


def _number(v: float):
    return int(v) if float(v).is_integer() else v


def fetch(url: str, timeout: float = 5.0) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be an http(s) URL, got {url!r}")
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (scheme checked)
        return resp.read().decode()


def render(url: str | None = None) -> str:
    """The table ``stats`` prints: this process's pools, or those behind ``url``."""
    return format_table(from_exposition(fetch(url)) if url else metrics.pool_snapshots())


def stats(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxygen_torch stats", description=__doc__)
    parser.add_argument(
        "--url",
        help="a running process's metrics endpoint, e.g. "
        f"http://127.0.0.1:{metrics.DEFAULT_PORT}/metrics",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        pools = from_exposition(fetch(args.url)) if args.url else metrics.pool_snapshots()
    except (OSError, ValueError) as exc:
        print(f"stats: cannot read {args.url}: {exc}")
        return 1
    print(json.dumps(dict(pools), indent=2, default=str) if args.json else format_table(pools))
    return 0
