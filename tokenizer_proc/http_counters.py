"""The HTTP series every vLLM dashboard reads (``http_requests_total{handler, method, status}``,
the request and response sizes, the two request-duration histograms), made by
prometheus-fastapi-instrumentator's own ``metrics.default`` with its defaults and vLLM's
excluded handlers, so names, labels, buckets and the handler's route template are the
library's. ``HttpCounters`` is the outermost ASGI layer, in front of the key check, the body
limit and ``HotRoutes``, so their answers (401, 413, every generation route) are counted too.

It is not the library's middleware: that one wraps ``send`` in a closure, which would send
every streamed event through ASGI again (``direct_writer`` refuses a wrapper it cannot see
through). Here the wrapper names the ``send`` it wraps (``__wrapped__``) and reads only the
response's start; per request it costs one handler lookup (a dict hit for a fixed path) and
the library's observations, per streamed event nothing (docs/design/metrics.md).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable
from timeit import default_timer
from typing import cast

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from prometheus_fastapi_instrumentator import metrics, routing
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["HttpCounters", "http_observer"]

# vLLM's api_server passes these to the Instrumentator; the library matches each as a regex
# anywhere in the handler (so "/health" leaves out /health_generate too, as in vLLM).
EXCLUDED_HANDLERS = ("/metrics", "/health", "/load", "/ping", "/version", "/server_info")

Observe = Callable[[metrics.Info], None]


def http_observer(registry: CollectorRegistry) -> Observe:
    """The library's default instrumentation (its five series) in ``registry``."""
    observe = metrics.default(registry=registry)
    if observe is None:  # the library's answer when the registry already has them
        raise ValueError("the registry already holds the HTTP series")
    return observe


class _ResponseStart:
    """The ``send`` an app is given: notes the response's status and headers, passes every
    message on. ``__wrapped__`` lets a stream write its body parts past it."""

    __slots__ = ("__wrapped__", "status", "headers")

    def __init__(self, send: Send) -> None:
        self.__wrapped__ = send
        self.status = 500  # the library's count for an answer that never started
        self.headers: list[tuple[bytes, bytes]] = []

    def __call__(self, message: Message) -> Awaitable[None]:
        # Not a coroutine of its own: it hands back the wrapped send's, so a body part sent
        # through it costs no extra frame to create or to resume.
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = message.get("headers", [])
        return self.__wrapped__(message)


class _Lengths:
    """What the library's observations read of a request or a response: ``headers`` with
    the ``Content-Length`` (a streamed answer has none: 0)."""

    __slots__ = ("headers",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        self.headers: dict[str, str] = {}
        for name, value in raw:
            if name.lower() == b"content-length":
                self.headers["Content-Length"] = value.decode("latin-1")
                break


class HttpCounters:
    """Pure ASGI: counts every HTTP answer of ``app`` by the route template of ``routes``
    (the FastAPI app behind the edge), as the library's middleware counts it: the status
    grouped (``2xx``, ``4xx``...), a path no route has as handler ``none``, and the duration
    up to the answer's last byte."""

    def __init__(self, app: ASGIApp, routes: FastAPI, observe: Observe) -> None:
        self.app = app
        self._routes = routes
        self._observe = observe
        # The library's lookup tries every route in turn; a path that is a route's whole
        # template (no parameter) is named by it, so it is looked up once. Bounded: only the
        # routes' own paths are kept.
        self._handlers: dict[str, str] = {}
        self._excluded = re.compile("|".join(EXCLUDED_HANDLERS))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = default_timer()
        path = scope["path"]
        handler = self._handlers.get(path)
        if handler is None:
            handler = self._lookup(scope)
            if handler == path:
                self._handlers[path] = handler
        if self._excluded.search(handler):
            await self.app(scope, receive, send)
            return
        watched = _ResponseStart(send)
        try:
            await self.app(scope, receive, watched)
        finally:
            self._count(scope, handler, watched, default_timer() - start)

    def _lookup(self, scope: Scope) -> str:
        """The library's handler: the matching route's template, or ``none``."""
        found = routing.get_route_name(HTTPConnection({**scope, "app": self._routes}), False)
        return found if found is not None else "none"

    def _count(self, scope: Scope, handler: str, watched: _ResponseStart, took: float) -> None:
        status = watched.status
        info = metrics.Info(
            # Of a request and its answer the library reads only the Content-Length header:
            # it gets that, without a Starlette Request and Response to build per request.
            request=cast(Request, _Lengths(scope["headers"])),
            response=cast(Response, _Lengths(watched.headers)),
            method=scope["method"],
            modified_handler=handler,
            modified_status=f"{str(status)[0]}xx",
            modified_duration=max(took, 0.0),
        )
        self._observe(info)
