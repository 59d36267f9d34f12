"""A real Prometheus server for tests: it scrapes a running tokenpipe, and tests read what it
stored through its HTTP query API. Skipped on a laptop without the binary; under CI=true a
missing binary fails (`.ci/run` installs the Debian package prometheus)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from bench.launch import Launched, answers_200, wait_ready
from tests.server_harness import free_port

IN_CI = os.environ.get("CI") == "true"


def require_program(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(
                f"{name} is required in CI (.ci/run installs the Debian package prometheus)"
            )
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
    proc = Launched(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        name="prometheus",
        log_path=workdir / "prometheus.log",
        stop_timeout=10.0,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(
            lambda: answers_200(f"{url}/-/ready", timeout=2),
            [proc],
            30,
            what="prometheus did not become ready",
            interval=0.2,
        )
        yield url
    finally:
        proc.stop()


def query(prom: str, expr: str) -> dict[str, float]:
    data = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert data["status"] == "success", data
    return {
        json.dumps(r["metric"], sort_keys=True): float(r["value"][1])
        for r in data["data"]["result"]
    }


def scalar(prom: str, expr: str) -> float | None:
    values = query(prom, expr)
    return sum(values.values()) if values else None
