"""What every HTTP server of tokenpipe (the API and the PD router) does the same way: the
JSON error shape, Bearer API-key checking, and noticing a client that went away. Kept
free of the tokenizer manager so the router can import it."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse


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
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
