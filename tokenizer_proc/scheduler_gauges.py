"""The scheduler's gauges on ``/metrics``, set from the ``SchedulerStatsReport`` frames that
reach the API process through the detokenizer, so one endpoint covers every process."""

from __future__ import annotations

from prometheus_client import Gauge

from pipeline.io_struct import SchedulerStatsReport
from tokenizer_proc.metrics_compat import Naming, one_child
from tokenizer_proc.tally_histogram import TallyHistogram


class SchedulerGauges:
    """The scheduler metrics of docs/design.md section 4."""

    def __init__(self, naming: Naming) -> None:
        def gauge(key: str, doc: str) -> Gauge:
            return naming.gauge(key, doc)()

        self.num_running_reqs = gauge(
            "num_running_reqs", "Requests admitted to the running batch (decoding or mid-prefill)."
        )
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting for admission.")
        self.token_usage = gauge(
            "token_usage",
            "Fraction of the KV pool held by requests (evictable prefix cache excluded).",
        )
        self.cache_hit_rate = gauge(
            "cache_hit_rate", "Prefix-cache hits over prompt tokens of recent prefills."
        )
        self.gen_throughput = gauge("gen_throughput", "Generated tokens per second.")
        self.num_retracted_reqs = gauge(
            "num_retracted_reqs", "Requests retracted in the last report interval."
        )
        self.torch_threads = gauge(
            "torch_threads",
            "The scheduler's torch intra-op threads (--torch-threads, or the idle cores).",
        )
        self._retracted_total = naming.counter(
            "num_retracted_requests", "Retractions since the scheduler started."
        )()
        self._retracted_seen = 0
        self._peers = SchedulerPeerSeries(naming)
        self.last_report: SchedulerStatsReport | None = None

    def update(self, report: SchedulerStatsReport) -> None:
        self.num_running_reqs.set(report.num_running_reqs)
        self.num_queue_reqs.set(report.num_queue_reqs)
        self.token_usage.set(report.token_usage)
        self.cache_hit_rate.set(report.cache_hit_rate)
        self.gen_throughput.set(report.gen_throughput)
        self.num_retracted_reqs.set(report.num_retracted_reqs)
        self.torch_threads.set(report.torch_threads)
        # The scheduler reports a running total; a counter only moves by the difference,
        # counted afresh when a restarted scheduler starts its total from zero.
        if self.last_report is not None and report.instance != self.last_report.instance:
            self._retracted_seen = 0
        if report.num_retracted_requests_total > self._retracted_seen:
            self._retracted_total.inc(report.num_retracted_requests_total - self._retracted_seen)
            self._retracted_seen = report.num_retracted_requests_total
        self._peers.update(report, self.last_report)
        self.last_report = report


class SchedulerPeerSeries:
    """A peer family's series that tokenpipe makes only for it, from the scheduler's reports:
    vLLM's tokens per forward step, SGLang's KV tokens in use and KV pool size."""

    def __init__(self, naming: Naming) -> None:
        self.iteration_tokens = one_child(
            naming.peer_histogram("iteration_tokens", "Tokens per forward step.", TallyHistogram)
        )
        self.num_used_tokens = one_child(
            naming.peer_gauge(
                "num_used_tokens", "KV tokens held by requests (evictable prefix cache excluded)."
            )
        )
        self.max_total_num_tokens = one_child(
            naming.peer_gauge("max_total_num_tokens", "Tokens the KV pool holds.")
        )

    def update(self, report: SchedulerStatsReport, previous: SchedulerStatsReport | None) -> None:
        # Running totals, which a restarted scheduler (a new instance) starts from zero.
        steps_before = tokens_before = 0
        if previous is not None and previous.instance == report.instance:
            steps_before = previous.forward_steps_total
            tokens_before = previous.forward_tokens_total
        steps = report.forward_steps_total - steps_before
        if steps > 0:
            # A report brings the steps of its interval and their tokens, not each step's count:
            # each step counts with the interval's mean, so count and sum are exact and the
            # buckets those of the mean.
            self.iteration_tokens.observe_many(
                (report.forward_tokens_total - tokens_before) / steps, steps
            )
        # token_usage is this count over the capacity (SGLang's relation of the two).
        self.num_used_tokens.set(round(report.token_usage * report.kv_capacity))
        self.max_total_num_tokens.set(report.kv_capacity)
