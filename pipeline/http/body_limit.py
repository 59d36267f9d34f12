"""The request-body limit of tokenpipe's API server, enforced while the body is read, so an
oversized body never sits in memory.

A request whose ``Content-Length`` is over the limit gets 413 before any of its body is read.
A body without one (chunked) is counted as its ``http.request`` messages arrive; the message
that takes the count over the limit is dropped, the app is told the client went away
(``http.disconnect``), and the client gets the 413 unless the app has already started its
response. So the app holds at most ``max_bytes`` of body, plus the server's own read buffer
(uvicorn pauses reading past 64 KiB). The 413 carries ``Connection: close``: uvicorn then
closes the connection instead of reading and discarding the rest of an oversized body."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.http.edge import error_response
from pipeline.http.read_timeout import nothing

__all__ = ["BodyLimit"]

_DISCONNECT: Message = {"type": "http.disconnect"}


class BodyLimit:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it buffers the body and breaks disconnect
    detection). ``on_reject`` runs once per refused request (the API counts it as
    ``num_rejected_requests_total{reason="body_too_large"}``)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, on_reject: Callable[[], None] = nothing
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_length(scope)
        if declared > self.max_bytes:
            await self.refuse(scope, send)
            return
        if declared >= 0:
            # The server reads exactly the declared length (any more is the next request),
            # so the body cannot outgrow the limit: nothing to count, and no wrapper for a
            # stream's every send.
            await self.app(scope, receive, send)
            return
        await _LimitedRequest(self, scope, receive, send).run()

    async def refuse(self, scope: Scope, send: Send) -> None:
        self.on_reject()
        response = error_response(
            413,
            f"request body is larger than the limit of {self.max_bytes} bytes "
            "(--max-request-bytes)",
            err_type="request_too_large",
        )
        response.headers["connection"] = "close"
        await response(scope, _never_read, send)


def _declared_length(scope: Scope) -> int:
    """The Content-Length, or -1 when there is none. A malformed one is left to the server
    (its parser refuses it before the app is called)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return -1
    return -1


async def _never_read() -> Message:
    # A response only sends; the 413 must not read the body it refuses.
    return _DISCONNECT


class _LimitedRequest:
    """One request's body count: ``receive`` and ``send`` as the app sees them."""

    def __init__(self, limit: BodyLimit, scope: Scope, receive: Receive, send: Send) -> None:
        self._limit, self._scope, self._receive, self._send = limit, scope, receive, send
        self._received = 0
        self._rejected = False
        self._response_started = False

    async def run(self) -> None:
        try:
            await self._limit.app(self._scope, self.receive, self.send)
        except Exception:
            # The app saw a disconnect it may raise on (Starlette's ClientDisconnect); the
            # client already has its 413, so that is no error of the server's.
            if not self._rejected:
                raise

    async def receive(self) -> Message:
        if self._rejected:
            return _DISCONNECT
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if self._received > self._limit.max_bytes:
                # If the app has already started its answer the 413 cannot go out; the body is
                # still read no further, and the answer is cut off.
                self._rejected = True
                if not self._response_started:
                    await self._limit.refuse(self._scope, self._send)
                return _DISCONNECT
        return message

    async def send(self, message: Message) -> None:
        # After a 413 the response is over: what the app still sends has no one to go to.
        if self._rejected:
            return
        if message["type"] == "http.response.start":
            self._response_started = True
        await self._send(message)
