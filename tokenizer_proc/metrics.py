"""Prometheus metrics of the whole service, served by the API process on ``/metrics``.

``ServiceMetrics`` holds the scheduler's series (``scheduler_gauges.py``), the request metrics
(``request_metrics.py``) and the LoRA series (``lora_metrics.py``); under
``--disable-metrics`` ``NoMetrics`` stands in: it observes nothing and ``/metrics`` is empty.
With several API workers (``--api-workers``) each keeps its values in prometheus-client's
multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor) and any of them
renders the sum of all; the scheduler's gauges are set by worker 0 alone ("mostrecent").
Names carry the ``tokenpipe:`` prefix and the ``model_name`` / ``engine_type`` labels
(docs/design.md section 7), or a peer family's names under ``--metrics-compat``
(``tokenizer_proc/metrics_compat.py``); the HTTP series are the ecosystem's own under every
family (``tokenizer_proc/http_counters.py``).
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.types import ASGIApp

from pipeline.config import MetricsCompat, ServerConfig
from pipeline.io_struct import SchedulerStatsReport
from tokenizer_proc.http_counters import HttpCounters, http_observer
from tokenizer_proc.lora_metrics import LoraMetrics, NoLoraMetrics
from tokenizer_proc.metrics_compat import Naming
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_metrics import RequestMetrics
from tokenizer_proc.scheduler_gauges import SchedulerGauges

# A `*_created` series per counter and histogram doubles the scrape for no use here.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ServiceMetrics:
    def __init__(
        self,
        model_name: str,
        engine_type: str = "unified",
        registry: CollectorRegistry | None = None,
        *,
        multiprocess: bool = False,
        compat: MetricsCompat = "tokenpipe",
        # vLLM's token-count buckets reach it: only --metrics-compat vllm needs it.
        context_length: int = 0,
        kv_dtype: str = "auto",  # --dtype, which vLLM's cache config info names
        lora: bool = False,  # adapters are served: the LoRA series are kept
        num_speculative_tokens: int = 0,  # drafts per request per step; 0: no speculation
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess
        naming = Naming(compat, self.registry, model_name, engine_type, context_length)
        self.scheduler = SchedulerGauges(naming, kv_dtype, num_speculative_tokens)
        self.requests = RequestMetrics(naming)
        self.lora: LoraMetrics | NoLoraMetrics = LoraMetrics(naming) if lora else NoLoraMetrics()
        # The ecosystem's own names (vLLM's, from prometheus-fastapi-instrumentator) under
        # every --metrics-compat family.
        self._observe_http = http_observer(self.registry)

    def count_http(self, edge: ASGIApp, routes: FastAPI) -> ASGIApp:
        """``edge`` with every answer counted in the HTTP series (``HttpCounters``)."""
        return HttpCounters(edge, routes, self._observe_http)

    def render(self) -> bytes:
        if self.multiprocess:
            # Read afresh from every worker's files on each scrape, as prometheus-client's
            # multiprocess mode asks.
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)


class NoSchedulerGauges:
    """The scheduler's gauges under ``--disable-metrics``: a report sets nothing."""

    def update(self, report: SchedulerStatsReport) -> None:
        pass


class NoRequestMetrics:
    """``RequestMetrics`` under ``--disable-metrics``: every observation goes nowhere."""

    # The output loop skips ``on_tokens`` on this, rather than call a no-op once per row.
    observes_tokens = False

    def on_tokens(
        self, state: ReqState, num_tokens: int, previous_token_time: float | None, now: float
    ) -> None:
        pass

    def end_frame(self) -> None:
        pass

    def on_sse_stream(self, direct: bool) -> None:
        pass

    def on_rejected(self, reason: str) -> None:
        pass

    def on_lost(self, state: ReqState) -> None:
        pass

    def on_tool_answer(self, finish_reason: str, calls: int) -> None:
        pass

    def on_finish(self, state: ReqState) -> None:
        pass


class NoMetrics:
    """``--disable-metrics``: the same interface as ``ServiceMetrics``, observing nothing;
    ``/metrics`` serves an empty body."""

    def __init__(self) -> None:
        self.scheduler = NoSchedulerGauges()
        self.requests = NoRequestMetrics()
        self.lora = NoLoraMetrics()

    def count_http(self, edge: ASGIApp, routes: FastAPI) -> ASGIApp:
        return edge

    def render(self) -> bytes:
        return b""


Metrics = ServiceMetrics | NoMetrics


def service_metrics(config: ServerConfig, model_name: str, context_length: int) -> Metrics:
    """The metrics this server keeps: ``ServiceMetrics``, or ``NoMetrics`` when they are off."""
    if not config.enable_metrics:
        return NoMetrics()
    spec = config.speculative
    return ServiceMetrics(
        model_name,
        config.engine_type,
        multiprocess=config.api_workers > 1,
        compat=config.metrics_compat,
        context_length=context_length,
        kv_dtype=config.dtype,
        lora=config.lora_enabled,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
    )
