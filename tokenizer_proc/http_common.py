"""What every HTTP route module shares: the error shape, SSE framing, waiting for a
request with disconnect detection, and reading trace context."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse

from pipeline.http_edge import error_response, until_disconnected
from pipeline.io_struct import FinishAbort, TraceContext
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager

_json = msgspec.json.Encoder()


class ClientGone(Exception):
    """The client disconnected before its request finished."""


def sse(payload: Any) -> bytes:
    return b"data: " + _json.encode(payload) + b"\n\n"


def trace_context(request: Request) -> TraceContext | None:
    parent = request.headers.get("traceparent")
    return TraceContext(traceparent=parent, tracestate=request.headers.get("tracestate")) if parent else None


_ERROR_TYPES = {400: "invalid_request_error", 502: "bad_gateway", 503: "service_unavailable", 504: "gateway_timeout"}
# Aborts that mean "this request could not run", answered as errors rather than as output
# when they came before any: refused by the scheduler (400); a PD peer failed (502) or did
# not answer in time (504). Others (a client's or an operator's abort) are output.
_REFUSED_STATUSES = frozenset({400, 502, 504})


def refusal(state: ReqState) -> JSONResponse | None:
    """A request that ended before any output, for a reason that is an error, not output.

    An abort of a request the scheduler never reported on (a restarted scheduler lost it,
    503) is always one: there are no stats to build meta_info or usage from."""
    reason = state.finished_reason
    if not isinstance(reason, FinishAbort):
        return None
    unheard = state.request_stats is None
    if unheard or (reason.status_code in _REFUSED_STATUSES and state.completion_tokens == 0):
        return error_response(reason.status_code, reason.message, err_type=error_type(reason.status_code))
    return None


def error_type(status: int) -> str:
    """The error body's `type` for an abort's status code."""
    return _ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")


async def wait_finished(tm: TokenizerManager, state: ReqState, request: Request) -> None:
    """Waits for the finish, or aborts the request as soon as the client disconnects."""
    disconnect = asyncio.ensure_future(until_disconnected(request))
    try:
        while not state.finished:
            changed = asyncio.ensure_future(state.event.wait())
            await asyncio.wait((changed, disconnect), return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            state.event.clear()
            if disconnect.done() and not state.finished:
                tm.abort(state.req_id)
                raise ClientGone
    finally:
        disconnect.cancel()
