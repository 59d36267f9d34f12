"""Starting the processes a benchmark or a test runs, and finding tokenpipe's: one
implementation of spawn, output capture, readiness and stop (``Launched``), with
``tokenpipe serve`` on top (``LaunchedServer``, used by serve.py, load.py and memory.py; the
tests' harness builds on both)."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Self

import httpx

REPO = Path(__file__).resolve().parent.parent

# The command every tokenpipe process is started with, before its role (``serve``,
# ``scheduler``, ``detokenizer``, ``api``); ``cmdline_role`` recognises it in /proc.
TOKENPIPE_MODULE = "tokenpipe"
TOKENPIPE = (sys.executable, "-m", TOKENPIPE_MODULE)
# The benchmarks' servers stream /generate events that hold their new tokens only: the path
# their figures have always measured (by default, SGLang's, each event repeats the whole
# output so far, bytes quadratic in its length).
INCREMENTAL_STREAMS = "--incremental-streaming-output"
READY_PREFIX = "tokenpipe ready"  # the line ``tokenpipe serve`` prints once it serves


def tokenpipe_command(role: str, *args: str) -> list[str]:
    """``TOKENPIPE ROLE ARGS...``: a tokenpipe process with this interpreter."""
    return [*TOKENPIPE, role, *args]


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


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each stays bound while the next is picked."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]


class Launched:
    """One child process, as a context manager. Its output (stdout and stderr together) is
    read by a thread into the last ``keep_lines`` lines (all with None), for the error
    message when it does not come up and for tests that read it, and also written to
    ``log_path`` when one is given. ``env`` adds to this process's environment. It is ready
    once ``probe()`` answers True: by default once a line starting with ``ready_prefix`` was
    printed; a subclass probes a port instead. ``name`` says what it is in errors;
    ``stop_timeout`` is how long ``stop`` waits before it kills."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
        keep_lines: int | None = 200,
        ready_prefix: str | None = None,
        stop_timeout: float = 60.0,
    ) -> None:
        self.name = name
        self.stop_timeout = stop_timeout
        self.log_path = log_path
        self.ready_prefix = ready_prefix
        self.ready_line: str | None = None
        self._lines: deque[str] = deque(maxlen=keep_lines)
        # Set by the reader on the ready line and at the end of the output: wakes wait_ready
        # at once instead of at its next poll.
        self._news = threading.Event()
        self.proc = subprocess.Popen(
            command,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(target=self._drain, daemon=True).start()

    @property
    def ready(self) -> bool:
        return self.ready_line is not None

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        with (
            open(self.log_path, "w")
            if self.log_path is not None
            else contextlib.nullcontext() as log
        ):
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace")
                if log is not None:
                    log.write(line)
                    log.flush()
                self._lines.append(line)
                if self.ready_prefix is not None and line.startswith(self.ready_prefix):
                    self.ready_line = line
                    self._news.set()
        self._news.set()

    def output(self) -> str:
        return "".join(self._lines)

    def probe(self) -> bool:
        return self.ready

    def wait_ready(self, timeout: float = 180.0) -> Self:
        wait_ready(
            self.probe, [self], timeout, what=f"{self.name} did not become ready", wake=self._news
        )
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float | None = None) -> int:
        """Sends ``sig``, waits up to ``timeout`` seconds (``stop_timeout`` by default), then
        kills; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.reap(self.stop_timeout if timeout is None else timeout)

    def reap(self, timeout: float) -> int:
        """Waits up to ``timeout`` seconds for the exit, then kills; the exit code."""
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


def wait_ready(
    probe: Callable[[], bool],
    processes: Sequence[Launched],
    timeout: float,
    *,
    what: str,
    interval: float = 0.1,
    wake: threading.Event | None = None,
) -> None:
    """Polls ``probe`` every ``interval`` seconds (sooner when ``wake`` is set) until it
    answers True. When one of ``processes`` exits first or ``timeout`` passes, stops them all
    and raises RuntimeError with ``what`` and each one's output."""
    deadline = time.monotonic() + timeout
    while not probe():
        exited = [p for p in processes if not p.alive()]
        if exited or time.monotonic() >= deadline:
            stop_all(processes)
            why = (
                ", ".join(f"{p.name} exited with {p.proc.returncode}" for p in exited)
                or f"not within {timeout:g} s"
            )
            outputs = "\n".join(f"--- {p.name} output:\n{p.output()[-4000:]}" for p in processes)
            raise RuntimeError(f"{what} ({why}):\n{outputs}")
        if wake is not None and not wake.is_set():
            wake.wait(interval)
        else:  # no event, or the output has ended and the exit is near
            time.sleep(interval)


def answers_200(url: str, headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> bool:
    """A readiness probe: whether GET ``url`` answers 200 (False while it cannot connect)."""
    try:
        return httpx.get(url, headers=headers, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def stop_all(processes: Iterable[Launched], timeout: float | None = None) -> list[int]:
    """SIGTERM to every one first (they shut down together, not one after the other), then
    each waited for up to ``timeout`` seconds (its ``stop_timeout`` by default) and killed
    after; their exit codes."""
    processes = list(processes)
    for p in processes:
        if p.alive():
            p.proc.send_signal(signal.SIGTERM)
    return [p.reap(p.stop_timeout if timeout is None else timeout) for p in processes]


class LaunchedServer(Launched):
    """``tokenpipe serve`` on a free port, ready on its ready line, its output also written
    to ``log_dir/server-PORT.log`` when a log directory is given. The test harness
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
        super().__init__(
            tokenpipe_command(
                "serve", "--host", "127.0.0.1", "--port", str(self.port), *server_args
            ),
            name="server",
            env=env,
            log_path=log_dir / f"server-{self.port}.log" if log_dir is not None else None,
            keep_lines=keep_lines,
            ready_prefix=READY_PREFIX,
        )

    def children(self) -> dict[str, int]:
        return child_roles(self.proc.pid)


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
    "scheduler", "detokenizer" or "api" for ``python -m TOKENPIPE_MODULE ROLE``; None for
    anything else."""
    if TOKENPIPE_MODULE.encode() not in args:
        return None
    return next(
        (name for name in ("scheduler", "detokenizer", "api") if name.encode() in args), None
    )


def child_roles(supervisor_pid: int) -> dict[str, int]:
    """{"scheduler": pid, "detokenizer": pid, "api": pid}: the children of a ``tokenpipe
    serve`` supervisor."""
    return {role: pid for pid, role in descendants(supervisor_pid).items() if role}
