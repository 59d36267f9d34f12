"""What every HTTP server of tokenpipe (the API and the PD router) does the same way: the
JSON error shape, Bearer API-key checking, noticing a client that went away, dropping a client
too slow to send its request, and running on uvicorn with a graceful stop. Kept free of the
tokenizer manager so the router can import it."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("tokenpipe.http")

# The whole body must arrive within this many read timeouts, however steadily it trickles:
# a per-gap bound alone would keep a client sending one byte per gap forever.
_BODY_TIMEOUTS = 10


def error_body(status: int, message: str, err_type: str, param: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"message": message, "type": err_type, "code": status}
    if param is not None:
        body["param"] = param
    return {"error": body}


def error_response(status: int, message: str, *, err_type: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, err_type, param), status_code=status)


async def until_disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class BearerAuth:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it buffers and breaks disconnect
    detection). Every path but ``open_paths`` needs ``Authorization: Bearer KEY``."""

    def __init__(self, app: Any, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._open_paths = open_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Constant-time compare, so the key cannot be guessed byte by byte from timing.
            if not hmac.compare_digest(given, self._expected):
                response = error_response(
                    401, "missing or invalid API key (expected `Authorization: Bearer KEY`)", err_type="authentication_error"
                )
                # Without it uvicorn would read (and discard) the rest of an unread body
                # before the connection could serve another request: a keyless client
                # could make the server read gigabytes.
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as the JSON error shape: a Starlette HTTP error (404, 405) keeps its
    status, and an exception no route handled is a 500 that names only its type."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), err_type=err_type)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}", err_type="internal_error")


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM once ``serve()`` returns, which would kill the
    process before its clean-up runs (flushing queued spans, closing client pools). Here the
    signal only starts uvicorn's graceful shutdown, and the process then exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class _ReadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, plus a bound on how slowly a client may send its request
    (uvicorn's own ``timeout_keep_alive`` covers only an idle connection between requests).

    - Headers: all of them must arrive within ``read_timeout`` of the request's start: the
      connection being made, or the first byte of the next request on a kept-alive one (the
      idle time before it is uvicorn's keep-alive timeout's).
    - Body: at most ``read_timeout`` between two parts, and the whole body within
      ``_BODY_TIMEOUTS`` read timeouts of the headers.
    - Once the request is fully read the timer stops: a long (streamed) response is never cut.
      While uvicorn itself stops reading (the app has not taken the body yet) the client is
      not to blame, and the deadline is postponed.

    A late client's connection is aborted (an ASGI app still running sees a disconnect) and
    ``on_read_timeout`` runs, unless the client sent nothing at all. Set as class attributes by ``read_timeout_protocol``."""

    read_timeout: float = 30.0
    on_read_timeout: Callable[[], None] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers", "body" or None (not reading a request)
        self._body_deadline = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_reading("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reading()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading is None and self.conn.their_state is h11.IDLE:
            self._start_reading("headers")  # the first byte of the next request
        elif self._reading == "body":
            self._arm(min(self.read_timeout, self._body_deadline - self.loop.time()))
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()  # a pipelined request may have started

    def _follow_request(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._reading != "body":
            self._body_deadline = self.loop.time() + _BODY_TIMEOUTS * self.read_timeout
            self._start_reading("body")
        elif state is not h11.IDLE and state is not h11.SEND_BODY:
            self._stop_reading()  # fully read (or the connection is done for)
        elif state is h11.IDLE and self._reading == "body":
            self._stop_reading()  # between requests: the keep-alive timeout's turn

    def _start_reading(self, what: str) -> None:
        self._reading = what
        self._arm(self.read_timeout)

    def _stop_reading(self) -> None:
        self._reading = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _arm(self, delay: float) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.loop.call_later(max(0.0, delay), self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._reading is None or self.transport.is_closing():
            return
        if self.flow.read_paused:
            self._arm(self.read_timeout)  # uvicorn is not reading: not the client's fault
            return
        # A connection that never sent a byte (a browser's preconnect, say) is closed like
        # uvicorn closes an idle kept-alive one: silently, and not counted as a request.
        began = self._reading == "body" or bool(self.conn.trailing_data[0])
        if began:
            logger.info("dropped a client too slow sending its request %s (%s)", self._reading, self.client)
        self._stop_reading()
        self.transport.abort()
        if began and self.on_read_timeout is not None:
            self.on_read_timeout()


def read_timeout_protocol(read_timeout: float, on_read_timeout: Callable[[], None] | None) -> type[H11Protocol]:
    """The uvicorn ``http`` protocol class for one server: a subclass per server, so the
    settings live on it and nothing is shared between servers."""
    return type(
        "ReadTimeoutH11Protocol",
        (_ReadTimeoutProtocol,),
        {"read_timeout": read_timeout, "on_read_timeout": staticmethod(on_read_timeout) if on_read_timeout else None},
    )


class HttpSettings(Protocol):
    """What serving needs of a config (``ServerConfig`` and ``RouterConfig`` both have it)."""

    host: str
    port: int
    log_level: str
    graceful_timeout: float
    request_read_timeout: float


async def serve_http(
    app: FastAPI, settings: HttpSettings, on_started: Callable[[], None], on_read_timeout: Callable[[], None] | None = None
) -> None:
    """Runs ``app`` on uvicorn (on the running loop) until SIGTERM/SIGINT, then drains
    requests in flight for up to ``graceful_timeout`` seconds. ``on_started`` runs once the
    port accepts connections; SystemExit when it never does (the port is taken, say).

    A client slower than ``request_read_timeout`` (default 30 s) sending its request headers,
    or between two parts of its body (and ten times that for the whole body), is
    disconnected and ``on_read_timeout`` runs; see ``_ReadTimeoutProtocol``."""
    host, port = settings.host, settings.port
    server = _GracefulServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            loop="none",
            http=read_timeout_protocol(settings.request_read_timeout, on_read_timeout),
            log_level=settings.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=int(settings.graceful_timeout) or None,
        )
    )
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        on_started()
    await serving
    if not server.started:
        raise SystemExit(f"the HTTP server could not start on {host}:{port}")
