"""Anthropic's error shape on the Messages API, ``{"type": "error", "error": {"type",
"message"}}``, with Anthropic's statuses; the one place that maps ours to theirs.

``AnthropicErrors`` rewrites the server's own error answers (``pipeline.http.edge``'s
``error_body``) on ``/v1/messages`` and below, whoever gave them: the key check, the body
limit, FastAPI's 404 and 405, a route. ``anthropic_error`` builds one directly, and
``anthropic_error_body`` its body (also a stream's ``error`` event). Only an error answer
(status >= 400) is held back until its last part, as they are small and sent whole; a 200
stream passes through with one test per message. The message text is kept as it was."""

from __future__ import annotations

import msgspec
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "AnthropicErrors",
    "anthropic_error",
    "anthropic_error_body",
    "anthropic_status",
    "error_type",
]

# Anthropic's "overloaded": its SDK retries it (after Retry-After, when given).
OVERLOADED = 529

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    OVERLOADED: "overloaded_error",
}


def anthropic_status(status: int) -> int:
    """The status Anthropic's clients get for one of ours: any 503 (a full waiting queue, a
    server still starting) is 529 overloaded, which they retry; every other is kept."""
    return OVERLOADED if status == 503 else status


def error_type(status: int) -> str:
    """The error's ``type`` for an Anthropic status."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """The error body in Anthropic's shape (also a stream's ``error`` event); ``status`` is
    ours or already Anthropic's, as ``anthropic_status`` of either is Anthropic's."""
    err_type = error_type(anthropic_status(status))
    return {"type": "error", "error": {"type": err_type, "message": message}}


def anthropic_error(status: int, message: str) -> JSONResponse:
    """An error answer in Anthropic's shape; ``status`` is ours (a 503 leaves as 529)."""
    status = anthropic_status(status)
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


class _OurError(msgspec.Struct):
    message: str
    type: str
    code: int


class _OurErrorBody(msgspec.Struct):
    """``error_body``'s shape; an Anthropic body has no ``code``, so it does not decode."""

    error: _OurError


class AnthropicErrors:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it buffers every body and breaks
    disconnect detection): on ``prefix`` and the paths below it, error answers leave in
    Anthropic's shape. Every other path passes through untouched."""

    def __init__(self, app: ASGIApp, prefix: str = "/v1/messages") -> None:
        self.app = app
        self._prefix = prefix
        self._below = prefix + "/"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._covers(scope["path"]):
            await self.app(scope, receive, _ErrorRewrite(send))
        else:
            await self.app(scope, receive, send)

    def _covers(self, path: str) -> bool:
        return path == self._prefix or path.startswith(self._below)


class _ErrorRewrite:
    """One answer's ``send``: a success goes straight on; an error is held until its last
    body part, then sent whole in Anthropic's shape (or as it was, if not ours)."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._passing = False  # a success started: the rest goes straight on
        self._held: list[Message] = []

    async def __call__(self, message: Message) -> None:
        if self._passing:
            await self._send(message)
            return
        if message["type"] == "http.response.start" and message["status"] < 400:
            self._passing = True
            await self._send(message)
            return
        self._held.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            held, self._held = self._held, []
            for out in _rewritten(held):
                await self._send(out)


def _rewritten(held: list[Message]) -> list[Message]:
    """A whole error answer (its start, then its body parts) in Anthropic's shape, with its
    Content-Length fixed and its other headers (Retry-After, Connection) kept; any answer
    whose body is not our error shape, unchanged."""
    start, *parts = held
    body = b"".join(part.get("body", b"") for part in parts)
    try:
        ours = msgspec.json.decode(body, type=_OurErrorBody)
    except msgspec.DecodeError:
        return held
    status = anthropic_status(start["status"])
    new_body = msgspec.json.encode(anthropic_error_body(status, ours.error.message))
    headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
    headers.append((b"content-length", str(len(new_body)).encode()))
    return [
        {**start, "status": status, "headers": headers},
        {"type": "http.response.body", "body": new_body},
    ]
