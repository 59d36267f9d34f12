"""Starts a real ``tokenpipe serve`` for tests and finds its processes. No mocks: the
server is the console entry point in a subprocess, over real sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

# Small and fast for a 2-core CI machine; individual tests override what they exercise.
SMALL_SERVER_ARGS = ["--max-total-tokens", "8192", "--chunked-prefill-size", "256", "--log-level", "warning"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``tokenpipe serve`` in a subprocess with its own TMPDIR, so the private ipc
    directory it creates (and must remove) is observable."""

    def __init__(self, tmp_dir: Path, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.tmp_dir = tmp_dir
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp_dir.parent / f"server-{self.port}.log"
        full_env = dict(os.environ, TMPDIR=str(tmp_dir), PYTHONUNBUFFERED="1")
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "serve", "--port", str(self.port), *SMALL_SERVER_ARGS, *(args or [])],
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self.ready_line: str | None = None
        self._ready = threading.Event()
        self._lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") as log:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                log.write(line)
                log.flush()
                self._lines.append(line)
                if line.startswith("tokenpipe ready"):
                    self.ready_line = line
                    self._ready.set()
        self._ready.set()

    def output(self) -> str:
        return "".join(self._lines)

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        self._ready.wait(timeout)
        if self.ready_line is None:
            self.stop()
            raise RuntimeError(f"server did not become ready; output:\n{self.output()[-4000:]}")
        return self

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, **kwargs)  # type: ignore[arg-type]

    def children(self) -> dict[str, int]:
        """{"scheduler": pid, "detokenizer": pid, "api": pid} of this supervisor."""
        return {name: pid for pid, name in descendants(self.proc.pid).items() if name}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def descendants(pid: int) -> dict[int, str | None]:
    """Every live process whose parent is ``pid``, mapped to its tokenpipe role."""
    found: dict[int, str | None] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != pid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        role = None
        for name in ("scheduler", "detokenizer", "api"):
            if b"pipeline.cli" in args and name.encode() in args:
                role = name
        found[int(entry.name)] = role
    return found


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
