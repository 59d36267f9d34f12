"""ZeroMQ plumbing shared by the three processes: typed frame codecs, PUSH/PULL sockets
and the private ipc directory.

Every socket is PUSH/PULL and the receiving (PULL) side binds, so an endpoint names the
process that owns it and a ``tcp://`` endpoint binds exactly where it is configured.
Frames are msgspec msgpack decoded into one declared type: a frame is data, never code,
and one that does not decode is dropped with a rate-limited warning.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq

T = TypeVar("T")

# Large enough that a burst of frames never blocks a sender on a briefly busy receiver,
# small enough to bound memory when a receiver is gone.
_HWM = 100_000


class RateLimitedWarning:
    """Logs at most one warning per ``interval`` seconds and counts the rest, so a flood of
    bad frames cannot flood the log."""

    def __init__(self, logger: logging.Logger, interval: float = 5.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last = float("-inf")
        self._suppressed = 0
        self.total = 0

    def warn(self, message: str, *args: object) -> None:
        self.total += 1
        now = time.monotonic()
        if now - self._last < self._interval:
            self._suppressed += 1
            return
        if self._suppressed:
            message += f" ({self._suppressed} similar warnings suppressed)"
        self._logger.warning(message, *args)
        self._last = now
        self._suppressed = 0


class FrameDecoder(Generic[T]):
    """Decodes frames into ``type_``; a frame that fails is dropped (returns None)."""

    # ``type_`` is a type or a union of types (``T`` itself): msgspec takes either, the type
    # checker has no one annotation for both.
    def __init__(self, type_: Any, logger: logging.Logger, what: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(type_)
        self._warning = RateLimitedWarning(logger)
        self._what = what

    @property
    def dropped(self) -> int:
        return self._warning.total

    def decode(self, frame: bytes | memoryview) -> T | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            self._warning.warn(
                "dropped a malformed %s frame (%d bytes): %s", self._what, len(frame), exc
            )
            return None


def make_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


# A context makes sockets of its own kind: plain ``zmq`` ones, or ``zmq.asyncio`` ones.
_Socket = TypeVar("_Socket", bound="zmq.Socket[Any]")


def bind_pull(ctx: zmq.Context[_Socket], endpoint: str) -> _Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, _HWM)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    return sock


def connect_push(ctx: zmq.Context[_Socket], endpoint: str) -> _Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, _HWM)
    # A frame queued for a peer that is gone must not keep the process alive at exit.
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


async def receive_frames(sock: zmq.Socket[bytes]) -> AsyncIterator[zmq.Frame]:
    """The frames of a plain (not ``zmq.asyncio``) socket, read on the running asyncio loop:
    the socket's file descriptor wakes the loop, then every queued frame is taken without
    waiting. Cheaper per frame than ``zmq.asyncio``'s future and poller calls per recv."""
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    fd = _int_option(sock, zmq.FD)
    loop.add_reader(fd, readable.set)
    try:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                readable.clear()
                # The descriptor signals changes, not frames: look again after clearing (which
                # also rearms it), or a frame that came in between would wait for the next.
                if not _int_option(sock, zmq.EVENTS) & zmq.POLLIN:
                    await readable.wait()
                continue
            yield frame
    finally:
        loop.remove_reader(fd)


def _int_option(sock: zmq.Socket[bytes], option: int) -> int:
    """An integer socket option (``getsockopt`` is typed for every kind of option)."""
    value = sock.getsockopt(option)
    if not isinstance(value, int):
        raise TypeError(f"socket option {option} is {type(value).__name__}, expected an int")
    return value


def ipc_path(endpoint: str) -> Path | None:
    return Path(endpoint[len("ipc://") :]) if endpoint.startswith("ipc://") else None


_IPC_DIR_PREFIX = "tokenpipe-"


def remove_ipc_dir(path: str | Path) -> None:
    """Removes a private ipc directory. Harmless when it is already gone (the supervisor and
    each of its children may all try), and a no-op for a directory that is not one of ours,
    so a wrong path handed down in the environment cannot remove anything else."""
    if Path(path).name.startswith(_IPC_DIR_PREFIX):
        shutil.rmtree(path, ignore_errors=True)


class PrivateIpcDir:
    """A mode-0700 temporary directory for ``ipc://`` socket files, removed on close so
    no socket file outlives the service."""

    def __init__(self) -> None:
        # mkdtemp creates the directory with mode 0700 (owner only).
        self.path = Path(tempfile.mkdtemp(prefix=_IPC_DIR_PREFIX))
        os.chmod(self.path, 0o700)

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.path / name}"

    def close(self) -> None:
        remove_ipc_dir(self.path)

    def __enter__(self) -> PrivateIpcDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
