"""OpenTelemetry tracing of finished requests (docs/design.md section 8).

One SERVER span per request, named ``{gen_ai.operation.name} {model}`` and a child of the
incoming W3C ``traceparent`` when there is one. Spans are not opened while a request runs:
``RequestTracer.on_finish`` builds the whole tree at once from timestamps the request
already holds, so tracing adds nothing to the per-token path and one short call per
finished request. The child spans are ``stage_intervals``'; the attributes come from
``span_attributes``, a pure function of the state (the differential test compares them
exactly), built from ``ReqState.request_stats``, never from per-row values. A server without
``--otlp-traces-endpoint`` runs ``tracers.NoTracer`` and never imports this module.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit, urlunsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

from pipeline.config import ServerConfig
from pipeline.io_struct import FinishAbort, RequestOutputStats
from pipeline.finish_reasons import finish_reason_to_dict
from tokenizer_proc.req_state import ReqState

logger = logging.getLogger("tokenpipe.tracing")

PROVIDER_NAME = "tokenpipe"
DEFAULT_SERVICE_NAME = "tokenpipe"
EMBEDDINGS = "embeddings"  # the gen_ai.operation.name of /v1/embeddings
# Upper bound of ``RequestTracer.shutdown``: spans still queued get this long to leave.
SHUTDOWN_TIMEOUT_S = 3.0

_propagator = TraceContextTextMapPropagator()

SpanAttributes = dict[str, AttributeValue]


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def span_attributes(
    state: ReqState, model_name: str, operation: str = "generate"
) -> SpanAttributes:
    """The SERVER span's attributes, from ``state.request_stats`` and the request itself.

    Keys that have no value are left out rather than set to a placeholder: ``seed`` when
    none was given, ``top_k`` when it is disabled (-1), ``time_to_first_chunk`` when no
    token arrived, ``tokenpipe.queue_time`` with metrics off, the cached-token details when
    ``cached_tokens_details`` is None (and its storage keys while no storage is attached),
    media token counts of zero, the structured-output keys of an unconstrained request
    (``tokenpipe.grammar_wait`` with metrics off too), and the speculative counts of a request
    that had no drafts verified. For ``operation="embeddings"`` the
    sampling keys, ``gen_ai.request.stream`` and ``gen_ai.usage.output_tokens`` are left out
    too.
    """
    attrs = _request_attributes(state, model_name, operation)
    if state.request_stats is not None:  # None: never sent (the manager drops such rows anyway)
        attrs.update(_stats_attributes(state, state.request_stats))
    return attrs


def requested_model(state: ReqState, model_name: str) -> str:
    """The model the request named: its adapter's name, or the served model's
    (``model_name``), which a request that names none runs too."""
    return state.lora.name if state.lora is not None else model_name


def _request_attributes(state: ReqState, model_name: str, operation: str) -> SpanAttributes:
    """The attributes of the request itself: what it asked, and how it finished."""
    attrs: SpanAttributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.provider.name": PROVIDER_NAME,
        "gen_ai.request.model": requested_model(state, model_name),
    }
    if state.lora is not None:
        attrs["tokenpipe.lora_name"] = state.lora.name
    if state.route is not None:  # /v1/responses runs as chat: the route tells them apart
        attrs["http.route"] = state.route
    generates = operation != EMBEDDINGS
    if generates:  # an embedding request has no sampling, stream or output tokens
        sampling = state.sampling
        attrs["gen_ai.request.max_tokens"] = sampling.max_new_tokens
        attrs["gen_ai.request.temperature"] = float(sampling.temperature)
        attrs["gen_ai.request.top_p"] = float(sampling.top_p)
        if sampling.top_k > 0:
            attrs["gen_ai.request.top_k"] = sampling.top_k
        if sampling.seed is not None:
            attrs["gen_ai.request.seed"] = sampling.seed
        attrs["gen_ai.request.stream"] = state.stream
    attrs["gen_ai.response.id"] = state.rid
    if state.finished_reason is not None:
        attrs["gen_ai.response.finish_reasons"] = (
            str(finish_reason_to_dict(state.finished_reason)["type"]),
        )
    if generates:
        attrs["gen_ai.usage.output_tokens"] = state.completion_tokens
    if state.first_token_time is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = state.first_token_time - state.created_time
    return attrs


def _stats_attributes(state: ReqState, stats: RequestOutputStats) -> SpanAttributes:
    """The attributes of the scheduler's numbers, from ``state.request_stats``."""
    attrs: SpanAttributes = {}
    attrs["gen_ai.usage.input_tokens"] = stats.prompt_tokens
    attrs["gen_ai.usage.cache_read.input_tokens"] = stats.cached_tokens
    attrs["tokenpipe.num_retractions"] = stats.num_retractions
    if stats.weight_version is not None:  # the weights that made its last tokens
        attrs["tokenpipe.weight_version"] = stats.weight_version
    if stats.time_stats is not None:
        attrs["tokenpipe.queue_time"] = stats.time_stats.queue_time
    if state.constraint_kind is not None:
        attrs["tokenpipe.constraint.kind"] = state.constraint_kind
        if stats.time_stats is not None:
            attrs["tokenpipe.grammar_wait"] = stats.time_stats.grammar_wait
    details = stats.cached_tokens_details
    if details is not None:
        attrs["tokenpipe.cached_tokens_details.device"] = details.device
        attrs["tokenpipe.cached_tokens_details.host"] = details.host
        if details.storage is not None:
            attrs["tokenpipe.cached_tokens_details.storage"] = details.storage
        if details.storage_backend is not None:
            attrs["tokenpipe.cached_tokens_details.storage_backend"] = details.storage_backend
    for key, count in (
        ("tokenpipe.image_tokens", stats.image_tokens),
        ("tokenpipe.audio_tokens", stats.audio_tokens),
        ("tokenpipe.video_tokens", stats.video_tokens),
    ):
        if count:
            attrs[key] = count
    if stats.spec_verify_ct > 0:  # verify passes with drafts, the drafts, those accepted
        attrs["tokenpipe.spec_verify_ct"] = stats.spec_verify_ct
        attrs["tokenpipe.spec_draft_tokens"] = stats.spec_draft_tokens
        attrs["tokenpipe.spec_accepted_tokens"] = stats.spec_accepted_tokens
    return attrs


def stage_intervals(state: ReqState, operation: str = "generate") -> list[tuple[str, float, float]]:
    """``(name, start, end)`` in wall-clock seconds for each stage child span, in order.
    Times are wall clock, ``time.time()``; the scheduler's come from ``SchedulerTimeStats``,
    so they exist only while metrics are on (with metrics off only ``tokenize`` exists).

    - ``tokenize``: ``created_time`` (HTTP arrival) to ``tokenized_time`` (the request left
      for the scheduler).
    - ``queue``: ``tokenized_time`` to ``forward_entry_time`` (the first forward pass). It
      includes the hop to the scheduler: ``wait_queue_entry_time`` is the *latest* queue
      entry (a retraction moves it), so it cannot mark the first one.
    - ``prefill``: ``forward_entry_time`` to ``prefill_finished_time`` (the first prefill; a
      re-prefill after a retraction is part of ``decode`` and shows as a ``retract`` event
      of the SERVER span, which runs from ``created_time`` to ``finished_time``).
    - ``decode``: ``prefill_finished_time`` to ``completion_time`` (else ``finished_time``);
      none for an embedding request.

    A stage that was entered but never left (a request aborted while waiting, or
    mid-prefill) ends at the completion, so its span shows where the time went; a stage
    never entered has no span. A PD decode request (it has a ``bootstrap_done_time``) has no
    ``prefill``: that ran on the prefill server, and its ``queue`` includes the KV transfer.
    An interval whose end precedes its start (clocks of different hosts) is clamped to zero
    length rather than dropped."""
    end_of_request = state.finished_time if state.finished_time is not None else time.time()
    stages: list[tuple[str, float | None, float | None]] = [
        ("tokenize", state.created_time, state.tokenized_time)
    ]
    stats = state.request_stats
    ts = stats.time_stats if stats is not None else None
    if ts is not None:
        done = ts.completion_time if ts.completion_time is not None else end_of_request
        if ts.wait_queue_entry_time is not None or ts.forward_entry_time is not None:
            queue_start = (
                state.tokenized_time
                if state.tokenized_time is not None
                else ts.wait_queue_entry_time
            )
            queue_end = ts.forward_entry_time if ts.forward_entry_time is not None else done
            stages.append(("queue", queue_start, queue_end))
        prebuilt = ts.bootstrap_done_time is not None
        if ts.forward_entry_time is not None and not prebuilt:
            prefill_end = ts.prefill_finished_time if ts.prefill_finished_time is not None else done
            stages.append(("prefill", ts.forward_entry_time, prefill_end))
        decode_start = ts.forward_entry_time if prebuilt else ts.prefill_finished_time
        if decode_start is not None and operation != EMBEDDINGS:
            stages.append(("decode", decode_start, done))
    return [
        (name, start, max(start, end))
        for name, start, end in stages
        if start is not None and end is not None
    ]


def _parent_context(state: ReqState) -> Context | None:
    if state.trace is None or not state.trace.traceparent:
        return None
    carrier = {"traceparent": state.trace.traceparent}
    if state.trace.tracestate:
        carrier["tracestate"] = state.trace.tracestate
    return _propagator.extract(carrier)  # an invalid traceparent gives an empty context: a new root


def _default_exporter(config: ServerConfig) -> SpanExporter:
    endpoint = config.otlp_traces_endpoint
    assert endpoint, "tracing needs config.otlp_traces_endpoint"
    if config.otlp_traces_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=http_traces_url(endpoint))


def http_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP URL to POST to: an endpoint given without a path (``http://host:4318``)
    gets the traces path ``/v1/traces``; one with a path is used as given."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        return urlunsplit(parts._replace(path="/v1/traces"))
    return endpoint


class _RateLimitFilter(logging.Filter):
    """Lets one "Queue full" warning of the SDK's batch processor through per interval:
    under load with the collector down, the SDK would warn once per dropped span."""

    def __init__(self, interval_s: float = 30.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Queue full"):
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._suppressed += 1
            return False
        if self._suppressed:
            record.msg = f"{record.msg} ({self._suppressed} more such warnings suppressed)"
        self._last, self._suppressed = now, 0
        return True


# One filter for the process, as the SDK's logger is one: ``addFilter`` adds it once however
# many tracers ask.
_queue_full_filter = _RateLimitFilter()


def _install_queue_full_filter() -> None:
    logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(_queue_full_filter)


class RequestTracer:
    """Builds and exports one span tree per finished request.

    The SERVER span runs from ``created_time`` (HTTP arrival) to ``finished_time`` (the
    finished row reaching the tokenizer manager), with one ``retract`` event per retraction,
    at ``ReqState.retract_times``.

    Export goes through a ``BatchSpanProcessor``: ``on_finish`` only appends to its queue, a
    background thread exports, and an unreachable or slow collector only costs log lines
    (the SDK's own retries run on that thread). The ``TracerProvider`` is private to this
    object; the global one is left alone."""

    def __init__(
        self, config: ServerConfig, model_name: str, exporter: SpanExporter | None = None
    ) -> None:
        self.model_name = model_name
        env = OTELResourceDetector().detect()  # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win
        resource = Resource.create(
            {SERVICE_NAME: env.attributes.get(SERVICE_NAME) or DEFAULT_SERVICE_NAME}
        )
        # shutdown_on_exit=False: the SDK's atexit hook would wait up to 30 s for an
        # unreachable collector; ``shutdown`` is bounded instead.
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._processor = BatchSpanProcessor(
            exporter if exporter is not None else _default_exporter(config)
        )
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("tokenpipe")
        self._closed = False
        self._failures = 0
        _install_queue_full_filter()

    def on_finish(self, state: ReqState, operation: str = "generate") -> None:
        """Records the finished request's span tree. Never raises: a tracing problem must
        not disturb the output path that calls this."""
        if self._closed:
            return
        try:
            self._record(state, operation)
        except Exception:  # noqa: BLE001
            self._failures += 1
            if self._failures == 1 or self._failures % 1000 == 0:
                logger.exception(
                    "could not record the span of request %s (%d failures so far)",
                    state.rid,
                    self._failures,
                )

    def _record(self, state: ReqState, operation: str) -> None:
        end = state.finished_time if state.finished_time is not None else time.time()
        server = self._tracer.start_span(
            f"{operation} {requested_model(state, self.model_name)}",
            context=_parent_context(state),
            kind=SpanKind.SERVER,
            attributes=span_attributes(state, self.model_name, operation),
            start_time=_ns(state.created_time),
        )
        if not server.is_recording():  # sampled out (e.g. the parent's sampled flag is 0)
            return
        for at in state.retract_times:
            server.add_event("retract", timestamp=_ns(at))
        if isinstance(state.finished_reason, FinishAbort):
            server.set_status(Status(StatusCode.ERROR, state.finished_reason.message))
        inside = trace.set_span_in_context(server)
        for name, start, stop in stage_intervals(state, operation):
            child = self._tracer.start_span(
                name, context=inside, kind=SpanKind.INTERNAL, start_time=_ns(start)
            )
            child.end(end_time=_ns(stop))
        server.end(end_time=_ns(max(end, state.created_time)))

    def force_flush(self, timeout_s: float | None = None) -> bool:
        """Exports what is queued now; False when it did not finish within ``timeout_s``
        (default ``SHUTDOWN_TIMEOUT_S``)."""
        return _bounded(
            self._provider.force_flush, SHUTDOWN_TIMEOUT_S if timeout_s is None else timeout_s
        )

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Flushes queued spans and stops the exporter, waiting at most ``timeout_s``
        (default ``SHUTDOWN_TIMEOUT_S``).

        The SDK's own shutdown waits for an export in progress, and an export to an
        unreachable collector retries for up to its timeout (10 s by default), so it runs on
        a daemon thread here and is abandoned at the deadline: the process may exit then."""
        if self._closed:
            return
        self._closed = True
        timeout_s = SHUTDOWN_TIMEOUT_S if timeout_s is None else timeout_s
        if not _bounded(self._provider.shutdown, timeout_s):
            logger.warning(
                "trace export did not finish within %.1f s at shutdown; queued spans are dropped",
                timeout_s,
            )


def _bounded(fn: Callable[[], object], timeout_s: float) -> bool:
    result: list[object] = []

    def run() -> None:
        try:
            result.append(fn())
        except Exception:  # noqa: BLE001
            logger.exception("trace export flush/shutdown failed")
            result.append(False)

    worker = threading.Thread(target=run, name="tokenpipe-trace-flush", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return bool(result) and result[0] is not False
