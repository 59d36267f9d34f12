"""Prometheus metrics of the whole service, served by the API process on ``/metrics``.

The scheduler's gauges arrive as ``SchedulerStatsReport`` frames and are set here, so one
endpoint covers every process without a multiprocess directory. Names carry the
``tokenpipe:`` prefix and the ``model_name`` / ``engine_type`` labels (SPEC section 7).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pipeline.io_struct import SchedulerStatsReport

PREFIX = "tokenpipe:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class SchedulerGauges:
    """The scheduler metrics of SPEC section 4."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=registry).labels(**labels)

        self.num_running_reqs = gauge("num_running_reqs", "Requests admitted to the running batch (decoding or mid-prefill).")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting for admission.")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool held by requests (evictable prefix cache excluded).")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix-cache hits over prompt tokens of recent prefills.")
        self.gen_throughput = gauge("gen_throughput", "Generated tokens per second.")
        self.num_retracted_reqs = gauge("num_retracted_reqs", "Requests retracted in the last report interval.")
        self._retracted_total = Counter(
            PREFIX + "num_retracted_requests", "Retractions since the scheduler started.", names, registry=registry
        ).labels(**labels)
        self._retracted_seen = 0
        self.last_report: SchedulerStatsReport | None = None

    def update(self, report: SchedulerStatsReport) -> None:
        self.num_running_reqs.set(report.num_running_reqs)
        self.num_queue_reqs.set(report.num_queue_reqs)
        self.token_usage.set(report.token_usage)
        self.cache_hit_rate.set(report.cache_hit_rate)
        self.gen_throughput.set(report.gen_throughput)
        self.num_retracted_reqs.set(report.num_retracted_reqs)
        # The scheduler reports a running total; a counter only moves by the difference.
        if report.num_retracted_requests_total > self._retracted_seen:
            self._retracted_total.inc(report.num_retracted_requests_total - self._retracted_seen)
            self._retracted_seen = report.num_retracted_requests_total
        self.last_report = report


class ServiceMetrics:
    def __init__(self, model_name: str, engine_type: str = "unified") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = {"model_name": model_name, "engine_type": engine_type}
        self.scheduler = SchedulerGauges(self.registry, self.labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)
