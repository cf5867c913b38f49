"""/metrics: oxygen's Prometheus text (tools/metrics.py), then the server's own figures.

The engine labels its time-to-first-token and time-per-token histograms by priority class; the
server admits only the three named classes (protocol.py), so that label takes three values
whatever clients send. The server's own labels are closed sets too (outcomes below)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import metrics
from .jobs import Admission

OUTCOMES = ("ok", "error", "cancelled", "rejected", "refused")


class _Collector:
    def __init__(self, admission: Admission):
        self.admission = admission

    def collect(self):
        a = self.admission
        with a.lock:
            waiting, running, counts = a.waiting, a.running, dict(a.counts)
        g = GaugeMetricFamily(
            metrics.PREFIX + "serve_requests", "HTTP requests in the server by state.",
            labels=["state"],
        )  # fmt: skip
        g.add_metric(["waiting"], float(waiting))  # no token yet (what --max-queue bounds)
        g.add_metric(["running"], float(running))
        yield g
        limit = GaugeMetricFamily(metrics.PREFIX + "serve_max_queue", "The --max-queue limit.")
        limit.add_metric([], float(a.max_queue))
        yield limit
        c = CounterMetricFamily(
            metrics.PREFIX + "serve_requests_finished",
            "Generation requests by outcome: ok, error (the call failed), cancelled (the client "
            "left), rejected (429: queue full), refused (400 after admission: too long, ...).",
            labels=["outcome"],
        )  # fmt: skip
        for outcome in OUTCOMES:
            c.add_metric([outcome], float(counts.get(outcome, 0)))
        yield c


def text(admission: Admission, oxygen: str) -> str:
    """oxygen's text (this process's `metrics.scrape()`, or the engine process's), then the
    server's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(admission))
    return oxygen + generate_latest(registry).decode()
