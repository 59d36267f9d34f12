"""What every HTTP route module shares: the error shape, SSE framing, waiting for a
request with disconnect detection, and reading trace context."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from fastapi import Request
from fastapi.responses import JSONResponse

from pipeline.http.edge import error_response, until_disconnected
from pipeline.io_struct import Constraint, FinishAbort, TraceContext
from tokenizer_proc.lora_names import UnknownModel
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager


class ClientGone(Exception):
    """The client disconnected before its request finished."""


def trace_context(request: Request) -> TraceContext | None:
    parent = request.headers.get("traceparent")
    return (
        TraceContext(traceparent=parent, tracestate=request.headers.get("tracestate"))
        if parent
        else None
    )


def not_ready() -> JSONResponse:
    """The answer of /health and /v1/models while the service starts."""
    return error_response(
        503,
        "tokenpipe is starting: the scheduler has not reported through the detokenizer yet",
        err_type="service_unavailable",
    )


def model_not_found(model: str) -> JSONResponse:
    """A request for a model this server does not serve (the served model and its adapters:
    ``GET /v1/models``)."""
    return error_response(404, str(UnknownModel(model)), err_type="not_found_error", param="model")


_ERROR_TYPES = {
    400: "invalid_request_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
}
# Aborts that mean "this request could not run", answered as errors rather than as output
# when they came before any: refused by the scheduler (400); a PD peer failed (502) or did
# not answer in time (504); the waiting queue was full (503 with a retry_after: an
# operator's abort_all is a 503 too, but without one, and is output). Others (a client's or
# an operator's abort) are output.
_REFUSED_STATUSES = frozenset({400, 502, 504})


def refusal(state: ReqState) -> JSONResponse | None:
    """A request that ended before any output, for a reason that is an error, not output.

    An abort of a request the scheduler never reported on (a restarted scheduler lost it,
    503) is always one: there are no stats to build meta_info or usage from."""
    reason = state.finished_reason
    if not isinstance(reason, FinishAbort):
        return None
    unheard = state.request_stats is None
    refused = reason.status_code in _REFUSED_STATUSES or reason.retry_after is not None
    if unheard or (refused and state.completion_tokens == 0):
        return abort_response(reason)
    return None


def constraint_refusal(state: ReqState, constraint: Constraint | None) -> JSONResponse | None:
    """``refusal``'s answer, with ``param`` the constraint's field when the scheduler refused
    its spec (an invalid schema, regex or grammar): ``FinishAbort`` carries no param, but that
    message starts with the field. The generation routes answer through this."""
    refused = refusal(state)
    reason = state.finished_reason
    if refused is None or constraint is None or not isinstance(reason, FinishAbort):
        return refused
    if reason.message.startswith(f"{constraint.param}: "):
        return abort_response(reason, param=constraint.param)
    return refused


def abort_response(
    reason: FinishAbort, message: str | None = None, param: str | None = None
) -> JSONResponse:
    """The error answer for an abort: its status, the error body, and for a full waiting
    queue the ``Retry-After`` header."""
    status = reason.status_code
    response = error_response(
        status,
        reason.message if message is None else message,
        err_type=error_type(status),
        param=param,
    )
    if reason.retry_after is not None:
        # RFC 9110 delay-seconds is a whole number; 0 would invite an immediate retry.
        response.headers["Retry-After"] = str(max(1, math.ceil(reason.retry_after)))
    return response


def first_refused(states: Sequence[ReqState]) -> ReqState | None:
    """The first state (in order) whose finish ``refusal`` answers as an error, if any."""
    return next((s for s in states if s.finished and refusal(s) is not None), None)


def abort_unfinished(tm: TokenizerManager, states: Sequence[ReqState]) -> None:
    for state in states:
        if not state.finished:
            tm.abort(state.req_id)


def error_type(status: int) -> str:
    """The error body's `type` for an abort's status code."""
    return _ERROR_TYPES.get(status, "internal_error" if status >= 500 else "invalid_request_error")


async def wait_started(
    tm: TokenizerManager, states: Sequence[ReqState], request: Request
) -> ReqState | None:
    """Waits until every state has changed once (its first output row, or its finish), so a
    refusal is answered with its own HTTP status before a stream's 200 goes out. Returns
    the refused state, with the others aborted, as soon as any is refused (see
    ``refusal``); None once all have started. A client that disconnects meanwhile aborts
    them all (ClientGone).

    It never clears an event: the stream that follows sees the same first change, so its
    first event is what it would have been without this wait."""
    disconnect = asyncio.ensure_future(until_disconnected(request))
    try:
        while True:
            refused = first_refused(states)
            if refused is not None:
                abort_unfinished(tm, states)
                return refused
            quiet = [s for s in states if not s.event.is_set()]
            if not quiet:
                return None
            if disconnect.done():
                abort_unfinished(tm, states)
                raise ClientGone
            changes = [asyncio.ensure_future(s.event.wait()) for s in quiet]
            await asyncio.wait((*changes, disconnect), return_when=asyncio.FIRST_COMPLETED)
            for change in changes:
                change.cancel()
    finally:
        disconnect.cancel()


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
