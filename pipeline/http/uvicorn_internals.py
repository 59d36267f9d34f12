"""Every use tokenpipe makes of uvicorn's private internals, all of
``uvicorn.protocols.http.httptools_impl``, in one module: the base of the API server's
protocol (``HttpToolsBase``, which ``read_timeout`` builds on) and the direct write of a
streamed response's body parts (``direct_writer``, which ``sse_stream`` uses). No other module
names them; ``edge`` uses uvicorn's public ``Server`` (overriding ``capture_signals``) and
``Config`` (``graceful_shutdown_timeout`` here says what its type does not).

Written against uvicorn 0.55.0 and httptools 0.9.0. pyproject.toml bounds both to the
releases these names are known in: a new uvicorn minor may rename any of them, and then the
server either fails here, at once, or quietly drops to the slow path.
tests/unit/test_uvicorn_internals.py checks each use against the installed uvicorn, and
tests/e2e/test_uvicorn_fast_path.py fails when a stream does not take the direct path."""

from __future__ import annotations

import asyncio
from typing import cast

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle


class HttpToolsBase(HttpToolsProtocol):
    """uvicorn's httptools protocol (its fast one: llhttp parses in C, and a response body is
    one transport write with no per-message state machine in Python), with hooks for a
    subclass, which then names nothing of uvicorn's. Each hook is a no-op here; all but
    ``bytes_arriving`` and ``connection_ending`` run after uvicorn's own handling.

    Of ``HttpToolsProtocol`` (the asyncio protocol of one connection), used: the parser's
    callbacks ``on_message_begin`` (a request's first byte), ``on_headers_complete`` and
    ``on_message_complete`` (its body fully read), and ``connection_made``,
    ``connection_lost`` and ``data_received``, each extended here and still running uvicorn's;
    read: ``loop``, ``transport``, ``flow.read_paused`` (uvicorn stopped reading: its app has
    not taken the body so far) and ``client`` (the peer's address)."""

    # uvicorn narrows asyncio's BaseTransport to Transport here itself (with the same ignore).
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.connected()

    def connection_lost(self, exc: Exception | None) -> None:
        self.connection_ending()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.bytes_arriving()
        super().data_received(data)

    # llhttp's callbacks, as the parser reaches each part of a request.

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.request_began()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self.headers_read()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.request_read()

    # The hooks.

    def connected(self) -> None:
        """The connection is made."""

    def connection_ending(self) -> None:
        """The connection is lost (before uvicorn cleans up after it)."""

    def bytes_arriving(self) -> None:
        """Bytes came, about to be parsed (each of the callbacks below may run for them)."""

    def request_began(self) -> None:
        """A request's first byte came (on a kept-alive connection: the next request's)."""

    def headers_read(self) -> None:
        """The request's headers are all read; its body, if any, follows."""

    def request_read(self) -> None:
        """The request is fully read, body included."""

    # What a subclass may read of the connection.

    @property
    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop

    @property
    def peer(self) -> tuple[str, int] | None:
        """The client's address (None over a Unix socket)."""
        return self.client

    @property
    def reading_paused(self) -> bool:
        """uvicorn stopped reading the connection (its app has not taken the body so far)."""
        return self.flow.read_paused

    @property
    def closing(self) -> bool:
        return self.transport.is_closing()

    def abort(self) -> None:
        """Closes the connection at once, dropping whatever is unsent (an ASGI app still running
        sees a disconnect)."""
        self.transport.abort()


class DirectWriter:
    """The body parts of one started, chunked response written straight to its connection,
    as uvicorn's ``send`` writes one, with no ASGI message, no task switch and no await. The
    response stays uvicorn's: its end still goes through ``send``, and so does any part
    ``try_write`` refuses (``send`` then waits for the client).

    Of ``RequestResponseCycle`` (one request's response; the ASGI ``send`` uvicorn gives the
    app is its bound method ``send``, which writes a chunked body part as ``%x\\r\\n`` (the
    size), the part, ``\\r\\n`` straight to the transport), read: ``chunked_encoding`` (True
    once a response without a content-length has started), ``disconnected`` (the client went
    away), ``transport``, and ``flow.write_paused`` (the transport's buffer is over its
    high-water mark: uvicorn's ``send`` would wait)."""

    __slots__ = ("_cycle", "_flow", "_write")

    def __init__(self, cycle: RequestResponseCycle) -> None:
        # The cycle's flow control and transport are its connection's: fixed for its life,
        # so taken once here rather than looked up per write.
        self._cycle = cycle
        self._flow = cycle.flow
        self._write = cycle.transport.write

    def try_write(self, body: bytes) -> bool:
        """Writes ``body`` (if any) as one chunk of the response and returns True; or, when the
        client is gone or its connection's buffer is full, writes nothing and returns False.
        One call for both, since a stream makes it once per frame."""
        if self._cycle.disconnected or self._flow.write_paused:
            return False
        if body:  # an empty chunk would end the body
            self._write(b"%x\r\n%b\r\n" % (len(body), body))
        return True


def direct_writer(send: Send) -> DirectWriter | None:
    """A ``DirectWriter`` for the response ``send`` has started, when ``send`` is uvicorn's
    own, unwrapped one and the response is chunked; None otherwise (another server or
    protocol, a middleware's wrapper, a response with a content-length, or one not started),
    and every body part then goes through ``send`` (a stream that does so counts in
    ``tokenpipe:sse_streams_total{write_path="asgi"}``). A wrapper that names the ``send``
    it wraps as ``__wrapped__`` (functools' convention) says that body parts written past it
    lose nothing it needs (it reads only the response's start): it is looked through."""
    while (inner := getattr(send, "__wrapped__", None)) is not None:
        send = inner
    cycle = getattr(send, "__self__", None)
    if (
        type(cycle) is RequestResponseCycle
        and cycle.chunked_encoding
        and getattr(send, "__func__", None) is RequestResponseCycle.send
    ):
        return DirectWriter(cycle)
    return None


def graceful_shutdown_timeout(seconds: float) -> int:
    """``uvicorn.Config(timeout_graceful_shutdown=...)`` for a drain of ``seconds``: uvicorn
    types it ``int | None`` but hands it to ``asyncio.timeout``, which takes float seconds, and
    None waits for ever. So a fraction of a second is passed as it is (``int(0.5) or None``
    was None: a wait without end), and 0 cancels what is in flight at once."""
    return cast(int, seconds)
