"""``pipeline.http.uvicorn_internals`` against the installed uvicorn, served for real in this
process (uvicorn on uvloop, as the API server runs it, and a raw client): ``direct_writer``
recognizes uvicorn's own ``send`` of a started chunked response and writes body parts exactly
as ``send`` frames them, and refuses anything else; ``HttpToolsBase``'s hooks run in a
request's order and what it reads of the connection is there. An upgrade that renames what
the module uses fails here."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
import uvloop
from starlette.types import Message, Receive, Scope, Send

from pipeline.http.uvicorn_internals import HttpToolsBase, direct_writer

SSE_HEADERS = [(b"content-type", b"text/event-stream")]


class RecordingProtocol(HttpToolsBase):
    """Records each hook as it runs, and at the request's end what it reads of the connection."""

    seen: list[Any]

    def connected(self) -> None:
        self.seen.append("connected")

    def connection_ending(self) -> None:
        self.seen.append("connection_ending")

    def bytes_arriving(self) -> None:
        self.seen.append("bytes_arriving")

    def request_began(self) -> None:
        self.seen.append("request_began")

    def headers_read(self) -> None:
        self.seen.append("headers_read")

    def request_read(self) -> None:
        self.seen.append("request_read")
        peer = self.peer
        self.seen.append(
            {
                "peer_host": peer[0] if peer is not None else None,
                "loop": self.event_loop is asyncio.get_running_loop(),
                "reading_paused": self.reading_paused,
                "closing": self.closing,
            }
        )


class AbortingProtocol(HttpToolsBase):
    def headers_read(self) -> None:
        self.abort()


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers by path; each writes what ``direct_writer`` gave it into the body."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/direct":
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        writer = direct_writer(send)
        assert writer is not None and writer.try_write(b"direct ") and writer.try_write(b"")
        await send({"type": "http.response.body", "body": b"send", "more_body": False})
    elif path == "/wrapped":

        async def wrapped(message: Message) -> None:
            await send(message)

        await wrapped({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await wrapped({"type": "http.response.body", "body": repr(direct_writer(wrapped)).encode()})
    elif path == "/unstarted":
        found = direct_writer(send)
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        await send({"type": "http.response.body", "body": repr(found).encode()})
    elif path == "/sized":
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"4")]}
        )
        found = direct_writer(send)
        await send({"type": "http.response.body", "body": b"none" if found is None else b"some"})
    elif path == "/gone":
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        writer = direct_writer(send)
        assert writer is not None and writer.try_write(b"")
        while (await receive())["type"] != "http.disconnect":
            pass
        scope["state"]["written_after_disconnect"] = writer.try_write(b"data: gone\n\n")
    elif path == "/full":
        # The client reads nothing: the kernel's buffers fill, then the transport's, until
        # uvicorn's flow control pauses writing.
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        writer = direct_writer(send)
        assert writer is not None
        part = b"x" * 65536
        written = 0
        while written < 4096 and writer.try_write(part):  # 256 MiB at most: far beyond any buffer
            written += 1
            await asyncio.sleep(0)
        scope["state"]["paused_after_parts"] = written
        while (await receive())["type"] != "http.disconnect":
            pass


@asynccontextmanager
async def serving(
    protocol: type[HttpToolsBase], state: dict[str, Any] | None = None
) -> AsyncIterator[int]:
    """uvicorn serving ``app`` with ``protocol`` on a free loopback port (yielded)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]

    async def with_state(scope: Scope, receive: Receive, send: Send) -> None:
        if state is not None:
            scope["state"] = state
        await app(scope, receive, send)

    server = uvicorn.Server(
        uvicorn.Config(with_state, http=protocol, loop="none", lifespan="off", log_level="warning")
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not task.done(), "uvicorn did not start"
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        await task
        sock.close()


async def request(port: int, path: str, body: bytes = b"") -> bytes:
    """The raw response to a POST of ``body`` to ``path``, read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    try:
        return await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()


def responses(*paths: str) -> dict[str, bytes]:
    async def main() -> dict[str, bytes]:
        async with serving(HttpToolsBase) as port:
            return {path: await request(port, path) for path in paths}

    return uvloop.run(main())


def test_a_direct_write_is_framed_as_uvicorns_send_frames_a_chunk() -> None:
    answer = responses("/direct")["/direct"]
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and b"transfer-encoding: chunked\r\n" in answer
    # The direct part, then send's own, then send's end of the body.
    assert answer.endswith(b"\r\n\r\n7\r\ndirect \r\n4\r\nsend\r\n0\r\n\r\n")


def test_anything_but_uvicorns_own_send_of_a_started_chunked_response_is_refused() -> None:
    answers = responses("/wrapped", "/unstarted", "/sized")
    assert answers["/wrapped"].endswith(b"\r\n\r\n4\r\nNone\r\n0\r\n\r\n")  # a middleware's wrapper
    assert answers["/unstarted"].endswith(
        b"\r\n\r\n4\r\nNone\r\n0\r\n\r\n"
    )  # before http.response.start
    assert answers["/sized"].endswith(b"\r\n\r\nnone")  # a content-length: not chunked


def test_a_gone_client_cannot_be_written_to() -> None:
    state: dict[str, Any] = {}

    async def main() -> None:
        async with serving(HttpToolsBase, state) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /gone HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
            writer.close()
            for _ in range(500):
                if "written_after_disconnect" in state:
                    break
                await asyncio.sleep(0.01)

    uvloop.run(main())
    assert state == {"written_after_disconnect": False}


def test_a_full_connection_cannot_be_written_to() -> None:
    state: dict[str, Any] = {}

    async def main() -> None:
        async with serving(HttpToolsBase, state) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1024)
            writer.transport.pause_reading()
            writer.write(b"POST /full HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
            for _ in range(1000):
                if "paused_after_parts" in state:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    uvloop.run(main())
    assert 0 < state["paused_after_parts"] < 4096


def test_the_hooks_run_in_a_requests_order_and_the_connection_reads() -> None:
    seen: list[Any] = []
    protocol = type("Recording", (RecordingProtocol,), {"seen": seen})

    async def main() -> bytes:
        async with serving(protocol) as port:
            return await request(port, "/sized", b"a body")

    assert uvloop.run(main()).endswith(b"none")
    hooks = [s for s in seen if isinstance(s, str)]
    assert hooks[:5] == [
        "connected",
        "bytes_arriving",
        "request_began",
        "headers_read",
        "request_read",
    ]
    assert hooks[-1] == "connection_ending"
    assert [s for s in seen if isinstance(s, dict)] == [
        {"peer_host": "127.0.0.1", "loop": True, "reading_paused": False, "closing": False}
    ]


def test_abort_drops_the_connection_unanswered() -> None:
    async def main() -> bytes:
        async with serving(AbortingProtocol) as port:
            try:
                return await request(port, "/direct")
            except ConnectionResetError:
                return b""

    assert uvloop.run(main()) == b""
