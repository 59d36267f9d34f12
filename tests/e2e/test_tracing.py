"""Tracing (docs/design.md section 8): the span tree of a finished request, its attributes, and that
export never slows the request path.

Unit tests feed ``RequestTracer`` hand-built ``ReqState``s; the end-to-end tests run a real
``tokenpipe serve`` that exports over OTLP/HTTP to a real receiver (``tests/otlp_receiver``),
or to a closed port.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    CachedTokensDetails,
    FinishAbort,
    FinishLength,
    FinishStop,
    RequestOutputStats,
    SamplingParams,
    SchedulerTimeStats,
    TraceContext,
)
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.server_harness import ServerProcess, free_port, wait_until
from tokenizer_proc import tracing
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tracing import RequestTracer, http_traces_url, span_attributes

MODEL = "tokenpipe-test"
T0 = 1_800_000_000.0  # a fixed wall-clock second, so expected times are exact


def _traceparent(sampled: bool = True) -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}", trace_id, span_id


def _ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def _config(endpoint: str = "http://127.0.0.1:4318") -> ServerConfig:
    return ServerConfig(otlp_traces_endpoint=endpoint)


def _state(
    *,
    time_stats: SchedulerTimeStats | None = None,
    traceparent: str | None = None,
    tracestate: str | None = None,
    finished_reason: object = FinishLength(length=8),
    retract_times: Sequence[float] = (),
    stream: bool = False,
    sampling: SamplingParams | None = None,
    details: CachedTokensDetails | None = None,
    media: tuple[int, int, int] = (0, 0, 0),
    first_token: float | None = T0 + 0.030,
) -> ReqState:
    stats = RequestOutputStats(
        prompt_tokens=40,
        cached_tokens=16,
        cached_tokens_details=details,
        num_retractions=len(retract_times),
        image_tokens=media[0],
        audio_tokens=media[1],
        video_tokens=media[2],
        time_stats=time_stats,
    )
    return ReqState(
        rid="req-1",
        req_id=7,
        stream=stream,
        sampling=sampling
        or SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=1234),
        created_time=T0,
        trace=TraceContext(traceparent=traceparent, tracestate=tracestate) if traceparent else None,
        tokenized_time=T0 + 0.002,
        request_stats=stats,
        finished_reason=finished_reason,  # type: ignore[arg-type]
        completion_tokens=8,
        first_token_time=first_token,
        last_token_time=T0 + 0.100,
        finished_time=T0 + 0.101,
        retract_times=list(retract_times),
    )


FULL_TIME_STATS = SchedulerTimeStats(
    wait_queue_entry_time=T0 + 0.060,  # the latest entry: after the retractions
    forward_entry_time=T0 + 0.005,
    prefill_finished_time=T0 + 0.020,
    completion_time=T0 + 0.099,
    queue_time=0.011,
)


def _export(state: ReqState, operation: str = "generate") -> list[ReadableSpan]:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(_config(), MODEL, exporter=exporter)
    tracer.on_finish(state, operation)
    tracer.shutdown()  # flushes the batch processor
    return list(exporter.get_finished_spans())


def _split(spans: list[ReadableSpan]) -> tuple[ReadableSpan, dict[str, ReadableSpan]]:
    servers = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(servers) == 1, [s.name for s in spans]
    children = {s.name: s for s in spans if s is not servers[0]}
    assert len(children) == len(spans) - 1, "duplicate child span names"
    return servers[0], children


# --- unit: span tree and attributes ------------------------------------------------------


def test_span_tree_times_parent_events_and_attributes() -> None:
    traceparent, trace_id, parent_span_id = _traceparent()
    state = _state(
        time_stats=FULL_TIME_STATS,
        traceparent=traceparent,
        tracestate="vendor=abc",
        retract_times=[T0 + 0.045, T0 + 0.060],
        stream=True,
        details=CachedTokensDetails(device=10, host=4, storage=2, storage_backend="file"),
        media=(12, 0, 3),
    )
    server, children = _split(_export(state))

    assert server.name == f"generate {MODEL}"
    assert f"{server.context.trace_id:032x}" == trace_id
    assert server.parent is not None and f"{server.parent.span_id:016x}" == parent_span_id
    assert server.parent.is_remote
    assert server.context.trace_state.get("vendor") == "abc"  # tracestate carried through
    assert (server.start_time, server.end_time) == (_ns(T0), _ns(T0 + 0.101))
    assert server.status.status_code == StatusCode.UNSET
    assert server.resource.attributes["service.name"] == "tokenpipe"

    assert list(children) == ["tokenize", "queue", "prefill", "decode"]
    expected_times = {
        "tokenize": (T0, T0 + 0.002),
        "queue": (T0 + 0.002, T0 + 0.005),
        "prefill": (T0 + 0.005, T0 + 0.020),
        "decode": (T0 + 0.020, T0 + 0.099),
    }
    for name, (start, end) in expected_times.items():
        child = children[name]
        assert child.parent is not None and child.parent.span_id == server.context.span_id, name
        assert child.context.trace_id == server.context.trace_id
        assert child.kind == SpanKind.INTERNAL
        assert (child.start_time, child.end_time) == (_ns(start), _ns(end)), name

    assert [(e.name, e.timestamp) for e in server.events] == [
        ("retract", _ns(T0 + 0.045)),
        ("retract", _ns(T0 + 0.060)),
    ]

    assert dict(server.attributes) == {
        "gen_ai.operation.name": "generate",
        "gen_ai.provider.name": "tokenpipe",
        "gen_ai.request.model": MODEL,
        "gen_ai.request.max_tokens": 8,
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 20,
        "gen_ai.request.seed": 1234,
        "gen_ai.request.stream": True,
        "gen_ai.response.id": "req-1",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 40,
        "gen_ai.usage.output_tokens": 8,
        "gen_ai.usage.cache_read.input_tokens": 16,
        "gen_ai.response.time_to_first_chunk": pytest.approx(0.030, abs=1e-6),
        "tokenpipe.num_retractions": 2,
        "tokenpipe.queue_time": 0.011,
        "tokenpipe.cached_tokens_details.device": 10,
        "tokenpipe.cached_tokens_details.host": 4,
        "tokenpipe.cached_tokens_details.storage": 2,
        "tokenpipe.cached_tokens_details.storage_backend": "file",
        "tokenpipe.image_tokens": 12,
        "tokenpipe.video_tokens": 3,
    }
    # The pure function is exactly what the span carries.
    assert span_attributes(state, MODEL, "generate") == dict(server.attributes)


def test_metrics_off_gives_only_tokenize_and_no_queue_time() -> None:
    state = _state(
        time_stats=None,
        sampling=SamplingParams(max_new_tokens=8, temperature=0.0),
        details=CachedTokensDetails(device=16, host=0),
        finished_reason=FinishStop(matched=0),
        first_token=None,
    )
    server, children = _split(_export(state, operation="text_completion"))
    assert server.name == f"text_completion {MODEL}"
    assert server.parent is None  # no traceparent: a new root
    assert list(children) == ["tokenize"]
    assert (children["tokenize"].start_time, children["tokenize"].end_time) == (
        _ns(T0),
        _ns(T0 + 0.002),
    )
    attrs = dict(server.attributes)
    assert "tokenpipe.queue_time" not in attrs
    assert (
        "gen_ai.request.seed" not in attrs and "gen_ai.request.top_k" not in attrs
    )  # not set / disabled
    assert "gen_ai.response.time_to_first_chunk" not in attrs
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.response.finish_reasons"] == ("stop",)
    assert attrs["tokenpipe.cached_tokens_details.device"] == 16
    assert "tokenpipe.cached_tokens_details.storage" not in attrs  # no storage attached
    assert not any(k.endswith(("image_tokens", "audio_tokens", "video_tokens")) for k in attrs)
    assert attrs["tokenpipe.num_retractions"] == 0


def test_embeddings_span_has_no_generation_attributes() -> None:
    ts = SchedulerTimeStats(
        wait_queue_entry_time=T0 + 0.003,
        forward_entry_time=T0 + 0.004,
        prefill_finished_time=T0 + 0.009,
        completion_time=T0 + 0.009,
        queue_time=0.001,
    )
    state = _state(time_stats=ts, first_token=None)
    state.completion_tokens = 0
    server, children = _split(_export(state, operation="embeddings"))
    assert server.name == f"embeddings {MODEL}"
    assert dict(server.attributes) == {
        "gen_ai.operation.name": "embeddings",
        "gen_ai.provider.name": "tokenpipe",
        "gen_ai.request.model": MODEL,
        "gen_ai.response.id": "req-1",
        "gen_ai.response.finish_reasons": ("length",),
        "gen_ai.usage.input_tokens": 40,
        "gen_ai.usage.cache_read.input_tokens": 16,
        "tokenpipe.num_retractions": 0,
        "tokenpipe.queue_time": 0.001,
    }
    assert list(children) == ["tokenize", "queue", "prefill"]  # no decode stage


def test_pd_decode_request_has_no_prefill_stage_and_decodes_from_its_install() -> None:
    # The prefill server finished its prefill (its clock) before the KV reached this server.
    ts = SchedulerTimeStats(
        wait_queue_entry_time=T0 + 0.003,
        forward_entry_time=T0 + 0.012,
        prefill_finished_time=T0 + 0.008,
        completion_time=T0 + 0.099,
        queue_time=0.009,
        bootstrap_done_time=T0 + 0.011,
        decode_prebuilt_finish_time=T0 + 0.012,
    )
    _, children = _split(_export(_state(time_stats=ts)))
    assert list(children) == ["tokenize", "queue", "decode"]
    assert (children["queue"].start_time, children["queue"].end_time) == (
        _ns(T0 + 0.002),
        _ns(T0 + 0.012),
    )
    assert (children["decode"].start_time, children["decode"].end_time) == (
        _ns(T0 + 0.012),
        _ns(T0 + 0.099),
    )


def test_aborted_request_has_error_status_and_stops_in_the_stage_it_was_in() -> None:
    # Aborted while waiting: never reached a forward pass.
    waiting = SchedulerTimeStats(
        wait_queue_entry_time=T0 + 0.003, completion_time=T0 + 0.050, queue_time=0.047
    )
    state = _state(
        time_stats=waiting,
        finished_reason=FinishAbort(message="aborted by client", status_code=499),
        first_token=None,
    )
    state.completion_tokens = 0
    server, children = _split(_export(state))
    assert server.status.status_code == StatusCode.ERROR
    assert server.status.description == "aborted by client"
    assert server.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert server.attributes["gen_ai.usage.output_tokens"] == 0
    assert list(children) == ["tokenize", "queue"]
    assert (children["queue"].start_time, children["queue"].end_time) == (
        _ns(T0 + 0.002),
        _ns(T0 + 0.050),
    )

    # Aborted mid-prefill: the prefill span ends at the abort, and there is no decode.
    mid_prefill = SchedulerTimeStats(
        wait_queue_entry_time=T0 + 0.003,
        forward_entry_time=T0 + 0.004,
        completion_time=T0 + 0.030,
        queue_time=0.001,
    )
    state = _state(
        time_stats=mid_prefill, finished_reason=FinishAbort(message="gone"), first_token=None
    )
    server, children = _split(_export(state))
    assert server.status.status_code == StatusCode.ERROR
    assert list(children) == ["tokenize", "queue", "prefill"]
    assert children["prefill"].end_time == _ns(T0 + 0.030)


def test_parent_sampled_out_or_invalid_traceparent() -> None:
    traceparent, _, _ = _traceparent(sampled=False)
    assert (
        _export(_state(time_stats=FULL_TIME_STATS, traceparent=traceparent)) == []
    )  # the caller chose not to sample

    server, _ = _split(_export(_state(time_stats=FULL_TIME_STATS, traceparent="00-garbage-xyz-01")))
    assert server.parent is None  # an unparseable parent starts a new trace rather than failing


def test_on_finish_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    exporter = InMemorySpanExporter()
    tracer = RequestTracer(_config(), MODEL, exporter=exporter)
    broken = _state(time_stats=FULL_TIME_STATS)
    broken.created_time = None  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="tokenpipe.tracing"):
        tracer.on_finish(broken)
    assert "could not record the span of request req-1" in caplog.text
    tracer.on_finish(_state(time_stats=FULL_TIME_STATS))  # the next request is traced as usual
    tracer.shutdown()
    assert sum(s.kind == SpanKind.SERVER for s in exporter.get_finished_spans()) == 1
    tracer.on_finish(_state())  # after shutdown: ignored, no error
    tracer.shutdown()  # idempotent


def test_http_traces_url() -> None:
    assert http_traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert http_traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert http_traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"


class _StuckExporter(SpanExporter):
    """A collector that never answers, until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        self.release.wait(60)
        return SpanExportResult.SUCCESS


def test_stuck_collector_blocks_neither_on_finish_nor_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "SHUTDOWN_TIMEOUT_S", 0.5)
    exporter = _StuckExporter()
    tracer = RequestTracer(_config(), MODEL, exporter=exporter)
    try:
        state = _state(time_stats=FULL_TIME_STATS)
        assert tracer.force_flush(timeout_s=0.2)  # nothing queued yet: done at once
        start = time.perf_counter()
        for _ in range(120):  # 600 spans: more than one export batch (512), so the worker is woken
            tracer.on_finish(state)
        per_call = (time.perf_counter() - start) / 120
        assert per_call < 0.02, per_call  # ~0.1-0.5 ms; a blocked call would take the export's 60 s
        assert wait_until(lambda: exporter.calls >= 1, 5.0)  # the export is in progress, stuck
        assert not tracer.force_flush(timeout_s=0.2)  # a flush cannot finish, and says so in time
        start = time.perf_counter()
        tracer.shutdown()  # bounded by SHUTDOWN_TIMEOUT_S (0.5 s here)
        assert time.perf_counter() - start < 1.5
    finally:
        exporter.release.set()


def test_full_queue_warns_once_not_per_span(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")  # read by the SDK's BatchSpanProcessor
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    monkeypatch.setattr(
        tracing._queue_full_filter, "_last", float("-inf")
    )  # forget earlier tests' warnings
    exporter = _StuckExporter()
    tracer = RequestTracer(_config(), MODEL, exporter=exporter)
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(50):  # 250 spans into a queue of 8 while the export hangs
                tracer.on_finish(_state(time_stats=FULL_TIME_STATS))
        assert sum("Queue full" in r.getMessage() for r in caplog.records) == 1
        tracer.shutdown(timeout_s=0.2)
    finally:
        exporter.release.set()


def test_grpc_protocol_builds_a_grpc_exporter() -> None:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
        OTLPSpanExporter as GrpcExporter,
    )

    config = ServerConfig(
        otlp_traces_endpoint=f"http://127.0.0.1:{free_port()}", otlp_traces_protocol="grpc"
    )
    tracer = RequestTracer(config, MODEL)
    try:
        assert isinstance(tracer._processor.span_exporter, GrpcExporter)
        start = time.perf_counter()
        tracer.on_finish(_state(time_stats=FULL_TIME_STATS))
        assert time.perf_counter() - start < 0.1
    finally:
        start = time.perf_counter()
        tracer.shutdown(timeout_s=0.3)  # the export to the closed port is still retrying
        assert time.perf_counter() - start < 1.0


def test_real_otlp_http_export_with_gzip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "gzip"
    )  # read by the SDK's exporter
    monkeypatch.setenv(
        "OTEL_SERVICE_NAME", "tokenpipe-custom"
    )  # read by the SDK's resource detector
    traceparent, trace_id, parent_span_id = _traceparent()
    state = _state(time_stats=FULL_TIME_STATS, traceparent=traceparent, retract_times=[T0 + 0.05])
    with OtlpReceiver() as rx:
        tracer = RequestTracer(_config(rx.endpoint), MODEL)
        tracer.on_finish(state)
        tracer.shutdown()  # flushes before returning
        spans = rx.wait_for(lambda got: len(got) >= 5, timeout=5)
    server = next(s for s in spans if s.kind == "SERVER")
    assert (server.trace_id, server.parent_span_id) == (trace_id, parent_span_id)
    assert server.resource["service.name"] == "tokenpipe-custom"
    assert server.attributes == {
        **span_attributes(state, MODEL),
        "gen_ai.response.finish_reasons": ["length"],
    }
    assert isinstance(server.attributes["gen_ai.request.stream"], bool)
    assert isinstance(server.attributes["gen_ai.request.temperature"], float)
    assert [(e.name, e.time_ns) for e in server.events] == [("retract", _ns(T0 + 0.05))]
    assert sorted(s.name for s in spans if s.parent_span_id == server.span_id) == [
        "decode",
        "prefill",
        "queue",
        "tokenize",
    ]


# --- end to end through a real server ----------------------------------------------------


def _generate(
    client: httpx.Client,
    body: dict,  # type: ignore[type-arg]
    headers: dict[str, str],
) -> tuple[dict, float]:  # type: ignore[type-arg]
    start = time.perf_counter()
    if not body.get("stream"):
        resp = client.post("/generate", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return resp.json()["meta_info"], time.perf_counter() - start
    last: dict = {}  # type: ignore[type-arg]
    with client.stream("POST", "/generate", json=body, headers=headers) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[len("data: ") :])["meta_info"]
    return last, time.perf_counter() - start


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rx:
        yield rx


PROMPT = "Tracing a request through tokenize, queue, prefill and decode, then"


def test_end_to_end_spans_match_meta_info(tmp_path: Path, receiver: OtlpReceiver) -> None:
    server = ServerProcess(
        tmp_path / "tmp",
        ["--otlp-traces-endpoint", receiver.endpoint, "--served-model-name", MODEL],
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    ).wait_ready()
    try:
        bodies = [
            {
                "text": PROMPT,
                "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            },
            # The same prompt again: served partly from the prefix cache.
            {
                "text": PROMPT,
                "sampling_params": {
                    "max_new_tokens": 5,
                    "temperature": 0.8,
                    "top_k": 40,
                    "seed": 7,
                    "ignore_eos": True,
                },
            },
            {
                "text": PROMPT + " streamed",
                "stream": True,
                "sampling_params": {"max_new_tokens": 7, "ignore_eos": True},
            },
        ]
        sent = []
        with server.client() as client:
            for i, body in enumerate(bodies):
                traceparent, trace_id, parent_span_id = _traceparent()
                headers = {"traceparent": traceparent, "tracestate": f"t=r{i}"}
                meta, _ = _generate(client, body, headers)
                sent.append((body, meta, trace_id, parent_span_id))
            # A structured output: its span says which kind and how long its grammar took.
            traceparent, constrained_trace_id, _ = _traceparent()
            constrained = {
                "messages": [{"role": "user", "content": "A code"}],
                "max_tokens": 16,
                "guided_regex": r"\d{3}-[a-z]{4}",
            }
            answer = client.post(
                "/v1/chat/completions", json=constrained, headers={"traceparent": traceparent}
            )
            assert answer.status_code == 200, answer.text
            # The Responses API runs as chat: its span says so, and its route tells it apart.
            traceparent, responses_trace_id, _ = _traceparent()
            responded = client.post(
                "/v1/responses",
                json={"input": "Hi", "max_output_tokens": 5},
                headers={"traceparent": traceparent},
            )
            assert responded.status_code == 200, responded.text
            # So does Anthropic's Messages API.
            traceparent, messages_trace_id, _ = _traceparent()
            messaged = client.post(
                "/v1/messages",
                json={
                    "model": MODEL,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "logit_bias": {"0": -100},  # no EOS: the answer is its 4 tokens
                },
                headers={"traceparent": traceparent},
            )
            assert messaged.status_code == 200, messaged.text
        trace_ids = {t for _, _, t, _ in sent}
        spans = receiver.wait_for(
            lambda got: (
                {s.trace_id for s in got if s.kind == "SERVER"}
                >= trace_ids | {constrained_trace_id, responses_trace_id, messages_trace_id}
                and sum(s.trace_id in trace_ids for s in got) >= 15
            ),
            timeout=15,
        )
    finally:
        server.stop()
    assert sent[1][1]["cached_tokens"] > 0  # the second request really hit the prefix cache
    (constrained_root,) = [
        s for s in spans if s.trace_id == constrained_trace_id and s.kind == "SERVER"
    ]
    assert constrained_root.name == f"chat {MODEL}"
    assert constrained_root.attributes["tokenpipe.constraint.kind"] == "regex"
    assert constrained_root.attributes["http.route"] == "/v1/chat/completions"
    (responses_root,) = [
        s for s in spans if s.trace_id == responses_trace_id and s.kind == "SERVER"
    ]
    assert (
        responses_root.name == f"chat {MODEL}"
        and responses_root.attributes["http.route"] == "/v1/responses"
    )
    usage = responded.json()["usage"]
    assert responses_root.attributes["gen_ai.usage.output_tokens"] == usage["output_tokens"] == 5
    assert responses_root.attributes["gen_ai.usage.input_tokens"] == usage["input_tokens"]
    (messages_root,) = [s for s in spans if s.trace_id == messages_trace_id and s.kind == "SERVER"]
    assert messages_root.name == f"chat {MODEL}"
    assert messages_root.attributes["http.route"] == "/v1/messages"
    usage = messaged.json()["usage"]
    assert messages_root.attributes["gen_ai.usage.output_tokens"] == usage["output_tokens"] == 4
    # Anthropic's input_tokens leave out the cached ones; the span counts the whole prompt.
    assert messages_root.attributes["gen_ai.usage.input_tokens"] == (
        usage["input_tokens"] + usage["cache_read_input_tokens"]
    )
    assert (
        isinstance(constrained_root.attributes["tokenpipe.grammar_wait"], float)
        and constrained_root.attributes["tokenpipe.grammar_wait"] >= 0
    )

    for i, (body, meta, trace_id, parent_span_id) in enumerate(sent):
        mine = [s for s in spans if s.trace_id == trace_id]
        servers = [s for s in mine if s.kind == "SERVER"]
        assert len(servers) == 1, [(s.name, s.kind) for s in mine]
        root: ReceivedSpan = servers[0]
        assert root.name == f"generate {MODEL}"
        assert root.parent_span_id == parent_span_id
        assert root.trace_state == f"t=r{i}"
        assert root.resource["service.name"] == "tokenpipe"
        assert root.status_code == "UNSET"
        children = {s.name: s for s in mine if s.parent_span_id == root.span_id}
        assert set(children) == {"tokenize", "queue", "prefill", "decode"}, [s.name for s in mine]
        assert len(mine) == 5

        # Times are the ones the client saw in meta_info.
        assert abs(root.start_ns - _ns(meta["request_received_ts"])) <= 1000
        assert abs(root.end_ns - _ns(meta["request_finished_ts"])) <= 1000
        assert abs(children["prefill"].start_ns - _ns(meta["forward_entry_time"])) <= 1000
        assert abs(children["prefill"].end_ns - _ns(meta["prefill_finished_time"])) <= 1000
        assert children["queue"].end_ns == children["prefill"].start_ns
        assert children["decode"].start_ns == children["prefill"].end_ns
        assert (
            root.start_ns
            == children["tokenize"].start_ns
            <= children["tokenize"].end_ns
            == children["queue"].start_ns
        )
        assert children["decode"].end_ns <= root.end_ns
        assert len([e for e in root.events if e.name == "retract"]) == meta["num_retractions"]

        attrs = root.attributes
        sampling = body["sampling_params"]
        assert attrs["gen_ai.operation.name"] == "generate" and attrs["http.route"] == "/generate"
        assert attrs["gen_ai.provider.name"] == "tokenpipe"
        assert attrs["gen_ai.request.model"] == MODEL
        assert attrs["gen_ai.request.max_tokens"] == sampling["max_new_tokens"]
        assert attrs["gen_ai.request.temperature"] == pytest.approx(
            sampling.get("temperature", 1.0)
        )
        assert attrs.get("gen_ai.request.top_k") == sampling.get("top_k")
        assert attrs.get("gen_ai.request.seed") == sampling.get("seed")
        assert attrs["gen_ai.request.stream"] is bool(body.get("stream"))
        assert attrs["gen_ai.response.id"] == meta["id"]
        assert attrs["gen_ai.response.finish_reasons"] == [meta["finish_reason"]["type"]]
        assert attrs["gen_ai.usage.input_tokens"] == meta["prompt_tokens"]
        assert (
            attrs["gen_ai.usage.output_tokens"]
            == meta["completion_tokens"]
            == sampling["max_new_tokens"]
        )
        assert attrs["gen_ai.usage.cache_read.input_tokens"] == meta["cached_tokens"]
        assert attrs["tokenpipe.num_retractions"] == meta["num_retractions"]
        assert attrs["tokenpipe.queue_time"] == pytest.approx(meta["queue_time"], abs=1e-9)
        assert (
            "tokenpipe.constraint.kind" not in attrs and "tokenpipe.grammar_wait" not in attrs
        )  # unconstrained
        assert attrs["gen_ai.response.time_to_first_chunk"] == pytest.approx(
            meta["first_token_latency"], abs=1e-9
        )
        details = meta["cached_tokens_details"]
        detail_attrs = {
            k.rsplit(".", 1)[1]: v
            for k, v in attrs.items()
            if k.startswith("tokenpipe.cached_tokens_details.")
        }
        assert detail_attrs == (
            {k: v for k, v in details.items() if v is not None} if details else {}
        )


def test_spans_queued_at_shutdown_are_flushed(tmp_path: Path, receiver: OtlpReceiver) -> None:
    server = ServerProcess(
        tmp_path / "tmp",
        ["--otlp-traces-endpoint", receiver.endpoint],
        env={
            "OTEL_BSP_SCHEDULE_DELAY": "60000"
        },  # no scheduled export: only the shutdown flush sends
    ).wait_ready()
    try:
        traceparent, trace_id, _ = _traceparent()
        with server.client() as client:
            _generate(
                client,
                {"text": "last request before shutdown", "sampling_params": {"max_new_tokens": 3}},
                {"traceparent": traceparent},
            )
    finally:
        server.stop()
    # The API exits only after its flush, so the span is there by the time stop() returns.
    receiver.wait_for(
        lambda got: any(s.trace_id == trace_id and s.kind == "SERVER" for s in got), timeout=0.5
    )


def test_unreachable_collector_does_not_slow_requests(tmp_path: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    server = ServerProcess(
        tmp_path / "tmp",
        ["--otlp-traces-endpoint", closed, "--log-level", "warning"],
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
    ).wait_ready()
    try:
        with server.client() as client:
            for i in range(5):
                body = {
                    "text": f"request {i} to a server whose collector is down",
                    "stream": i % 2 == 1,
                    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True},
                }
                traceparent, _, _ = _traceparent()
                meta, took = _generate(client, body, {"traceparent": traceparent})
                assert meta["completion_tokens"] == 8
                assert took < 2.0, f"request {i} took {took:.2f} s"
            # The exporter did try (and failed) while the requests ran: it only logs.
            assert wait_until(
                lambda: "export" in server.output().lower() and "span" in server.output().lower(),
                10.0,
            ), server.output()
            assert client.get("/health").status_code == 200
            meta, took = _generate(
                client, {"text": "still fine", "sampling_params": {"max_new_tokens": 2}}, {}
            )
            assert took < 2.0
        start = time.perf_counter()
        assert server.stop() == 0
        # The API's bounded tracer shutdown (SHUTDOWN_TIMEOUT_S) keeps the stop prompt.
        assert time.perf_counter() - start < tracing.SHUTDOWN_TIMEOUT_S + 10, server.output()
    finally:
        server.stop()
