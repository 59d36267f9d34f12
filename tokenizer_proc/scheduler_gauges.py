"""The scheduler's gauges on ``/metrics``, set from the ``SchedulerStatsReport`` frames that
reach the API process through the detokenizer, so one endpoint covers every process."""

from __future__ import annotations

from prometheus_client import Gauge

from pipeline.io_struct import SchedulerStatsReport
from tokenizer_proc.metrics_compat import ABSENT, Absent, Bound, Naming, one_child
from tokenizer_proc.rollout_metrics import RolloutMetrics
from tokenizer_proc.spec_metrics import NoSpecMetrics, SpecMetrics
from tokenizer_proc.tally_histogram import TallyHistogram

# Tokens a slot of tokenpipe's KV pool holds: the pool gives out one slot per token (its
# capacity, --max-total-tokens, counts tokens), as SGLang's does with page size 1.
KV_TOKENS_PER_SLOT = 1


class SchedulerGauges:
    """The scheduler metrics of docs/design.md section 4. ``kv_dtype`` is the server's
    --dtype, which vLLM's cache config info names; ``num_speculative_tokens`` its drafts per
    request per step (0: it does not speculate, and has no speculative series)."""

    def __init__(
        self, naming: Naming, kv_dtype: str = "auto", num_speculative_tokens: int = 0
    ) -> None:
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
        self._cache_config = CacheConfigInfo(naming, kv_dtype)
        self._rollout = RolloutMetrics(naming)
        self._spec: SpecMetrics | NoSpecMetrics = (
            SpecMetrics(naming, num_speculative_tokens)
            if num_speculative_tokens
            else NoSpecMetrics()
        )
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
        self._cache_config.update(report)
        self._rollout.update(report)
        self._spec.on_report(report)
        self.last_report = report


class SchedulerPeerSeries:
    """A peer family's series that tokenpipe makes only for it, from the scheduler's reports:
    vLLM's tokens per forward step and waiting requests by reason; SGLang's KV tokens in use,
    KV pool size, waiting queue without the grammar queue, grammar queue, and the summed
    lengths of the decoding requests."""

    def __init__(self, naming: Naming) -> None:
        def gauge(key: str, doc: str) -> Gauge | Absent:
            return one_child(naming.peer_gauge(key, doc))

        self.iteration_tokens = one_child(
            naming.peer_histogram(
                "iteration_tokens", "Prompt and generated tokens per forward step.", TallyHistogram
            )
        )
        self.num_used_tokens = gauge(
            "num_used_tokens", "KV tokens held by requests (evictable prefix cache excluded)."
        )
        self.max_total_num_tokens = gauge("max_total_num_tokens", "Tokens the KV pool holds.")
        self.queue_without_grammar = gauge(
            "num_queue_reqs_without_grammar",
            "Requests waiting for admission whose grammar (if any) has compiled.",
        )
        self.grammar_queue = gauge(
            "num_grammar_queue_reqs", "Requests waiting for their grammar to compile."
        )
        self.decode_sum_seq_lens = gauge(
            "decode_sum_seq_lens", "Prompt plus generated tokens of the decoding requests."
        )
        by_reason = naming.peer_gauge(
            "num_requests_waiting_by_reason",
            "Waiting requests by why they wait: capacity, or deferred (a grammar compiles).",
            ("reason",),
        )
        self.waiting_by_reason: dict[str, Gauge | Absent] = {
            r: by_reason(r) if by_reason is not None else ABSENT for r in ("capacity", "deferred")
        }

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
        grammar = report.num_grammar_queue_reqs
        self.queue_without_grammar.set(report.num_queue_reqs - grammar)
        self.grammar_queue.set(grammar)
        self.decode_sum_seq_lens.set(report.decode_sum_seq_lens)
        self.waiting_by_reason["capacity"].set(report.num_queue_reqs - grammar)
        self.waiting_by_reason["deferred"].set(grammar)


class CacheConfigInfo:
    """vLLM's ``cache_config_info``: a gauge at 1 whose labels are the KV cache's settings,
    those tokenpipe has: its slot size, dtype, prefix caching (always on: no flag turns it
    off) and slots, the pool's capacity as the scheduler reports it. Set from the first
    report, and again (the old label set dropped) should a restarted scheduler's pool differ."""

    LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks")

    def __init__(self, naming: Naming, kv_dtype: str) -> None:
        self._gauge: Bound[Gauge] | None = naming.peer_gauge(
            "cache_config_info", "Information of the KV cache's configuration.", self.LABELS
        )
        self._kv_dtype = kv_dtype
        self._values: tuple[str, ...] | None = None

    def update(self, report: SchedulerStatsReport) -> None:
        if self._gauge is None:
            return
        values = (
            str(KV_TOKENS_PER_SLOT),
            self._kv_dtype,
            "True",
            str(report.kv_capacity // KV_TOKENS_PER_SLOT),
        )
        if values == self._values:
            return
        if self._values is not None:
            old = self._gauge(*self._values)
            old.set(0)  # a multiprocess file keeps a removed child's value: zero it first
            self._gauge.remove(*self._values)
        self._gauge(*values).set(1)
        self._values = values
