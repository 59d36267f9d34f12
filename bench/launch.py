"""Starting ``tokenpipe serve`` for a benchmark and finding its processes: shared by
serve.py, load.py and memory.py."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

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
    last ``keep_lines`` lines; all with None) for the error message when it does not come
    up, and also written to ``log_dir/server-PORT.log`` when a log directory is given.
    ``env`` adds to this process's environment. The test harness
    (``tests.server_harness.ServerProcess``) is this launcher with a private TMPDIR."""

    def __init__(
        self,
        server_args: Sequence[str] = (),
        *,
        open_files: int = 4096,
        env: Mapping[str, str] | None = None,
        log_dir: Path | None = None,
        keep_lines: int | None = 200,
    ) -> None:
        raise_open_files_limit(open_files)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"server-{self.port}.log" if log_dir is not None else None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenpipe", "serve", "--host", "127.0.0.1", "--port", str(self.port), *server_args],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        self._lines: deque[str] = deque(maxlen=keep_lines)
        self._ready = threading.Event()
        self.ready_line: str | None = None
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def ready(self) -> bool:
        return self.ready_line is not None

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with open(self.log_path, "w") if self.log_path is not None else contextlib.nullcontext() as log:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                if log is not None:
                    log.write(line)
                    log.flush()
                self._lines.append(line)
                if line.startswith("tokenpipe ready"):
                    self.ready_line = line
                    self._ready.set()
        self._ready.set()

    def output(self) -> str:
        return "".join(self._lines)

    def wait_ready(self, timeout: float = 180.0) -> Self:
        self._ready.wait(timeout)
        if not self.ready:
            self.stop()
            raise RuntimeError(f"server did not become ready; output:\n{self.output()[-4000:]}")
        return self

    def children(self) -> dict[str, int]:
        return child_roles(self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Self:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def descendants(pid: int) -> dict[int, str | None]:
    """Every live process whose parent is ``pid``, mapped to its tokenpipe role ("scheduler",
    "detokenizer", "api"; None for anything else), found in /proc."""
    found: dict[int, str | None] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        found[int(entry.name)] = cmdline_role(args)
    return found


def cmdline_role(args: Sequence[bytes]) -> str | None:
    """The tokenpipe role of a process from its argv (/proc/PID/cmdline split at NULs):
    "scheduler", "detokenizer" or "api" for ``python -m tokenpipe ROLE``; None for
    anything else."""
    if b"tokenpipe" not in args:
        return None
    return next((name for name in ("scheduler", "detokenizer", "api") if name.encode() in args), None)


def child_roles(supervisor_pid: int) -> dict[str, int]:
    """{"scheduler": pid, "detokenizer": pid, "api": pid}: the children of a ``tokenpipe
    serve`` supervisor."""
    return {role: pid for pid, role in descendants(supervisor_pid).items() if role}
