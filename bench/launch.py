"""Starting ``tokenpipe serve`` for a benchmark and finding its processes: shared by
serve.py, load.py and memory.py."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def raise_open_files_limit(needed: int) -> int:
    """Raises the soft RLIMIT_NOFILE towards the hard one (children inherit it); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = want
    return soft


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    """``tokenpipe serve`` on a free port, as a context manager. Its output is kept (the
    last lines) for the error message when it does not come up."""

    def __init__(self, server_args: Sequence[str] = (), *, open_files: int = 4096) -> None:
        raise_open_files_limit(open_files)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *server_args],
            cwd=REPO,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._tail: deque[str] = deque(maxlen=200)
        self._ready = threading.Event()
        self.ready = False
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace")
            self._tail.append(line)
            if line.startswith("tokenpipe ready"):
                self.ready = True
                self._ready.set()
        self._ready.set()

    def output(self) -> str:
        return "".join(self._tail)

    def wait_ready(self, timeout: float = 180.0) -> "LaunchedServer":
        self._ready.wait(timeout)
        if not self.ready:
            self.stop()
            raise RuntimeError(f"server did not become ready; output:\n{self.output()[-4000:]}")
        return self

    def children(self) -> dict[str, int]:
        return child_roles(self.proc.pid)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "LaunchedServer":
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def child_roles(supervisor_pid: int) -> dict[str, int]:
    """{"scheduler": pid, "detokenizer": pid, "api": pid}: the children of a ``tokenpipe
    serve`` supervisor, found by parent pid and command line in /proc."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != supervisor_pid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"pipeline.cli" not in args:
            continue
        for name in ("scheduler", "detokenizer", "api"):
            if name.encode() in args:
                found[name] = int(entry.name)
    return found
