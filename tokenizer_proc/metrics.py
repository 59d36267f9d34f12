"""Prometheus metrics of the whole service, served by the API process on ``/metrics``.

The scheduler's gauges arrive as ``SchedulerStatsReport`` frames and are set here, so one
endpoint covers every process. With several API workers (``--api-workers``) each keeps its
values in prometheus-client's multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``, which the
supervisor sets) and any of them renders the sum of all: counters and histograms add up over
the workers, and the scheduler's gauges are set by worker 0 alone ("mostrecent"). Names carry the
``tokenpipe:`` prefix and the ``model_name`` / ``engine_type`` labels (docs/design.md section 7).
With ``--metrics-compat sglang`` or ``vllm`` the same values go out under that family's names,
labels and buckets (``tokenizer_proc/metrics_compat.py``), with the family's series tokenpipe
makes only for it alongside (``SchedulerPeerSeries``, ``RequestPeerSeries``).
"""

from __future__ import annotations

from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector

from pipeline.config import MetricsCompat
from pipeline.io_struct import CONSTRAINT_KINDS, FinishAbort, SchedulerStatsReport
from tokenizer_proc.metrics_compat import ABSENT, VLLM_FINISH_REASONS, Absent, Bound, Naming
from tokenizer_proc.native.meta_info import time_per_output_token
from tokenizer_proc.req_state import ReqState

# A `*_created` series per counter and histogram doubles the scrape for no use here.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


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
        # The scheduler reports a running total; a counter only moves by the difference,
        # counted afresh when a restarted scheduler starts its total from zero.
        if self.last_report is not None and report.instance != self.last_report.instance:
            self._retracted_seen = 0
        if report.num_retracted_requests_total > self._retracted_seen:
            self._retracted_total.inc(report.num_retracted_requests_total - self._retracted_seen)
            self._retracted_seen = report.num_retracted_requests_total
        self._peers.update(report, self.last_report)
        self.last_report = report


M = TypeVar("M", bound=MetricWrapperBase)


def _child(bound: Bound[M] | None) -> M | Absent:
    """The one child of a peer-only series, or ``ABSENT`` when the family has no such series."""
    return bound() if bound is not None else ABSENT


class SchedulerPeerSeries:
    """A peer family's series that tokenpipe makes only for it, from the scheduler's reports:
    vLLM's tokens per forward step, SGLang's KV tokens in use and KV pool size."""

    def __init__(self, naming: Naming) -> None:
        self.iteration_tokens = _child(
            naming.peer_histogram("iteration_tokens", "Tokens per forward step.", _TallyHistogram)
        )
        self.num_used_tokens = _child(
            naming.peer_gauge(
                "num_used_tokens", "KV tokens held by requests (evictable prefix cache excluded)."
            )
        )
        self.max_total_num_tokens = _child(
            naming.peer_gauge("max_total_num_tokens", "Tokens the KV pool holds.")
        )

    def update(self, report: SchedulerStatsReport, previous: SchedulerStatsReport | None) -> None:
        # Running totals, which a restarted scheduler (a new instance) starts from zero.
        steps_before = tokens_before = 0
        if previous is not None and previous.instance == report.instance:
            steps_before, tokens_before = (
                previous.forward_steps_total,
                previous.forward_tokens_total,
            )
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


# SGLang's bucket boundaries, extended downwards: on a CPU-sized model a token takes
# milliseconds, and SGLang's smallest latency buckets (0.1 s TTFT, 2 ms ITL) would put
# every observation of a small deployment into one bucket.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    25.0,
    30.0,
    60.0,
    120.0,
)
ITL_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    90.0,
    120.0,
    300.0,
    600.0,
)
QUEUE_BUCKETS = (
    0.0001,
    0.001,
    0.005,
    0.01,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    60.0,
    120.0,
    300.0,
)
RETRACTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20, 50)
TOOL_FINISH_REASONS = ("tool_calls", "stop", "length", "abort")
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536
# A grammar found in the scheduler's cache waits 0 s; xgrammar compiles a small schema or
# regex in milliseconds and a large schema or grammar in up to seconds.
GRAMMAR_WAIT_BUCKETS = (
    0.0001,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class _TallyHistogram(Histogram):
    """A Histogram that takes one value many times in one update of its sum and bucket:
    Prometheus's ``observe`` takes one at a time, under a lock each, and a frame brings one
    inter-token gap per row, most of them the same (every row of one decode step)."""

    def observe_many(self, amount: float, count: int) -> None:
        """``observe(amount)`` ``count`` times over; the bucket as ``observe`` picks it."""
        self._raise_if_not_observable()
        self._sum.inc(amount * count)
        for i, bound in enumerate(self._upper_bounds):
            if amount <= bound:
                self._buckets[i].inc(count)
                break


class RequestMetrics:
    """Request-level metrics of docs/design.md section 7. Every value comes from the ReqState: its
    ``request_stats`` (the scheduler's numbers) and its own timing."""

    def __init__(self, naming: Naming) -> None:
        def counter(key: str, doc: str, extra: tuple[str, ...] = ()) -> Bound[Counter]:
            return naming.counter(key, doc, extra)

        def histogram(
            key: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()
        ) -> Bound[Histogram]:
            return naming.histogram(key, doc, buckets, Histogram, extra)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")()
        self.generation_tokens = counter(
            "generation_tokens", "Generated tokens of finished requests."
        )()
        cached = counter(
            "cached_tokens",
            "Prompt tokens served from the prefix cache, by tier.",
            ("cache_source",),
        )
        self.cached_tokens = {src: cached(src) for src in ("device", "host", "storage", "total")}
        requests = counter("num_requests", "Finished requests.", ("is_streaming",))
        self.num_requests = {s: requests(str(s).lower()) for s in (True, False)}
        self.num_aborted = counter("num_aborted_requests", "Requests that finished by abort.")()
        # Refused before they ran: body_too_large (413), queue_full (503), read_timeout.
        rejected = counter(
            "num_rejected_requests", "Requests refused by a limit, by reason.", ("reason",)
        )
        self.num_rejected = {r: rejected(r) for r in REJECTION_REASONS}
        # "asgi" is the slow path: every event through an ASGI send, a task switch per frame.
        # Apart from a client gone just as its stream started, it means uvicorn's own send went
        # unrecognized (pipeline/http/uvicorn_internals.py): an upgrade changed its internals.
        streams = counter(
            "sse_streams",
            "Streamed responses, by how their events reach the client's socket.",
            ("write_path",),
        )
        self.sse_streams = {p: streams(p) for p in ("direct", "asgi")}
        ttft = histogram(
            "time_to_first_token_seconds",
            "Arrival to the first token at the API.",
            TTFT_BUCKETS,
            ("is_streaming",),
        )
        self.ttft = {s: ttft(str(s).lower()) for s in (True, False)}
        self.itl = naming.histogram(
            "inter_token_latency_seconds",
            "Time between tokens as the API sees them, per token.",
            ITL_BUCKETS,
            _TallyHistogram,
        )()
        self._itl_tally: dict[
            float, int
        ] = {}  # this frame's per-token gaps, and how many tokens had each
        e2e = histogram(
            "e2e_request_latency_seconds", "Arrival to finish.", E2E_BUCKETS, ("is_streaming",)
        )
        self.e2e = {s: e2e(str(s).lower()) for s in (True, False)}
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first.",
            ITL_BUCKETS,
        )()
        self.queue_time = histogram(
            "queue_time_seconds", "Time in the scheduler's waiting queue, all stays.", QUEUE_BUCKETS
        )()
        self.num_retractions = histogram(
            "num_retractions", "Retractions per finished request.", RETRACTION_BUCKETS
        )()
        self.prompt_tokens_hist = histogram(
            "prompt_tokens_histogram", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS
        )()
        self.generation_tokens_hist = histogram(
            "generation_tokens_histogram", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )()
        # A chat choice whose request gave tools, by how it finished: tool_calls when it called.
        tools = counter(
            "tool_requests",
            "Finished chat choices of requests with tools, by finish_reason.",
            ("finish_reason",),
        )
        self.tool_requests = {r: tools(r) for r in TOOL_FINISH_REASONS}
        self.tool_calls = counter("tool_calls", "Tool calls in finished chat answers.")()
        constrained = counter(
            "constrained_requests",
            "Finished requests with a structured output, by kind.",
            ("kind",),
        )
        self.constrained = {kind: constrained(kind) for kind in CONSTRAINT_KINDS}
        self.grammar_wait = histogram(
            "grammar_compile_wait_seconds",
            "Time a structured-output request waited for its grammar to compile.",
            GRAMMAR_WAIT_BUCKETS,
        )()
        self.peers = RequestPeerSeries(naming)

    def on_tokens(
        self, state: ReqState, num_tokens: int, previous_token_time: float | None, now: float
    ) -> None:
        """A row with tokens reached the API: TTFT on the first, ITL per token after (tallied
        for ``end_frame``)."""
        if previous_token_time is None:
            self.ttft[state.stream].observe(now - state.created_time)
        elif num_tokens:
            per_token = (now - previous_token_time) / num_tokens
            tally = self._itl_tally
            tally[per_token] = tally.get(per_token, 0) + num_tokens

    def end_frame(self) -> None:
        """The frame's rows are all applied: observe its ITL tally, one update per gap."""
        tally, self._itl_tally = self._itl_tally, {}
        for per_token, count in tally.items():
            self.itl.observe_many(per_token, count)

    def on_sse_stream(self, direct: bool) -> None:
        """A stream started: its events go straight to the client's socket (``direct``) or
        through ASGI ``send``."""
        self.sse_streams["direct" if direct else "asgi"].inc()

    def on_lost(self, state: ReqState) -> None:
        """A request that ended before the scheduler reported on it (a restarted scheduler
        lost it): a request and an abort, with no token counts or timings to observe."""
        self.num_requests[state.stream].inc()
        self.num_aborted.inc()
        self.peers.on_lost(state)

    def on_tool_answer(self, finish_reason: str, calls: int) -> None:
        """A finished chat choice of a request with tools (``tokenizer_proc.openai.chat_answers``)."""
        self.tool_requests[finish_reason].inc()
        if calls:
            self.tool_calls.inc(calls)

    def on_finish(self, state: ReqState) -> None:
        stats = state.request_stats
        assert stats is not None and state.finished_time is not None
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        details = stats.cached_tokens_details
        if details is not None:
            self.cached_tokens["device"].inc(details.device)
            self.cached_tokens["host"].inc(details.host)
            self.cached_tokens["storage"].inc(details.storage or 0)
        self.cached_tokens["total"].inc(stats.cached_tokens)
        self.num_requests[state.stream].inc()
        if isinstance(state.finished_reason, FinishAbort):
            self.num_aborted.inc()
        self.e2e[state.stream].observe(state.finished_time - state.created_time)
        if stats.time_stats is not None:
            # The scheduler's decode interval, as meta_info's decode_throughput: the API's own
            # token times are one instant for a non-streaming request (its only row is the last).
            per_token = time_per_output_token(state.completion_tokens, stats.time_stats)
            if per_token is not None:
                self.tpot.observe(per_token)
            self.queue_time.observe(stats.time_stats.queue_time)
        if state.constraint_kind is not None:
            self.constrained[state.constraint_kind].inc()
            if stats.time_stats is not None:
                self.grammar_wait.observe(stats.time_stats.grammar_wait)
        self.num_retractions.observe(stats.num_retractions)
        self.prompt_tokens_hist.observe(stats.prompt_tokens)
        self.generation_tokens_hist.observe(state.completion_tokens)
        self.peers.on_finish(state)


class RequestPeerSeries:
    """A peer family's series that tokenpipe makes only for it, from each finished request's
    state as the rest: vLLM's requests by finish reason, prefix-cache queries and hits, request
    parameters and phase times; SGLang's uncached prompt tokens. ``ABSENT`` stands in for the
    ones the family lacks (all of them for tokenpipe's own names)."""

    def __init__(self, naming: Naming) -> None:
        success = naming.peer_counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",)
        )
        self.request_success: dict[str, Counter | Absent] = {
            r: success(r) if success is not None else ABSENT for r in VLLM_FINISH_REASONS
        }
        self.prefix_cache_queries = _child(
            naming.peer_counter(
                "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
            )
        )
        self.prefix_cache_hits = _child(
            naming.peer_counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        )
        self.params_n = _child(
            naming.peer_histogram("request_params_n", "Choices per request (n).", Histogram)
        )
        self.params_max_tokens = _child(
            naming.peer_histogram("request_params_max_tokens", "Requested max tokens.", Histogram)
        )
        self.max_generation_tokens = _child(
            naming.peer_histogram(
                "request_max_num_generation_tokens",
                "Generated tokens of a request's longest choice.",
                Histogram,
            )
        )
        self.prefill_time = _child(
            naming.peer_histogram(
                "request_prefill_time_seconds", "First forward to the prefill's end.", Histogram
            )
        )
        self.decode_time = _child(
            naming.peer_histogram(
                "request_decode_time_seconds", "The prefill's end to the finish.", Histogram
            )
        )
        self.inference_time = _child(
            naming.peer_histogram(
                "request_inference_time_seconds", "First forward to the finish.", Histogram
            )
        )
        self.uncached_prompt_tokens = _child(
            naming.peer_histogram(
                "uncached_prompt_tokens_histogram",
                "Prompt tokens per request not served by the cache.",
                Histogram,
            )
        )

    def on_lost(self, state: ReqState) -> None:
        """A request lost before the scheduler reported on it: an abort, and no tokens."""
        self.request_success["abort"].inc()
        if state.choices is not None:  # its group still ends with it
            self._end_choice(state, 0)

    def _end_choice(self, state: ReqState, completion_tokens: int) -> None:
        """vLLM's request parameters, once per request: a choice of n > 1 waits for the
        rest of its group (the API runs each choice as a pipeline request of its own)."""
        group = state.choices
        if group is None:
            n, longest = 1, completion_tokens
        elif group.end_choice(completion_tokens):
            n, longest = group.n, group.longest
        else:
            return
        self.params_n.observe(n)
        self.params_max_tokens.observe(state.sampling.max_new_tokens)
        self.max_generation_tokens.observe(longest)

    def on_finish(self, state: ReqState) -> None:
        stats = state.request_stats
        assert stats is not None and state.finished_reason is not None
        self.request_success[str(type(state.finished_reason).__struct_config__.tag)].inc()
        self.prefix_cache_queries.inc(stats.prompt_tokens)
        self.prefix_cache_hits.inc(stats.cached_tokens)
        self._end_choice(state, state.completion_tokens)
        self.uncached_prompt_tokens.observe(stats.prompt_tokens - stats.cached_tokens)
        ts = stats.time_stats
        if ts is None or ts.forward_entry_time is None or ts.completion_time is None:
            return  # metrics off, or it ended before it ran
        self.inference_time.observe(ts.completion_time - ts.forward_entry_time)
        if ts.prefill_finished_time is not None:
            self.prefill_time.observe(ts.prefill_finished_time - ts.forward_entry_time)
            self.decode_time.observe(ts.completion_time - ts.prefill_finished_time)


REJECTION_REASONS = ("body_too_large", "queue_full", "read_timeout")


class ServiceMetrics:
    def __init__(
        self,
        model_name: str,
        engine_type: str = "unified",
        registry: CollectorRegistry | None = None,
        *,
        multiprocess: bool = False,
        compat: MetricsCompat = "tokenpipe",
        context_length: int = 0,  # vLLM's token-count buckets reach it; only --metrics-compat vllm needs it
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.multiprocess = multiprocess
        self.labels = {"model_name": model_name, "engine_type": engine_type}
        naming = Naming(compat, self.registry, model_name, engine_type, context_length)
        self.scheduler = SchedulerGauges(naming)
        self.requests = RequestMetrics(naming)

    def render(self) -> bytes:
        if self.multiprocess:
            # Read afresh from every worker's files on each scrape, as prometheus-client's
            # multiprocess mode asks.
            merged = CollectorRegistry()
            MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
