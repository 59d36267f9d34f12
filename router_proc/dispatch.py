"""One PD request: its prefill half and decode half sent at once, and the decode half's
answer relayed to the client once the prefill half has answered 200.

Invariants:
- Nothing waits without a bound: every server call runs under the client's timeouts
  (connect, and ``--request-timeout`` for each read).
- Every exit before the client has its whole answer (a failed half, a client that went
  away, a stream cut short) releases the decode half: its connection is closed, which makes
  the decode server abort the request, and a /generate request is also aborted by rid.
- The prefill half's answer is only checked, never shown, unless it is the failure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from router_proc.bodies import pair_bodies
from router_proc.http_common import error_response, forwarded_headers, sse_error, until_disconnected
from router_proc.peers import Peer, PeerError, Peers

logger = logging.getLogger("tokenpipe.router")

_CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection first


class Dispatcher:
    def __init__(self, client: httpx.AsyncClient, peers: Peers, *, request_timeout: float) -> None:
        self._client = client
        self._peers = peers
        self._timeout = request_timeout
        self._background: set[asyncio.Task[None]] = set()  # releases in flight, kept from the GC

    async def forward(self, request: Request, obj: dict[str, Any]) -> Response:
        path = request.url.path
        pair = await self._peers.pair()
        bodies = pair_bodies(obj, pair.bootstrap_endpoint, native=path == "/generate")
        headers = forwarded_headers(request)
        prefill = _quiet_task(self._prefill(path, bodies.prefill, headers))
        decode = _quiet_task(self._open_decode(path, bodies.decode, headers))
        gone = asyncio.ensure_future(until_disconnected(request))
        delivered = False
        try:
            answer = await self._settle(prefill, decode, gone)
            if isinstance(answer, Response):
                return answer
            if answer.headers.get("content-type", "").startswith("text/event-stream"):
                delivered = True  # from here the relay owns the decode half
                return StreamingResponse(
                    self._relay(answer, bodies.rid), status_code=answer.status_code, media_type=answer.headers["content-type"]
                )
            body = await answer.aread()
            delivered = True
            return Response(body, status_code=answer.status_code, media_type=answer.headers.get("content-type"))
        except httpx.HTTPError as exc:  # reading a non-streamed decode answer
            return _error(self._failed(self._peers.decode, exc))
        finally:
            gone.cancel()
            prefill.cancel()
            if not delivered:
                self._spawn(self._release(decode, bodies.rid))

    async def _settle(
        self, prefill: asyncio.Task[Response | None], decode: asyncio.Task[httpx.Response | PeerError], gone: asyncio.Future[None]
    ) -> httpx.Response | Response:
        """Waits until the prefill half has answered 200 and the decode half's status line is
        in: then returns the decode response (200, body unread). Returns the error response
        as soon as either half fails or the client goes away."""
        waiting: set[asyncio.Future[Any]] = {prefill, decode, gone}
        while prefill in waiting or decode in waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            waiting -= done
            if gone in done:
                return Response(status_code=_CLIENT_CLOSED)
            # When both are done, the prefill half's failure is the cause: report it.
            if prefill in done and (failure := prefill.result()) is not None:
                return failure
            if decode in done:
                opened = decode.result()
                if isinstance(opened, PeerError):
                    return _error(opened)
                if opened.status_code != 200:
                    # A refusal (400, 401...) or the decode server's own error: the client's answer.
                    body = await opened.aread()
                    return Response(body, status_code=opened.status_code, media_type=opened.headers.get("content-type"))
        return decode.result()  # type: ignore[return-value]

    async def _prefill(self, path: str, body: bytes, headers: dict[str, str]) -> Response | None:
        """None when the prefill half answered 200, else the client's error response."""
        peer = self._peers.prefill
        try:
            response = await self._client.post(peer.url + path, content=body, headers=headers)
        except httpx.HTTPError as exc:
            return _error(self._failed(peer, exc))
        if response.status_code == 200:
            return None
        return Response(response.content, status_code=response.status_code, media_type=response.headers.get("content-type"))

    async def _open_decode(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response | PeerError:
        peer = self._peers.decode
        try:
            return await self._client.send(self._client.build_request("POST", peer.url + path, content=body, headers=headers), stream=True)
        except httpx.HTTPError as exc:
            return self._failed(peer, exc)

    async def _relay(self, response: httpx.Response, rid: str | None) -> AsyncIterator[bytes]:
        """The decode server's SSE bytes, unchanged. Cancelled when the client goes away."""
        complete = False
        ends_event = True
        try:
            async for chunk in response.aiter_raw():
                if chunk:
                    ends_event = chunk.endswith(b"\n\n")
                    yield chunk
            complete = True
        except httpx.HTTPError as exc:
            failure = self._failed(self._peers.decode, exc)
            logger.warning("decode stream cut short: %s", failure.message)
            yield (b"" if ends_event else b"\n\n") + sse_error(failure.status, failure.message, failure.err_type)
        finally:
            # No await here: a cancelled generator may not get to run one.
            self._spawn(self._close_stream(response, None if complete else rid))

    async def _release(self, decode: asyncio.Task[httpx.Response | PeerError], rid: str | None) -> None:
        decode.cancel()  # still connecting or waiting for the status line: closes the connection
        await asyncio.wait({decode})
        opened = None if decode.cancelled() else decode.result()
        await self._close_stream(opened if isinstance(opened, httpx.Response) else None, rid)

    async def _close_stream(self, response: httpx.Response | None, rid: str | None) -> None:
        if response is not None:
            await response.aclose()
        if rid is not None:
            await self._peers.abort(self._peers.decode, rid)

    def _failed(self, peer: Peer, exc: httpx.HTTPError) -> PeerError:
        failure = peer.failed(exc, self._timeout)
        if failure.status == 502:
            self._peers.forget()
        return failure

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _quiet_task(work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
    """A task whose late exception (after the router stopped waiting for it) is logged once
    instead of as 'exception was never retrieved'."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_log_late_exception)
    return task


def _log_late_exception(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.warning("peer call failed: %r", task.exception())


def _error(failure: PeerError) -> Response:
    return error_response(failure.status, failure.message, err_type=failure.err_type)
