"""The tokenizer manager's sockets: a PUSH to the scheduler, and a PULL the detokenizer's
frames arrive on. Each frame is applied by one call, then the callbacks asked for while it
was applied run, once each (streams write their events then: one write per stream per frame).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from pipeline.config import ServerConfig
from pipeline.io_struct import SchedulerInput, TokenizerManagerInput
from pipeline.sockets import (
    FrameDecoder,
    RateLimitedWarning,
    bind_pull,
    connect_push,
    make_encoder,
    receive_frames,
)

logger = logging.getLogger("tokenpipe.tokenizer_manager")


class ManagerSockets:
    def __init__(
        self,
        config: ServerConfig,
        worker_index: int,
        apply_frame: Callable[[TokenizerManagerInput], None],
    ) -> None:
        self._config = config
        self._worker_index = worker_index
        self._apply_frame = apply_frame
        self._encoder = make_encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._recv_ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._send: zmq.asyncio.Socket | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._after_frame: dict[Callable[[], None], None] = {}  # an ordered set

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._send = connect_push(self._ctx, self._config.scheduler_input)
        # A plain socket, read through receive_frames: one wake per burst of frames.
        self._recv_ctx = zmq.Context()
        recv = bind_pull(self._recv_ctx, self._config.tokenizer_endpoint(self._worker_index))
        self._loop_task = asyncio.create_task(self._receive_loop(recv))

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self._recv_ctx is not None:
            self._recv_ctx.destroy(linger=0)

    def send(self, obj: SchedulerInput) -> None:
        if self._send is None:
            raise RuntimeError(
                "TokenizerManager.start() has not run: there is no socket to the scheduler yet"
            )
        self._send.send(self._encoder.encode(obj), copy=False)

    def call_after_frame(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` once the frame being applied is, once however often it is asked
        for."""
        self._after_frame[callback] = None

    async def _receive_loop(self, sock: zmq.Socket[bytes]) -> None:
        decoder: FrameDecoder[TokenizerManagerInput] = FrameDecoder(
            TokenizerManagerInput, logger, "tokenizer manager input"
        )
        inconsistent = RateLimitedWarning(logger)
        async for frame in receive_frames(sock):
            msg = decoder.decode(frame.buffer)
            if msg is None:
                continue
            try:
                self._apply_frame(msg)
            except ValueError as exc:  # inconsistent columns: drop the frame, keep serving
                inconsistent.warn("dropped an inconsistent output frame: %s", exc)
            except Exception:  # a bug must not end this loop: every later request would hang
                logger.exception("failed to handle an output frame; dropped it")
            if self._after_frame:
                self._run_after_frame()

    def _run_after_frame(self) -> None:
        due, self._after_frame = self._after_frame, {}
        for callback in due:
            try:
                callback()
            except Exception:  # one stream's failure must not stop the others'
                logger.exception("an after-frame callback failed")
