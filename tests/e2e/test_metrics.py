"""Metrics as Prometheus sees them: a real Prometheus server scrapes a running tokenpipe,
and its counters must equal the sums of the meta_info the clients received."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.prometheus_server import query, require_program, scalar, running_prometheus
from tests.server_harness import ServerProcess


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("metrics") / "tmp").wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prometheus(
    metrics_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    with running_prometheus(metrics_server.port, tmp_path_factory.mktemp("prometheus")) as url:
        yield url


def run_known_requests(srv: ServerProcess) -> list[dict]:  # type: ignore[type-arg]
    shared = "You are a careful assistant. " * 12

    def one(i: int) -> dict:  # type: ignore[type-arg]
        body = {
            "text": f"{shared} Question {i}?",
            "sampling_params": {"max_new_tokens": 5 + i % 7, "temperature": 0.5, "seed": i},
        }
        with srv.client() as c:
            if i % 3 == 0:
                meta: dict = {}  # type: ignore[type-arg]
                with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            meta = json.loads(line[6:])["meta_info"]
                return {**meta, "stream": True}
            return {**c.post("/generate", json=body).json()["meta_info"], "stream": False}

    with srv.client() as c:
        c.post(
            "/generate", json={"text": shared, "sampling_params": {"max_new_tokens": 2}}
        )  # warm the cache
    first = [one(0)]
    with ThreadPoolExecutor(6) as pool:
        return first + list(pool.map(one, range(1, 18)))


def test_prometheus_counters_equal_the_meta_info_sums(
    metrics_server: ServerProcess, prometheus: str
) -> None:
    with metrics_server.client() as c:
        before = {name: c.get("/metrics").text for name in ["x"]}["x"]
    assert "tokenpipe:prompt_tokens_total" in before
    metas = run_known_requests(metrics_server)
    warm = {"prompt": 0, "gen": 2}  # the warm-up request: its prompt length is read back below
    expected_prompt = sum(m["prompt_tokens"] for m in metas)
    expected_gen = sum(m["completion_tokens"] for m in metas) + warm["gen"]
    expected_cached = sum(m["cached_tokens"] for m in metas)
    assert expected_cached > 0, "the shared prefix should have been served from the cache"

    def settled() -> bool:
        gen = scalar(prometheus, "tokenpipe:generation_tokens_total")
        return gen is not None and gen == expected_gen

    deadline = time.monotonic() + 30
    while not settled():
        assert time.monotonic() < deadline, query(prometheus, "tokenpipe:generation_tokens_total")
        time.sleep(0.5)

    prompt_total = scalar(prometheus, "tokenpipe:prompt_tokens_total")
    prompt_sum = scalar(prometheus, "tokenpipe:prompt_tokens_histogram_sum")
    warm_prompt = prompt_sum - expected_prompt  # type: ignore[operator]
    assert warm_prompt > 0
    assert prompt_total == expected_prompt + warm_prompt
    assert (
        scalar(prometheus, 'tokenpipe:cached_tokens_total{cache_source="total"}') == expected_cached
    )
    assert (
        scalar(prometheus, 'tokenpipe:cached_tokens_total{cache_source="device"}')
        == expected_cached
    )
    streaming = sum(1 for m in metas if m["stream"])
    assert scalar(prometheus, 'tokenpipe:num_requests_total{is_streaming="true"}') == streaming
    assert (
        scalar(prometheus, 'tokenpipe:num_requests_total{is_streaming="false"}')
        == len(metas) - streaming + 1
    )
    assert scalar(prometheus, "tokenpipe:e2e_request_latency_seconds_count") == len(metas) + 1
    assert scalar(prometheus, "tokenpipe:num_retractions_sum") == sum(
        m["num_retractions"] for m in metas
    )
    labels = query(prometheus, "tokenpipe:generation_tokens_total")
    assert all(
        '"engine_type": "unified"' in k and '"model_name": "tokenpipe-tiny"' in k for k in labels
    )


def test_promtool_finds_no_problems(metrics_server: ServerProcess) -> None:
    promtool = require_program("promtool")
    with metrics_server.client() as c:
        c.post("/generate", json={"text": "lint me", "sampling_params": {"max_new_tokens": 3}})
        text = c.get("/metrics").text
    run = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    findings = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    # docs/design.md section 7 fixes the names: a `tokenpipe:` prefix (as SGLang's `sglang:`) and
    # the `*_tokens_histogram` metrics. promtool's style lint flags exactly those two choices;
    # anything else (a parse error, missing HELP, a counter without _total...) fails here.
    spec_mandated = (
        "metric names should not contain ':'",
        "metric name should not include type 'histogram'",
    )
    problems = [line for line in findings if not line.endswith(spec_mandated)]
    assert problems == [], problems
    assert any("prompt_tokens_total" in line for line in findings), (
        "promtool should have read the metrics"
    )


def test_metrics_off_has_no_request_metrics_nor_timing(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "tmp", ["--disable-metrics"]).wait_ready()
    try:
        with srv.client() as c:
            meta = c.post(
                "/generate", json={"text": "quiet", "sampling_params": {"max_new_tokens": 3}}
            ).json()["meta_info"]
            text = c.get("/metrics").text
    finally:
        srv.stop()
    assert "_bucket" not in text and "tokenpipe:" not in text
    timing = {
        "queue_time",
        "forward_entry_time",
        "prefill_finished_time",
        "storage_prefetch_wait",
        "first_token_latency",
        "decode_throughput",
    }
    assert not timing & set(meta), meta
    assert meta["completion_tokens"] == 3 and "e2e_latency" in meta
