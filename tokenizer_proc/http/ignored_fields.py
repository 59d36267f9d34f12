"""The request fields a lenient body decode ignored (docs/api.md, "Unknown fields"): each
request's list of their paths, which its route hands to ``decode_body``, and the answer's
``X-Ignored-Fields`` header and the warning that name them.

``HotRoutes`` opens the list for each request it serves (not under --reject-unknown-fields:
then there is no list, and ``decode_body`` refuses an unknown field) and names what is in it
on the answer, a success or an error alike. The list lives in the ASGI scope, so a route
that hands its request on (``/invocations``) fills the same one."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

logger = logging.getLogger("tokenpipe.http")

HEADER = "x-ignored-fields"
# A header stays small whatever the body held: clients refuse large header blocks (httpx's
# parser stops at 64 KiB). Past this the list ends with "...".
MAX_HEADER_CHARS = 2048
_SCOPE_KEY = "tokenpipe.ignored_fields"


def open_ignored_fields(scope: Scope) -> None:
    """Gives the request of ``scope`` an empty list: its unknown fields are ignored."""
    scope[_SCOPE_KEY] = []


def ignored_fields(request: Request) -> list[str] | None:
    """The list ``decode_body`` notes the request's ignored fields in; None when unknown
    fields are refused."""
    found: list[str] | None = request.scope.get(_SCOPE_KEY)
    return found


def name_ignored_fields(scope: Scope, response: Response) -> None:
    """Names the request's ignored fields, if any, in ``response``'s header and in a warning
    (the names only: what a field held is never logged)."""
    paths: list[str] | None = scope.get(_SCOPE_KEY)
    if not paths:
        return
    value = header_value(paths)
    response.headers[HEADER] = value
    logger.warning(
        "%s %s: the request's unknown fields were ignored: %s",
        scope["method"],
        scope["path"],
        value,
    )


def header_value(paths: list[str]) -> str:
    """The paths, each once, in order, comma-separated; cut at ``MAX_HEADER_CHARS``. Each
    path is printable ASCII without commas (``decode_body`` quotes any other key)."""
    value = ""
    for path in dict.fromkeys(paths):
        joined = f"{value}, {path}" if value else path
        if len(joined) > MAX_HEADER_CHARS:
            return f"{value}, ..." if value else "..."
        value = joined
    return value
