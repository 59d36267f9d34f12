"""The streaming half of a streamed request: from the frames that change its states to the
SSE bytes on the client's socket, with as little Python per event as the output allows: one
wake per frame, one write per wake, plain ASGI, and straight to the socket between events
(``SseResponse`` says how each is kept).

What the events say is the ``EventSource``'s business (``tokenizer_proc.native.events`` for
/generate, ``tokenizer_proc.openai.stream`` for completions and chat).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.http.uvicorn_internals import DirectWriter, direct_writer
from tokenizer_proc.req_state import ReqState


class EventSource(Protocol):
    """The events of one stream. ``events`` is called at most once per change of a state,
    and never again for a state after the call that found it finished."""

    @property
    def states(self) -> Sequence[ReqState]: ...

    @property
    def ended(self) -> bool:
        """The stream ends now, whatever is still running (a refusal after it started)."""
        ...

    def opening(self) -> bytes:
        """Events before any output (chat's role chunks)."""
        ...

    def events(self, index: int) -> bytes:
        """The events of state ``index``'s pending output (its finish included)."""
        ...

    def closing(self) -> bytes:
        """The events after the last one (usage, ``[DONE]``)."""
        ...

    def close(self) -> None:
        """The stream is over, finished or not: abort whatever still runs."""
        ...


class Changes:
    """Which of a stream's states changed since the stream last took them, in the order
    they changed (a state that changes again keeps its place), and who to tell: the
    stream's task waiting in ``wait``, or, while the task is parked (``park``), a callback
    the event loop runs once after the frame that marked them."""

    def __init__(
        self,
        states: Sequence[ReqState],
        after_frame: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        self._marked: dict[int, None] = {}
        # Runs a callback once the frame being applied is (ManagerSockets.call_after_frame);
        # without one, the event loop's next turn.
        self._after_frame = after_frame
        self._waiter: asyncio.Future[None] | None = None
        self._pump: Callable[[], None] | None = None
        self._pump_due = False
        self.closed = False
        for index, state in enumerate(states):
            # wait_started leaves a state's first change set: the stream's first take sees it.
            seen = state.event.is_set()
            state.event = _Mark(self, index)
            if seen:
                self._marked[index] = None

    def mark(self, index: int) -> None:
        self._marked[index] = None
        if self._pump is not None:
            if not self._pump_due:
                # After the frame, so every row of it is in before the events are made.
                self._pump_due = True
                self._schedule_pump()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _schedule_pump(self) -> None:
        if self._after_frame is not None:
            self._after_frame(self._run_pump)
        else:
            asyncio.get_running_loop().call_soon(self._run_pump)

    def _run_pump(self) -> None:
        self._pump_due = False
        if self._pump is not None:
            self._pump()

    def close(self) -> None:
        """The client went away: wake the stream for good."""
        self.closed = True
        self._pump = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[int]:
        marked = list(self._marked)
        self._marked.clear()
        return marked

    async def wait(self) -> None:
        """Returns once a state is marked or the stream is closed."""
        if self._marked or self.closed:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def park(self, pump: Callable[[], None]) -> asyncio.Future[None]:
        """Until ``wake``d (or closed), marks run ``pump`` from the event loop instead of
        waking the stream's task. Returns the future ``pump`` resolves (through ``wake``)
        when it needs the task: the task awaits it."""
        self._waiter = asyncio.get_running_loop().create_future()
        self._pump = pump
        if (
            self._marked and not self._pump_due
        ):  # marked while the task was busy: no frame to wait for
            self._pump_due = True
            asyncio.get_running_loop().call_soon(self._run_pump)
        return self._waiter

    def wake(self) -> None:
        """Ends ``park``: the task takes over again."""
        self._pump = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _Mark(asyncio.Event):
    """A streamed state's ``event`` once its stream runs: ``set`` (all that
    ``TokenizerManager`` calls) marks the state in its stream's ``Changes``."""

    def __init__(self, changes: Changes, index: int) -> None:
        super().__init__()
        self._changes = changes
        self._index = index

    def set(self) -> None:
        self._changes.mark(self._index)


class _Stream:
    """One stream's progress: the events made and not yet sent, and which states it has
    reported finished. ``collect`` is the one place that turns changes into events."""

    def __init__(
        self, source: EventSource, after_frame: Callable[[Callable[[], None]], None] | None
    ) -> None:
        self.source = source
        self.states = source.states
        self.changes = Changes(self.states, after_frame)
        self.body = b""
        self.writer: DirectWriter | None = (
            None  # set when events can go straight to the client's socket
        )
        self._reported = [False] * len(self.states)
        self._left = len(self.states)

    def collect(self) -> bool:
        """Adds the events of every marked state to ``body``; True once the stream is over
        (every state reported finished, or the source ended it)."""
        source, states, reported = self.source, self.states, self._reported
        for index in self.changes.take():
            if reported[index]:
                continue
            if states[index].finished:  # finishes come last: this take is its last
                reported[index] = True
                self._left -= 1
            self.body += source.events(index)
            if source.ended:
                return True
        return source.ended or not self._left

    def pump(self) -> None:
        """Run by the event loop after a frame marked this parked stream: its events go
        straight to the client's socket, as uvicorn's ``send`` would write one chunked
        body part, with no task switch and no ASGI message. Anything that needs the task
        (the stream's end, a full socket, a gone client) wakes it instead, with the events
        left in ``body`` for it to send."""
        writer = self.writer
        assert writer is not None, "parked only with a direct writer"
        if self.collect() or not writer.try_write(self.body):
            self.changes.wake()
            return
        self.body = b""


class SseResponse(Response):
    """A 200 ``text/event-stream`` answer whose events come from ``source``.

    - **One wake per frame.** When the stream starts, each state's ``event`` is replaced with a
      ``_Mark``: ``handle_output``'s ``event.set()`` then records the state in the stream's
      ``Changes`` (an ordered set, so the states are taken in the order they changed) and wakes
      the stream's one task. No task or asyncio.Event per state, however many choices.
    - **One write per wake.** Everything the states' pending output makes (one event per
      pending chunk: ``ReqState`` keeps a client that keeps up at one event per row) is joined
      into one ``bytes`` and sent with one ASGI send; the events stay separate SSE events.
      While that send waits on a full socket, the states are marked ``sending``, so rows that
      come meanwhile merge into their last chunk (``ReqState._queue``): a slow reader gets
      fewer, larger events, never an unbounded queue.
    - **Plain ASGI.** ``SseResponse`` sends straight to the server, without a task group or a
      middleware's per-message wrapper. A task waits for the client's disconnect, which ends
      the stream, and the source then aborts whatever has not finished.
    - **Straight to the socket.** Under uvicorn's own ``send`` (no wrapper), a stream between
      events is parked: the frame that changes its states writes their events to the client's
      socket itself, right after the frame (``_Stream.pump``, through
      ``pipeline.http.uvicorn_internals.direct_writer``, which holds every use of uvicorn's
      internals), with no task switch or ASGI message. Its start and end, and any write the
      socket is not ready for, still go through ``send``.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        source: EventSource,
        after_frame: Callable[[Callable[[], None]], None] | None = None,
        on_write_path: Callable[[bool], None] | None = None,
    ) -> None:
        """``after_frame``: ``ManagerSockets.call_after_frame``, so a parked stream's events
        are written right after the frame that made them. ``on_write_path``: told once per
        stream, as it starts, whether its events go straight to the client's socket (True)
        or through ASGI ``send`` (``RequestMetrics.on_sse_stream`` counts them)."""
        self.source = source
        self.after_frame = after_frame
        self.on_write_path = on_write_path
        self.status_code = 200
        self.background = None
        self.init_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        source = self.source
        stream = _Stream(source, self.after_frame)
        changes, states = stream.changes, stream.states
        gone = asyncio.ensure_future(_until_disconnected(receive))
        gone.add_done_callback(lambda _: changes.close())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            writer = stream.writer = direct_writer(send)
            if self.on_write_path is not None:
                self.on_write_path(writer is not None)
            stream.body = source.opening()
            while not stream.collect():
                if stream.body:
                    # The send only waits while the client's socket is full: rows that come
                    # meanwhile merge into their last chunk. (If it raises, the stream is over.)
                    for state in states:
                        state.sending = True
                    await send(
                        {"type": "http.response.body", "body": stream.body, "more_body": True}
                    )
                    for state in states:
                        state.sending = False
                    stream.body = b""
                if writer is None:
                    await changes.wait()
                elif not changes.closed:
                    await changes.park(stream.pump)
                if changes.closed:
                    return
            await send(
                {
                    "type": "http.response.body",
                    "body": stream.body + source.closing(),
                    "more_body": False,
                }
            )
        finally:
            changes.wake()
            gone.cancel()
            source.close()


async def _until_disconnected(receive: Receive) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await receive())["type"] != "http.disconnect":
        pass
