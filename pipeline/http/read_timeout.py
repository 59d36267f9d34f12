"""A bound on how slowly a client may send its request, for tokenpipe's API server
(``pipeline.http.edge.serve_http`` installs it): uvicorn's own ``timeout_keep_alive`` covers
only an idle connection between requests, so without it a client that trickles its headers
or body holds a connection (and its buffers) for as long as it likes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pipeline.http.uvicorn_internals import HttpToolsBase

logger = logging.getLogger("tokenpipe.http")

# The whole body must arrive within this many read timeouts, however steadily it trickles:
# a per-gap bound alone would keep a client sending one byte per gap forever.
_BODY_TIMEOUTS = 10


def nothing() -> None:
    """The default ``on_read_timeout``: a server that counts nothing."""


class _ReadTimeoutProtocol(HttpToolsBase):
    """uvicorn's httptools protocol (``HttpToolsBase``, which holds every use of uvicorn's
    internals), plus a bound on how slowly a client may send its request (uvicorn's own
    ``timeout_keep_alive`` covers only an idle connection between requests).

    - Headers: all of them must arrive within ``read_timeout`` of the request's start: the
      connection being made, or the first byte of the next request on a kept-alive one (the
      idle time before it is uvicorn's keep-alive timeout's).
    - Body: at most ``read_timeout`` between two parts, and the whole body within
      ``_BODY_TIMEOUTS`` read timeouts of the headers.
    - Once the request is fully read the timer stops: a long (streamed) response is never cut.
      While uvicorn itself stops reading (the app has not taken the body yet) the client is
      not to blame, and the deadline is postponed.

    A late client's connection is aborted (an ASGI app still running sees a disconnect) and
    ``on_read_timeout`` runs, unless the client sent nothing at all. Set as class attributes
    by ``read_timeout_protocol``."""

    read_timeout: float = 30.0
    on_read_timeout: Callable[[], None] = staticmethod(nothing)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "headers", "body" or None (not reading a request)
        self._began = False  # a byte of the request being read has come
        self._body_deadline = 0.0

    # HttpToolsBase's hooks, as a connection and each request on it are read.

    def connected(self) -> None:
        self._start_reading("headers")

    def connection_ending(self) -> None:
        self._stop_reading()

    def bytes_arriving(self) -> None:
        if self._reading == "body":
            self._arm(min(self.read_timeout, self._body_deadline - self.event_loop.time()))

    def request_began(self) -> None:
        self._began = True
        if self._reading is None:
            self._start_reading("headers")  # the first byte of the next request

    def headers_read(self) -> None:
        self._body_deadline = self.event_loop.time() + _BODY_TIMEOUTS * self.read_timeout
        self._start_reading("body")  # a request without one completes at once

    def request_read(self) -> None:
        self._began = False
        self._stop_reading()  # fully read

    def _start_reading(self, what: str) -> None:
        self._reading = what
        self._arm(self.read_timeout)

    def _stop_reading(self) -> None:
        self._reading = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _arm(self, delay: float) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
        self._read_timer = self.event_loop.call_later(max(0.0, delay), self._read_timed_out)

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._reading is None or self.closing:
            return
        if self.reading_paused:
            self._arm(self.read_timeout)  # uvicorn is not reading: not the client's fault
            return
        # A connection that never sent a byte (a browser's preconnect, say) is closed like
        # uvicorn closes an idle kept-alive one: silently, and not counted as a request.
        began = self._began
        if began:
            logger.info(
                "dropped a client too slow sending its request %s (%s)", self._reading, self.peer
            )
        self._stop_reading()
        self.abort()
        if began:
            self.on_read_timeout()


def read_timeout_protocol(
    read_timeout: float, on_read_timeout: Callable[[], None]
) -> type[HttpToolsBase]:
    """The uvicorn ``http`` protocol class for one server: a subclass per server, so the
    settings live on it and nothing is shared between servers."""
    return type(
        "ReadTimeoutHttpToolsProtocol",
        (_ReadTimeoutProtocol,),
        {
            "read_timeout": read_timeout,
            "on_read_timeout": staticmethod(on_read_timeout),
        },
    )
