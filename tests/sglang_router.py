"""Starts the real sglang-router (SGLang's gateway, PyPI ``sglang-router``; the wheel ships
its binary) in front of tokenpipe servers, for tests. No imitation: the router's own binary,
over real sockets, started and stopped by the tests' one launcher (``bench.launch.Launched``)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import httpx
import pytest

from bench.launch import Launched, wait_ready
from tests.server_harness import free_ports

IN_CI = os.environ.get("CI") == "true"


def router_binary() -> str:
    """The sglang-router console script of this interpreter's environment. Skips the test
    where it is not installed, except in CI (``make test`` installs it), where that fails."""
    found = shutil.which("sglang-router", path=str(Path(sys.executable).parent)) or shutil.which(
        "sglang-router"
    )
    if found is None:
        if IN_CI:
            pytest.fail("sglang-router is required in CI (the test extra installs it)")
        pytest.skip("sglang-router is not installed")
    return found


class SglangRouter(Launched):
    """``sglang-router launch`` on free ports (its HTTP port and its Prometheus port: the
    default 29000 would collide between routers) with ``args`` naming the workers, e.g.
    ``["--worker-urls", url1, url2]`` or ``["--pd-disaggregation", "--prefill", url, port,
    "--decode", url]``. Its log goes to ``log_path``, and all of it is kept for ``output()``."""

    # A free port is free when it is picked, not when the router binds it: an outgoing
    # connection may take it in between (this machine's ephemeral ports are the same range),
    # and the router then exits. It is started again on other ports, this many times at most.
    LAUNCHES = 3

    def __init__(
        self,
        args: Sequence[str],
        log_path: Path,
        *,
        policy: str = "cache_aware",
        api_key: str | None = None,
        log_level: str = "warn",
    ) -> None:
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._options = [
            "--policy", policy, "--log-level", log_level, *args,
            # required from clients, and sent to the workers
            *(["--api-key", api_key] if api_key is not None else []),
        ]  # fmt: skip
        self._log_path = log_path
        self._launch()

    def _launch(self) -> None:
        self.port, prometheus_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            router_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            *self._options,
        ]  # fmt: skip
        super().__init__(
            command,
            name="sglang-router",
            env={"NO_COLOR": "1"},
            log_path=self._log_path,
            keep_lines=None,
            stop_timeout=15.0,
        )

    def wait_ready(self, timeout: float = 60.0, *, workers: int = 1) -> Self:
        """Until the router has registered ``workers`` healthy workers (its ``/workers``)."""
        for launch in range(1, self.LAUNCHES + 1):
            try:
                wait_ready(
                    lambda: sum(1 for w in self.workers() if w.get("is_healthy")) >= workers,
                    [self],
                    timeout,
                    what=f"sglang-router did not register {workers} workers",
                )
                return self
            except RuntimeError:
                if launch == self.LAUNCHES or "Address already in use" not in self.output():
                    raise
                self._launch()
        raise AssertionError("unreachable: the last launch returns or raises")

    def workers(self) -> list[dict[str, Any]]:
        """The router's ``/workers`` list; empty while it cannot answer."""
        try:
            with self.client() as c:
                return c.get("/workers").json()["workers"]  # type: ignore[no-any-return]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120.0, trust_env=False)
