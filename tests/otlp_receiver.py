"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with a protobuf
``ExportTraceServiceRequest`` body (gzip or deflate ``Content-Encoding`` accepted), answered
with an empty ``ExportTraceServiceResponse``. Decoded spans are kept as plain Python values.

    with OtlpReceiver() as rx:
        ...  # point the exporter at rx.endpoint
        rx.wait_for(lambda spans: len(spans) >= 3, timeout=15)
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

# Names as the OTel API spells them (opentelemetry.trace.SpanKind / StatusCode).
_KINDS = {
    Span.SPAN_KIND_UNSPECIFIED: "UNSPECIFIED",
    Span.SPAN_KIND_INTERNAL: "INTERNAL",
    Span.SPAN_KIND_SERVER: "SERVER",
    Span.SPAN_KIND_CLIENT: "CLIENT",
    Span.SPAN_KIND_PRODUCER: "PRODUCER",
    Span.SPAN_KIND_CONSUMER: "CONSUMER",
}
_STATUS = {
    Status.STATUS_CODE_UNSET: "UNSET",
    Status.STATUS_CODE_OK: "OK",
    Status.STATUS_CODE_ERROR: "ERROR",
}


def any_value(value: AnyValue) -> Any:
    which = value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if which == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, which)  # string / bool / int / double / bytes


def attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: any_value(kv.value) for kv in kvs}  # type: ignore[union-attr]


@dataclass
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: str  # "SERVER", "INTERNAL", ...
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[SpanEvent]
    status_code: str  # "UNSET", "OK", "ERROR"
    status_message: str
    trace_state: str
    resource: dict[str, Any] = field(default_factory=dict)
    scope: str = ""


def _decode_span(span: Span, resource: dict[str, Any], scope: str) -> ReceivedSpan:
    return ReceivedSpan(
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        kind=_KINDS.get(span.kind, str(span.kind)),
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        attributes=attributes(span.attributes),
        events=[SpanEvent(e.name, e.time_unix_nano, attributes(e.attributes)) for e in span.events],
        status_code=_STATUS.get(span.status.code, str(span.status.code)),
        status_message=span.status.message,
        trace_state=span.trace_state,
        resource=resource,
        scope=scope,
    )


class OtlpReceiver:
    """ThreadingHTTPServer on 127.0.0.1, an ephemeral port by default."""

    def __init__(self, port: int = 0) -> None:
        self._spans: list[ReceivedSpan] = []
        self._cond = threading.Condition()
        self.requests = 0  # export requests accepted
        self.bad_requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass  # keep test output quiet

            def _reply(
                self, status: int, body: bytes, content_type: str = "application/x-protobuf"
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.split("?", 1)[0] != "/v1/traces":
                    self._reply(404, b"not found", "text/plain")
                    return
                try:
                    encoding = (self.headers.get("Content-Encoding") or "").lower()
                    if encoding == "gzip":
                        body = gzip.decompress(body)
                    elif encoding == "deflate":
                        body = zlib.decompress(body)
                    request = ExportTraceServiceRequest()
                    request.ParseFromString(body)
                except Exception as exc:  # noqa: BLE001
                    with receiver._cond:
                        receiver.bad_requests += 1
                    self._reply(400, str(exc).encode(), "text/plain")
                    return
                receiver._store(request)
                self._reply(200, ExportTraceServiceResponse().SerializeToString())

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        """Base URL, without the signal path."""
        return f"http://127.0.0.1:{self.port}"

    def _store(self, request: ExportTraceServiceRequest) -> None:
        decoded = []
        for rs in request.resource_spans:
            resource = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                decoded.extend(_decode_span(s, resource, ss.scope.name) for s in ss.spans)
        with self._cond:
            self.requests += 1
            self._spans.extend(decoded)
            self._cond.notify_all()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float
    ) -> list[ReceivedSpan]:
        """Waits until ``predicate(spans)`` holds and returns the spans; raises
        TimeoutError with what arrived when it does not within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(list(self._spans)):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [(s.name, s.trace_id) for s in self._spans]
                    raise TimeoutError(
                        f"OTLP receiver: condition not met in {timeout} s; spans so far: {names}"
                    )
                self._cond.wait(left)
            return list(self._spans)

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
