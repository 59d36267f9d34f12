"""A real Prometheus server for tests: it scrapes a running tokenpipe, and tests read what it
stored through its HTTP query API. Skipped on a laptop without the binary; under CI=true a
missing binary fails (`.ci/run` installs the Debian package prometheus)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.server_harness import free_port

IN_CI = os.environ.get("CI") == "true"


def require_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is required in CI (.ci/run installs the Debian package prometheus)")
        pytest.skip(f"{name} is not installed")
    return path


@contextmanager
def running_prometheus(target_port: int, workdir: Path) -> Iterator[str]:
    """Prometheus scraping ``127.0.0.1:target_port`` every second; yields its URL."""
    binary = require_program("prometheus")
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: tokenpipe\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n"
    )
    port = free_port()
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, (workdir / "prometheus.log").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def query(prom: str, expr: str) -> dict[str, float]:
    data = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert data["status"] == "success", data
    return {json.dumps(r["metric"], sort_keys=True): float(r["value"][1]) for r in data["data"]["result"]}


def scalar(prom: str, expr: str) -> float | None:
    values = query(prom, expr)
    return sum(values.values()) if values else None
