"""The tracer a server runs: ``RequestTracer`` (``tokenizer_proc/tracing.py``) with
``--otlp-traces-endpoint``, else ``NoTracer``, which records no span and starts no exporter.
The OpenTelemetry SDK is slow to import, so only a server that traces imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import ServerConfig
from tokenizer_proc.req_state import ReqState

if TYPE_CHECKING:
    from tokenizer_proc.tracing import RequestTracer


class NoTracer:
    """Tracing off: the same interface as ``RequestTracer``, doing nothing."""

    def on_finish(self, state: ReqState, operation: str = "generate") -> None:
        pass

    def force_flush(self, timeout_s: float | None = None) -> bool:
        return True

    def shutdown(self, timeout_s: float | None = None) -> None:
        pass


def request_tracer(config: ServerConfig, model_name: str) -> RequestTracer | NoTracer:
    if not config.otlp_traces_endpoint:
        return NoTracer()
    from tokenizer_proc.tracing import RequestTracer

    return RequestTracer(config, model_name)
