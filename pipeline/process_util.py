"""What every tokenpipe process does the same way: logging, the shutdown flag, the readiness
report to the supervisor, and dying with its parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from typing import Any

import zmq

from pipeline.config import ServerConfig
from pipeline.io_struct import ProcessReady
from pipeline.sockets import connect_push, make_encoder

_PR_SET_PDEATHSIG = 1


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so a supervisor killed with
    -9 leaves no orphans. A no-op elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class ShutdownFlag:
    """Set by SIGTERM or SIGINT; loops poll it between steps."""

    def __init__(self) -> None:
        self._set = False

    @classmethod
    def install(cls) -> "ShutdownFlag":
        flag = cls()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, flag._on_signal)
        return flag

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def report_ready(ctx: zmq.Context[Any], config: ServerConfig, name: str) -> None:
    if config.ready_endpoint is None:
        return
    sock = connect_push(ctx, config.ready_endpoint)
    sock.setsockopt(zmq.LINGER, 2000)  # this one frame must get out
    sock.send(make_encoder().encode(ProcessReady(name=name, pid=os.getpid())))
    sock.close()
