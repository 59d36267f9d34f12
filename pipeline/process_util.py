"""What every tokenpipe process does the same way: logging, the shutdown flag, the readiness
report to the supervisor, and stopping (and cleaning up) when the supervisor is gone."""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import zmq

from pipeline.config import ServerConfig
from pipeline.io_struct import ProcessReady
from pipeline.sockets import connect_push, make_encoder, remove_ipc_dir

logger = logging.getLogger("tokenpipe.process")

# What the supervisor tells its children: its pid, and the private ipc directory that the
# children remove when it dies without removing it itself (SIGKILL).
SUPERVISOR_PID_ENV = "TOKENPIPE_SUPERVISOR_PID"
IPC_DIR_ENV = "TOKENPIPE_IPC_DIR"
# prometheus-client's multiprocess directory: several API workers share their metrics there.
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_PARENT_POLL = 0.2  # seconds between two looks at the parent
_ORPHAN_GRACE = 3.0  # seconds an orphan's own shutdown may take before it exits hard


def setup_logging(level: str, name: str) -> None:
    """The log format, and a fatal signal (an abort in native code) shows every thread's
    Python stack on stderr before the process dies, so its log says where it was."""
    faulthandler.enable()
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )


def die_with_parent() -> None:
    """In a child of the supervisor: once the supervisor is gone, however it died (SIGKILL
    included), remove the private ipc directory, stop through this process's own shutdown
    path (SIGTERM), and exit hard if that takes over ``_ORPHAN_GRACE`` seconds: no orphan and
    no socket file outlive a killed supervisor.

    A watcher thread rather than PDEATHSIG: PDEATHSIG=SIGKILL leaves no chance to clean up,
    and a SIGTERM arriving before this process installs its handler (while it imports) would
    kill it just as uncleanly. A parent that died before the watcher started (during those
    imports) is noticed at once: the parent is then no longer the supervisor's pid."""
    supervisor = int(os.environ.get(SUPERVISOR_PID_ENV) or os.getppid())
    ipc_dir = os.environ.get(IPC_DIR_ENV)
    threading.Thread(
        target=_watch_parent, args=(supervisor, ipc_dir), name="parent-watch", daemon=True
    ).start()


def _watch_parent(supervisor: int, ipc_dir: str | None) -> None:
    while os.getppid() == supervisor:
        time.sleep(_PARENT_POLL)
    logger.warning("the supervisor (pid %d) is gone; stopping", supervisor)
    # First, before anything that could hang: each child removes it (harmless twice).
    if ipc_dir:
        remove_ipc_dir(ipc_dir)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(_ORPHAN_GRACE)
    logger.warning("did not stop within %.0f s of the supervisor's death; exiting", _ORPHAN_GRACE)
    os._exit(1)


class ShutdownFlag:
    """Set by SIGTERM or SIGINT; loops poll it between steps."""

    def __init__(self) -> None:
        self._set = False

    @classmethod
    def install(cls) -> ShutdownFlag:
        flag = cls()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, flag._on_signal)
        return flag

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


def exit_without_finalizing(code: int) -> None:
    """Ends the process now, after flushing its logs and standard streams, without finalizing
    the interpreter: for a process with a thread still inside native code that cannot be
    stopped (finalizing would unwind that thread and abort the process)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def report_ready(ctx: zmq.Context[Any], config: ServerConfig, name: str) -> None:
    if config.ready_endpoint is None:
        return
    sock = connect_push(ctx, config.ready_endpoint)
    sock.setsockopt(zmq.LINGER, 2000)  # this one frame must get out
    sock.send(make_encoder().encode(ProcessReady(name=name, pid=os.getpid())))
    sock.close()
