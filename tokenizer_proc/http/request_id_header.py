"""``X-Request-Id``, vLLM's request-id header (``pipeline/request_ids.py`` says what it may
hold). In: a route reads the caller's id with ``caller_request_id`` (a 400 naming the header
when it is malformed) and names its request by it. Out, with ``--enable-request-id-headers``:
``RequestIdHeader`` puts the header on every answer, carrying the id the route ran its request
under (``answered_id``), else the caller's, else a new one, as vLLM's middleware does.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.request_ids import HEADER, request_id_problem
from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = ["RequestIdHeader", "answered_id", "caller_request_id"]

_RAW_HEADER = HEADER.lower().encode()
_SCOPE_KEY = "tokenpipe.request_id"


def caller_request_id(request: Request) -> str | None:
    """The caller's ``X-Request-Id``, or None without one; a malformed one is a 400."""
    value = request.headers.get(HEADER)
    if value is None:
        return None
    problem = request_id_problem(value)
    if problem is not None:
        raise RequestValidationError(problem, HEADER)
    return value


def answered_id(request: Request, request_id: str) -> None:
    """The id the answer's ``X-Request-Id`` carries (with --enable-request-id-headers)."""
    request.scope[_SCOPE_KEY] = request_id


class _WithHeader:
    """The ``send`` an app is given: adds the header to the response's start. Body parts
    need nothing of it, so ``__wrapped__`` lets a stream write them past it."""

    __slots__ = ("__wrapped__", "_scope")

    def __init__(self, send: Send, scope: Scope) -> None:
        self.__wrapped__ = send
        self._scope = scope

    def __call__(self, message: Message) -> Awaitable[None]:
        # The wrapped send's own awaitable: no extra frame per body part.
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", []))
            if all(name.lower() != _RAW_HEADER for name, _ in headers):
                headers.append((_RAW_HEADER, _answer_id(self._scope).encode()))
                message = {**message, "headers": headers}
        return self.__wrapped__(message)


def _answer_id(scope: Scope) -> str:
    answered: str | None = scope.get(_SCOPE_KEY)
    if answered is not None:
        return answered
    for name, value in scope["headers"]:
        if name == _RAW_HEADER:
            given = value.decode("latin-1")
            # Never echo a value the routes would refuse (it could break a log or a client).
            return given if request_id_problem(given) is None else uuid.uuid4().hex
    return uuid.uuid4().hex


class RequestIdHeader:
    """Pure ASGI: every HTTP answer of ``app`` carries ``X-Request-Id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _WithHeader(send, scope))
