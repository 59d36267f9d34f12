"""The router's HTTP edge: the error shape, API-key checking, which client headers travel
on to the servers, and noticing a client that went away.

The error shape, ``BearerAuth`` and disconnect detection are ``pipeline.http_edge``'s, the
servers' own, so a client sees one API whether it talks to a server or to the router."""

from __future__ import annotations

import msgspec
from fastapi import Request

from pipeline.http_edge import BearerAuth, error_body, error_response, until_disconnected

__all__ = ["BearerAuth", "error_response", "forwarded_headers", "sse_error", "until_disconnected", "OPEN_PATHS"]

OPEN_PATHS = frozenset({"/health"})
# Auth so a keyed server accepts the request; W3C trace context so its span joins the client's trace.
_FORWARDED_HEADERS = ("authorization", "traceparent", "tracestate")
_json = msgspec.json.Encoder()


def sse_error(status: int, message: str, err_type: str) -> bytes:
    """An error inside an SSE stream whose 200 status line has already gone out, framed as the
    servers frame theirs: an error event, then the end of the stream."""
    return b"data: " + _json.encode(error_body(status, message, err_type)) + b"\n\ndata: [DONE]\n\n"


def forwarded_headers(request: Request) -> dict[str, str]:
    headers = {name: request.headers[name] for name in _FORWARDED_HEADERS if name in request.headers}
    headers["content-type"] = "application/json"
    return headers
