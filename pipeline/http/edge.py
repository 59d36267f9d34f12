"""The HTTP edge of tokenpipe's API server: the JSON error shape, API-key checking,
noticing a client that went away, dropping a client too slow to send its request, and
running on uvicorn with a graceful stop. It imports nothing of ``tokenizer_proc``:
``pipeline/`` is the ground floor."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import socket
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.http.read_timeout import nothing, read_timeout_protocol
from pipeline.http.uvicorn_internals import graceful_shutdown_timeout

logger = logging.getLogger("tokenpipe.http")


def error_body(
    status: int, message: str, err_type: str, param: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"message": message, "type": err_type, "code": status}
    if param is not None:
        body["param"] = param
    return {"error": body}


def error_response(
    status: int, message: str, *, err_type: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, err_type, param), status_code=status)


async def until_disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ApiKeyAuth:
    """Pure ASGI middleware (no BaseHTTPMiddleware: it buffers and breaks disconnect
    detection). Every path but ``open_paths`` needs the key, sent as OpenAI's clients send it
    (``Authorization: Bearer KEY``) or as Anthropic's do (``x-api-key: KEY``); either will do.
    A header that is absent never matches, whatever the key."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str]) -> None:
        self.app = app
        self._expected = {
            b"authorization": f"Bearer {api_key}".encode(),
            b"x-api-key": api_key.encode(),
        }
        self._open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self._open_paths:
            if not self._carries_key(scope["headers"]):
                response = error_response(
                    401,
                    "missing or invalid API key (expected `Authorization: Bearer KEY` or "
                    "`x-api-key: KEY`)",
                    err_type="authentication_error",
                )
                # Without it uvicorn would read (and discard) the rest of an unread body
                # before the connection could serve another request: a keyless client
                # could make the server read gigabytes.
                response.headers["connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _carries_key(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        matched = False
        for name, given in headers:
            expected = self._expected.get(name)
            if expected is not None:
                # Constant-time compare, so the key cannot be guessed byte by byte from
                # timing; `|=`, not a return, so a match costs what a miss does.
                matched |= hmac.compare_digest(given, expected)
        return matched


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as the JSON error shape: a Starlette HTTP error (404, 405) keeps its
    status, and an exception no route handled is a 500 that names only its type."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), err_type=err_type)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, _: ClientDisconnect) -> Response:
        # Expected, not an error (uncaught, uvicorn would log it with a traceback). The
        # answer goes nowhere: the client is gone.
        logger.info(
            "a client disconnected while sending its request (%s %s)",
            request.method,
            request.url.path,
        )
        return Response(status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(
            500, f"internal error: {type(exc).__name__}", err_type="internal_error"
        )


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM once ``serve()`` returns, which would kill the
    process before its clean-up runs (flushing queued spans, closing client pools). Here the
    signal only starts uvicorn's graceful shutdown, and the process then exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {
            sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class HttpSettings(Protocol):
    """What serving needs of a config (``ServerConfig`` has it)."""

    host: str
    port: int
    log_level: str
    graceful_timeout: float
    request_read_timeout: float


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with SO_REUSEPORT, for one of several API workers: the
    kernel spreads incoming connections over every worker's socket. SystemExit when the port
    cannot be bound."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"the HTTP server could not start on {host}:{port}: {exc.strerror}"
        ) from None
    sock.set_inheritable(False)
    return sock


async def serve_http(
    app: ASGIApp,
    settings: HttpSettings,
    on_started: Callable[[], None],
    on_read_timeout: Callable[[], None] = nothing,
    reuse_port: bool = False,
) -> None:
    """Runs ``app`` on uvicorn (on the running loop) until SIGTERM/SIGINT, then drains
    requests in flight for up to ``graceful_timeout`` seconds. ``on_started`` runs once the
    port accepts connections; SystemExit when it never does (the port is taken, say).

    A client slower than ``request_read_timeout`` (default 30 s) sending its request headers,
    or between two parts of its body (and ten times that for the whole body), is
    disconnected and ``on_read_timeout`` runs; see ``_ReadTimeoutProtocol``.

    ``reuse_port``: bind with SO_REUSEPORT, so several API workers share the port."""
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
            timeout_graceful_shutdown=graceful_shutdown_timeout(settings.graceful_timeout),
        )
    )
    sockets = [reuse_port_socket(host, port)] if reuse_port else None
    serving = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        on_started()
    await serving
    if not server.started:
        raise SystemExit(f"the HTTP server could not start on {host}:{port}")
