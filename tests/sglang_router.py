"""Starts the real sglang-router (SGLang's gateway, PyPI ``sglang-router``; the wheel ships
its binary) in front of tokenpipe servers, for tests. No imitation: the router's own binary,
over real sockets."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Self

import httpx
import pytest

from tests.server_harness import free_port

IN_CI = os.environ.get("CI") == "true"


def router_binary() -> str:
    """The sglang-router console script of this interpreter's environment. Skips the test
    where it is not installed, except in CI (``make test`` installs it), where that fails."""
    found = shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or shutil.which("sglang-router")
    if found is None:
        if IN_CI:
            pytest.fail("sglang-router is required in CI (the test extra installs it)")
        pytest.skip("sglang-router is not installed")
    return found


class SglangRouter:
    """``sglang-router launch`` on free ports (its HTTP port and its Prometheus port: the
    default 29000 would collide between routers) with ``args`` naming the workers, e.g.
    ``["--worker-urls", url1, url2]`` or ``["--pd-disaggregation", "--prefill", url, port,
    "--decode", url]``. Its log goes to ``log_path``."""

    def __init__(self, args: Sequence[str], log_path: Path, *, policy: str = "cache_aware") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            router_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-port", str(free_port()), "--policy", policy, "--log-level", "warn", *args,
        ]  # fmt: skip
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, workers: int, timeout: float = 60.0) -> Self:
        """Until the router has registered ``workers`` healthy workers (its ``/workers``)."""
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:
                    if self.healthy_workers(client) >= workers:
                        return self
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"sglang-router did not register {workers} workers; log:\n{self.log_path.read_text()[-4000:]}")

    @staticmethod
    def healthy_workers(client: httpx.Client) -> int:
        response = client.get("/workers")
        if response.status_code != 200:
            return 0
        body = response.json()
        workers = body.get("workers", body) if isinstance(body, dict) else body
        return sum(1 for w in workers if w.get("is_healthy", True))

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120.0, trust_env=False)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
