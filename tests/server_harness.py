"""Starts real tokenpipe processes for tests and finds them: the whole server (``tokenpipe
serve``, ``ServerProcess``) or its three roles as separate processes on explicit endpoints
(``RoleProcesses``). Both are ``bench.launch.Launched``, the one launcher every process a test
starts goes through. No mocks: the command line in a subprocess, over real sockets."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import httpx
import openai

from bench.launch import (
    REPO,
    Launched,
    LaunchedServer,
    answers_200,
    descendants,
    free_port,
    free_ports,
    stop_all,
    tokenpipe_command,
    wait_ready,
)

__all__ = [
    "REPO",
    "ROLES",
    "SMALL_SERVER_ARGS",
    "RoleProcesses",
    "ServerProcess",
    "descendants",
    "free_port",
    "free_ports",
    "pid_alive",
    "role_process",
    "tokenpipe_command",
    "wait_until",
]

# Small and fast for a 2-core CI machine; individual tests override what they exercise.
SMALL_SERVER_ARGS = [
    "--max-total-tokens",
    "8192",
    "--chunked-prefill-size",
    "256",
    "--log-level",
    "warning",
]


class ServerProcess(LaunchedServer):
    """The benchmarks' launcher with its own TMPDIR, so the private ipc directory the
    server creates (and must remove) is observable, the small test settings, the whole
    output kept, and a log file next to the TMPDIR."""

    def __init__(
        self, tmp_dir: Path, args: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.tmp_dir = tmp_dir
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        super().__init__(
            [*SMALL_SERVER_ARGS, *(args or [])],
            env={"TMPDIR": str(tmp_dir), **(env or {})},
            log_dir=tmp_dir.parent,
            keep_lines=None,
        )

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, **kwargs)  # type: ignore[arg-type]

    def openai_client(self, api_key: str = "unused") -> openai.OpenAI:
        """The official client, pointed at this server's OpenAI routes, without retries
        (a retry would hide an error the test is looking for)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)


ROLES = ("scheduler", "detokenizer", "api")
# What every lone role process gets before a test's own arguments.
SMALL_ROLE_ARGS = ("--log-level", "warning", "--max-total-tokens", "4096")


def role_process(role: str, *args: str, log_path: Path | None = None) -> Launched:
    """``tokenpipe ROLE ARGS...``: one process of the three (the test gives the endpoints)."""
    return Launched(tokenpipe_command(role, *args), name=role, log_path=log_path)


class RoleProcesses:
    """``tokenpipe scheduler``, ``detokenizer`` and ``api`` run one process each, as
    deploy/supervisord.conf runs them, on explicit endpoints: tcp:// on free ports, or ipc://
    in ``ipc_dir`` when one is given. Each gets ``--port`` (the API's), the small settings and
    ``args``. Ready once /health_generate answers 200 (with ``headers``) while all three live;
    with ``log_dir`` each one's output is also in ``log_dir/ROLE.log``."""

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        ipc_dir: Path | None = None,
        headers: dict[str, str] | None = None,
        log_dir: Path | None = None,
        roles: Sequence[str] = ROLES,
    ) -> None:
        """``roles``: the ones started now; a test starts the others with ``start``."""
        inputs = ("scheduler", "detokenizer", "tokenizer")
        if ipc_dir is None:
            self.endpoints = {name: f"tcp://127.0.0.1:{free_port()}" for name in inputs}
        else:
            self.endpoints = {name: f"ipc://{ipc_dir}/{name}" for name in inputs}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = headers or {}
        self.log_dir = log_dir
        endpoint_args = [
            arg for name in inputs for arg in (f"--{name}-input", self.endpoints[name])
        ]
        self.args = [*endpoint_args, "--port", str(self.port), *SMALL_ROLE_ARGS, *args]
        self.procs = {role: self.start(role) for role in roles}

    @property
    def zmq_ports(self) -> dict[str, int]:
        """The port of each tcp:// input ("scheduler", "detokenizer", "tokenizer")."""
        return {
            name: int(url.rsplit(":", 1)[1])
            for name, url in self.endpoints.items()
            if url.startswith("tcp://")
        }

    def start(self, role: str) -> Launched:
        log_path = self.log_dir / f"{role}.log" if self.log_dir is not None else None
        return role_process(role, *self.args, log_path=log_path)

    def wait_ready(self, timeout: float = 120.0) -> Self:
        wait_ready(
            lambda: answers_200(self.url + "/health_generate", self.headers),
            list(self.procs.values()),
            timeout,
            what="the three processes never served a request",
            interval=0.2,
        )
        return self

    def restart(self, role: str) -> None:
        """Kills ``role`` with SIGKILL (as a crash would) and starts another in its place."""
        self.procs[role].stop(signal.SIGKILL, timeout=30)
        self.procs[role] = self.start(role)

    def stop(self, timeout: float = 15.0) -> dict[str, int]:
        """SIGTERM to all three, then each waited for (killed after ``timeout`` s); the exit
        codes."""
        return dict(zip(self.procs, stop_all(self.procs.values(), timeout)))

    def __enter__(self) -> Self:
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(  # type: ignore[no-untyped-def]
    predicate, timeout: float, interval: float = 0.05
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def offline_hub_env(workdir: Path, **extra: str) -> dict[str, str]:
    """The environment for a third-party client run as a subprocess (lm-eval, guidellm):
    this one, with the Hugging Face libraries offline (no hub can be reached) and their
    cache in ``workdir``."""
    return dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(workdir / "hf"),
        **extra,
    )
