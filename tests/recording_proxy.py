"""A pass-through HTTP proxy that records every request a client sends and the status it got,
for tests that drive a real third-party client (Claude Code) against the server and must
show what it asked and how each ask was answered. Bodies and streams pass unchanged (the
response body is kept too, uncompressed as the server sent it)."""

from __future__ import annotations

import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Headers that describe one hop, not the message (RFC 9110 section 7.6.1), and the length,
# which the proxy's own framing sets.
_HOP_HEADERS = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
)


@dataclass(slots=True)
class Exchange:
    method: str
    path: str  # with its query string
    status: int
    body: bytes
    answer: bytearray  # the response body, as it has come so far


class RecordingProxy:
    """Listens on a free local port and forwards to ``target``; ``exchanges`` lists each
    request in the order its answer began."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.exchanges: list[Exchange] = []
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(
            self._app, host="127.0.0.1", port=self.port, log_level="warning", interface="asgi3"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the recording proxy did not start")
            threading.Event().wait(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        body = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k, v) for k, v in request.headers.items() if k not in _HOP_HEADERS]
        client = httpx.AsyncClient(base_url=self.target, timeout=None)
        upstream = await client.send(
            client.build_request(request.method, path, headers=headers, content=body),
            stream=True,
        )
        exchange = Exchange(request.method, path, upstream.status_code, body, bytearray())
        self.exchanges.append(exchange)
        kept = {k: v for k, v in upstream.headers.items() if k not in _HOP_HEADERS}

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    exchange.answer += chunk
                    yield chunk
            finally:
                await upstream.aclose()
                await client.aclose()

        response = StreamingResponse(relay(), status_code=upstream.status_code, headers=kept)
        await response(scope, receive, send)
