"""``tokenpipe serve --api-workers 3``: three API processes share the HTTP port, the kernel
spreads connections over them, and the service behaves as one: every stream gets all its
tokens, one ``/metrics`` (scraped by a real Prometheus) counts every worker's requests, spans
come from every worker, an abort or a control call reaches the scheduler from any worker,
and a worker killed with SIGKILL stops the whole service.

Which worker serves a connection is read from ``/server_info`` (its ``api_worker_index``)
on that connection before the request goes out on the same one (one connection per client).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.otlp_receiver import OtlpReceiver
from tests.prometheus_server import running_prometheus, scalar
from tests.server_harness import ServerProcess, descendants, pid_alive, wait_until

WORKERS = 3
STREAMS = 200


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as rec:
        yield rec


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, receiver: OtlpReceiver
) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("workers") / "tmp",
        ["--api-workers", str(WORKERS), "--otlp-traces-endpoint", receiver.endpoint],
    ).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


def one_connection(srv: ServerProcess) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=srv.url, timeout=120, limits=httpx.Limits(max_connections=1))


async def worker_of(client: httpx.AsyncClient) -> int:
    """The API worker behind the client's (one) connection."""
    info = (await client.get("/server_info")).json()
    assert info["api_workers"] == WORKERS
    return int(info["api_worker_index"])


async def stream_one(srv: ServerProcess, i: int) -> dict[str, Any]:
    body = {
        "text": f"worker stream {i}:",
        "rid": f"stream-{i}",
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 4 + i % 13,
            "temperature": 0.7,
            "seed": i,
            "ignore_eos": True,
        },
    }
    async with one_connection(srv) as client:
        worker = await worker_of(client)
        tokens = 0
        meta: dict[str, Any] = {}
        async with client.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    tokens = len(event["output_ids"])  # the output so far (SGLang's default stream)
                    meta = event["meta_info"]
        return {"rid": body["rid"], "worker": worker, "tokens": tokens, "meta": meta}


async def stream_all(srv: ServerProcess) -> list[dict[str, Any]]:
    return list(await asyncio.gather(*(stream_one(srv, i) for i in range(STREAMS))))


def test_streams_spread_over_the_workers_and_one_metrics_counts_them_all(
    server: ServerProcess, receiver: OtlpReceiver, tmp_path: Path
) -> None:
    with running_prometheus(server.port, tmp_path) as prom:
        results = asyncio.run(stream_all(server))
        served = {w: sum(r["worker"] == w for r in results) for w in range(WORKERS)}
        assert all(served.values()), f"a worker served no stream: {served}"
        for r in results:
            assert r["meta"]["finish_reason"]["type"] == "length", r
            assert (
                r["tokens"]
                == r["meta"]["completion_tokens"]
                == 4 + int(r["rid"].split("-")[1]) % 13
            ), r

        generated = sum(r["meta"]["completion_tokens"] for r in results)
        prompt = sum(r["meta"]["prompt_tokens"] for r in results)
        deadline = time.monotonic() + 30
        while scalar(prom, "tokenpipe:generation_tokens_total") != generated:
            assert time.monotonic() < deadline, (
                scalar(prom, "tokenpipe:generation_tokens_total"),
                generated,
            )
            time.sleep(0.5)
        assert scalar(prom, "tokenpipe:prompt_tokens_total") == prompt
        assert scalar(prom, 'tokenpipe:num_requests_total{is_streaming="true"}') == STREAMS
        assert (
            scalar(prom, 'tokenpipe:time_to_first_token_seconds_count{is_streaming="true"}')
            == STREAMS
        )
        assert scalar(prom, "tokenpipe:inter_token_latency_seconds_count") == generated - STREAMS
        assert scalar(prom, "tokenpipe:num_retractions_sum") == sum(
            r["meta"]["num_retractions"] for r in results
        )
        # The scheduler's gauges are one series, not one per worker.
        assert scalar(prom, "count(tokenpipe:num_running_reqs)") == 1
        # The HTTP series add up over the workers too: one series, every worker's answers.
        answered = 'http_requests_total{handler="/generate",method="POST",status="2xx"}'
        assert wait_until(lambda: scalar(prom, answered) == STREAMS, timeout=30, interval=0.5), (
            scalar(prom, answered)
        )
        assert scalar(prom, f"count({answered})") == 1

    # Every worker exported the spans of the requests it served.
    spans = receiver.wait_for(
        lambda got: sum(s.kind == "SERVER" for s in got) >= STREAMS, timeout=30
    )
    traced = {s.attributes.get("gen_ai.response.id") for s in spans if s.kind == "SERVER"}
    for w in range(WORKERS):
        assert {r["rid"] for r in results if r["worker"] == w} <= traced, (
            f"worker {w}'s spans are missing"
        )


async def abort_from_other_workers(srv: ServerProcess) -> tuple[int, list[int], dict[str, Any]]:
    body = {
        "text": "a long one",
        "rid": "long-1",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    async with one_connection(srv) as client:
        home = await worker_of(client)
        async with client.stream("POST", "/generate", json=body) as resp:
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break  # running now
            # New connections until one lands on another worker; each asks for a rid no
            # worker holds first (404 from every worker), then the other worker aborts ours.
            asked_from: list[int] = []
            for _ in range(60):
                async with one_connection(srv) as other:
                    worker = await worker_of(other)
                    if worker == home:
                        continue
                    missing = await other.post("/abort_request", json={"rid": "no-such-rid"})
                    assert missing.status_code == 404 and missing.json()["error"]["param"] == "rid"
                    asked_from.append(worker)
                    aborted = await other.post("/abort_request", json={"rid": "long-1"})
                    assert aborted.status_code == 200 and aborted.json() == {"aborted": "long-1"}
                    break
            last: dict[str, Any] = {}
            async for line in lines:
                if line.startswith("data: {"):
                    last = json.loads(line[6:])["meta_info"]
    return home, asked_from, last


def test_an_abort_from_another_worker_reaches_the_scheduler(server: ServerProcess) -> None:
    home, asked_from, meta = asyncio.run(abort_from_other_workers(server))
    assert asked_from and asked_from[0] != home, "no connection landed on another worker"
    assert meta["finish_reason"]["type"] == "abort", meta
    assert meta["completion_tokens"] < 2000


ANTHROPIC_MESSAGE = {
    "model": "tokenpipe-tiny",
    "max_tokens": 3,
    "messages": [{"role": "user", "content": "hi"}],
    "logit_bias": {"0": -100},  # no EOS: the answer is its 3 tokens
}


async def control_calls(srv: ServerProcess) -> dict[int, dict[str, Any]]:
    answers: dict[int, dict[str, Any]] = {}
    for _ in range(60):
        async with one_connection(srv) as client:
            worker = await worker_of(client)
            if worker in answers:
                continue
            answers[worker] = {
                "health": (await client.get("/health")).status_code,
                "health_generate": (await client.get("/health_generate")).status_code,
                "flush": (await client.post("/flush_cache")).status_code,
                "load": (await client.get("/get_load")).json(),
                "scheduler": (await client.get("/server_info")).json()["scheduler"],
                "message": await client.post("/v1/messages", json=ANTHROPIC_MESSAGE),
            }
        if len(answers) == WORKERS:
            break
    return answers


def test_every_worker_answers_health_control_calls_and_messages(server: ServerProcess) -> None:
    answers = asyncio.run(control_calls(server))
    assert sorted(answers) == list(range(WORKERS)), (
        f"not every worker was reached: {sorted(answers)}"
    )
    for worker, got in answers.items():
        # The flush's answer comes back through the detokenizer to the worker that asked.
        assert (got["health"], got["health_generate"], got["flush"]) == (200, 200, 200), (
            worker,
            got,
        )
        assert got["scheduler"] is not None, f"worker {worker} has no scheduler report"
        # Every worker serves the Messages API (its answer comes back to the worker that asked).
        message = got["message"]
        assert message.status_code == 200, (worker, message.text)
        assert message.json()["usage"]["output_tokens"] == 3, (worker, message.text)


async def same_rid_on_two_workers(
    srv: ServerProcess,
) -> tuple[int, int, httpx.Response, dict[str, Any], httpx.Response]:
    """A long request with rid "dup-1" runs on one worker; the same rid is sent through
    another worker (each worker knows only its own rids), then the first is aborted and
    the rid sent again. Returns both workers, the duplicate's answer, the first request's
    last meta_info, and the answer once the rid is free."""
    body = {
        "text": "a long one",
        "rid": "dup-1",
        "stream": True,
        "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
    }
    again = {
        "text": "a short one",
        "rid": "dup-1",
        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
    }
    async with one_connection(srv) as client:
        home = await worker_of(client)
        async with client.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break  # running now
            for _ in range(60):
                async with one_connection(srv) as other:
                    worker = await worker_of(other)
                    if worker == home:
                        continue
                    duplicate = await other.post(
                        "/generate", json={**again, "text": "the same rid"}
                    )
                    aborted = await other.post("/abort_request", json={"rid": "dup-1"})
                    assert aborted.status_code == 200, aborted.text
                    break
            else:
                pytest.fail("no connection landed on another worker")
            last: dict[str, Any] = {}
            async for line in lines:
                if line.startswith("data: {"):
                    last = json.loads(line[6:])["meta_info"]
    async with one_connection(srv) as other:
        free_again = await other.post("/generate", json=again)
    return home, worker, duplicate, last, free_again


def test_a_live_rid_sent_through_another_worker_is_refused_with_a_400(
    server: ServerProcess,
) -> None:
    home, worker, duplicate, first, free_again = asyncio.run(same_rid_on_two_workers(server))
    assert worker != home
    assert duplicate.status_code == 400, duplicate.text
    # SGLang's words, as the worker holding it would answer (the scheduler answers here).
    message = duplicate.json()["error"]["message"]
    assert message.startswith(
        "Duplicate request ID detected: dup-1 (a request with rid 'dup-1' is already running)"
    ), message
    # The refusal left the running request alone: it ran until the abort.
    assert first["finish_reason"]["type"] == "abort" and 0 < first["completion_tokens"] < 2000, (
        first
    )
    assert (
        free_again.status_code == 200 and free_again.json()["meta_info"]["completion_tokens"] == 3
    ), free_again.text


async def conversation_over_two_workers(
    srv: ServerProcess,
) -> tuple[int, int, dict[str, Any], dict[str, Any], int, int]:
    """A stored response made through one worker, continued (previous_response_id), read
    and deleted through another: the store is one file the workers share. Returns both
    workers, both responses, and the GET status codes after and before the delete."""
    first_body = {"input": "Say hi.", "max_output_tokens": 3, "temperature": 0}
    async with one_connection(srv) as client:
        home = await worker_of(client)
        first = (await client.post("/v1/responses", json=first_body)).json()
    for _ in range(60):
        async with one_connection(srv) as other:
            worker = await worker_of(other)
            if worker == home:
                continue
            second_body = {
                "input": "Again.",
                "previous_response_id": first["id"],
                "max_output_tokens": 3,
                "temperature": 0,
            }
            second = (await other.post("/v1/responses", json=second_body)).json()
            found = (await other.get(f"/v1/responses/{first['id']}")).status_code
            assert (await other.delete(f"/v1/responses/{first['id']}")).status_code == 200
            break
    else:
        pytest.fail("no connection landed on another worker")
    async with one_connection(srv) as client:
        gone = (await client.get(f"/v1/responses/{first['id']}")).status_code
    return home, worker, first, second, gone, found


def test_a_stored_response_is_continued_through_another_worker(server: ServerProcess) -> None:
    home, worker, first, second, gone, found = asyncio.run(conversation_over_two_workers(server))
    assert worker != home and found == 200 and gone == 404
    assert second["previous_response_id"] == first["id"], second
    # The second prompt holds the first exchange: more tokens than the first's prompt and answer.
    assert (
        second["usage"]["input_tokens"]
        > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    ), (first, second)


def api_workers(srv: ServerProcess) -> list[int]:
    return [pid for pid, role in descendants(srv.proc.pid).items() if role == "api"]


def test_kill_9_of_one_worker_stops_the_whole_service(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "tmp", ["--api-workers", "2"]).wait_ready()
    everyone = list(descendants(srv.proc.pid))
    workers = api_workers(srv)
    assert len(workers) == 2 and len(everyone) == 4, descendants(srv.proc.pid)

    os.kill(workers[1], signal.SIGKILL)
    code = srv.proc.wait(timeout=10)

    assert code != 0
    assert wait_until(lambda: not any(pid_alive(p) for p in everyone), timeout=2.0), "orphan left"
    assert list((tmp_path / "tmp").iterdir()) == [], "socket files left behind"
    assert "child process api-" in srv.output() and "killed by signal 9" in srv.output()


def test_a_taken_port_fails_at_start(tmp_path: Path) -> None:
    """SO_REUSEPORT would let the workers share a port another server holds: the supervisor
    checks it first."""
    first = ServerProcess(tmp_path / "a", ["--api-workers", "2"]).wait_ready()
    try:
        second = ServerProcess(tmp_path / "b", ["--api-workers", "2", "--port", str(first.port)])
        code = second.proc.wait(timeout=60)
        assert code != 0 and f"could not start on 127.0.0.1:{first.port}" in second.output(), (
            second.output()[-2000:]
        )
    finally:
        assert first.stop() == 0
