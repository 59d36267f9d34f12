"""The routes of the API's requests, served without FastAPI's routing and middleware stack.

Nearly every request is a ``POST`` to /generate, /v1/completions or /v1/chat/completions.
Through FastAPI each pays for the route search, its exception and exit-stack middlewares,
and for a stream a wrapper of every ``send`` in each of them. ``HotRoutes`` sits in front of
the app and calls those routes' endpoints itself, with a plain Starlette ``Request``; an
exception becomes the answer the app's own exception handler gives it (the JSON error
shape), so the routes answer exactly as through FastAPI. Everything else, and any other
method or path (a trailing slash's redirect included), goes to the app unchanged. Every
route whose body is one of the API's requests is served here, so that each answer passes
one place, which names the fields its body's decode ignored (``ignored_fields``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from fastapi import APIRouter, FastAPI, Request
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from tokenizer_proc.http.ignored_fields import name_ignored_fields, open_ignored_fields

logger = logging.getLogger("tokenpipe.http")

Endpoint = Callable[[Request], Awaitable[Response]]


class HotRoutes:
    """Pure ASGI: a ``POST`` to one of ``endpoints``' paths goes straight to its endpoint
    (the same function the app routes it to); everything else goes to ``app``. With
    ``ignore_unknown_fields`` (not under --reject-unknown-fields) each such request's unknown
    fields are ignored and named on its answer."""

    def __init__(
        self, app: FastAPI, endpoints: Mapping[str, Endpoint], *, ignore_unknown_fields: bool
    ) -> None:
        self.app = app
        self._endpoints = dict(endpoints)
        self._ignore_unknown_fields = ignore_unknown_fields

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._endpoints.get(scope["path"])
            if endpoint is not None:
                if self._ignore_unknown_fields:
                    open_ignored_fields(scope)
                request = Request(scope, receive)
                try:
                    response = await endpoint(request)
                except ClientDisconnect:
                    # No one to answer (or BodyLimit answered: it drops the body it refused).
                    # Expected, not an error: clients do leave.
                    logger.info(
                        "a client disconnected while sending its request (%s %s)",
                        scope["method"],
                        scope["path"],
                    )
                    return
                except Exception as exc:
                    response = await self._handled(request, exc)
                name_ignored_fields(scope, response)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _handled(self, request: Request, exc: Exception) -> Response:
        """The answer the app's exception handler for ``exc`` gives (the nearest class up
        its MRO, as Starlette looks one up)."""
        handlers = self.app.exception_handlers
        handler = next((handlers[cls] for cls in type(exc).__mro__ if cls in handlers), None)
        if handler is None:
            raise exc
        if handler is handlers.get(Exception):
            # An unexpected error: answered (a 500), and logged, as under Starlette's
            # ServerErrorMiddleware the server logs it.
            logger.error("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        answer = handler(request, exc)
        # Starlette takes plain functions as handlers too; this app's are all coroutines.
        return await answer if isinstance(answer, Awaitable) else answer


def post_endpoints(router: APIRouter, paths: Iterable[str]) -> dict[str, Endpoint]:
    """The endpoints of ``router``'s POST routes at ``paths``: each must be exactly one."""
    endpoints = {}
    for path in paths:
        found = [
            r
            for r in router.routes
            if isinstance(r, APIRoute) and r.path == path and "POST" in (r.methods or ())
        ]
        if len(found) != 1:
            raise ValueError(
                f"the router has {len(found)} POST routes for {path}; HotRoutes serves exactly one"
            )
        endpoints[path] = found[0].endpoint
    return endpoints
