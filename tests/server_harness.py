"""Starts a real ``tokenpipe serve`` for tests and finds its processes. No mocks: the
server is the console entry point in a subprocess, over real sockets."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import openai

from bench.launch import REPO, LaunchedServer, descendants, free_port

__all__ = ["REPO", "SMALL_SERVER_ARGS", "ServerProcess", "descendants", "free_port", "pid_alive", "wait_until"]

# Small and fast for a 2-core CI machine; individual tests override what they exercise.
SMALL_SERVER_ARGS = ["--max-total-tokens", "8192", "--chunked-prefill-size", "256", "--log-level", "warning"]


class ServerProcess(LaunchedServer):
    """The benchmarks' launcher with its own TMPDIR, so the private ipc directory the
    server creates (and must remove) is observable, the small test settings, the whole
    output kept, and a log file next to the TMPDIR."""

    def __init__(self, tmp_dir: Path, args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
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
