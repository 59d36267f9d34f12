"""--max-queued-requests: the scheduler's waiting queue is bounded; a request that finds it
full is refused at once (503, Retry-After), and nothing admitted or queued is affected."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import REQ_ID_DTYPE, FinishAbort, FinishLength
from pipeline.columns import from_column
from scheduler_proc.admission import QUEUE_FULL_RETRY_AFTER
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler
from tests.server_harness import ServerProcess, wait_until

# prometheus: a fixture, scraping metrics_server below
from tests.e2e.test_metrics import prometheus, query, scalar  # noqa: F401
from tests.unit.test_scheduler_steps import PROMPT, run_to_end, submit

MAX_NEW = 12


def finishes(s: Scheduler) -> dict[int, object]:
    """One step's finish reasons by req_id, read back through the wire codec."""
    out: dict[int, object] = {}
    for frame in s.step():
        frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type(frame))
        for req_id, reason in zip(
            from_column(frame.req_ids, REQ_ID_DTYPE).tolist(), frame.finished_reasons or []
        ):
            if reason is not None:
                out[req_id] = reason
    return out


def test_scheduler_refuses_the_request_beyond_the_queue_bound() -> None:
    s = build_scheduler(
        ServerConfig(
            max_total_tokens=4096, chunked_prefill_size=256, torch_threads=1, max_queued_requests=2
        )
    )
    submit(s, 1, PROMPT[:40], MAX_NEW)
    submit(s, 2, PROMPT[40:80], MAX_NEW)
    submit(s, 3, PROMPT[80:120], MAX_NEW)  # the queue holds 2: refused before any step
    assert [r.req_id for r in s.waiting] == [1, 2] and s.num_waiting == 2 and 3 not in s.live
    refused = finishes(s)[3]
    assert isinstance(refused, FinishAbort)
    assert refused.status_code == 503 and refused.retry_after == QUEUE_FULL_RETRY_AFTER
    assert "waiting queue is full (2 requests wait" in refused.message
    # The queued ones were admitted by that step (its prefill gave their first token) and
    # run to the end: every other token follows.
    tokens, _ = run_to_end(s)
    assert {rid: len(ids) for rid, ids in tokens.items()} == {1: MAX_NEW - 1, 2: MAX_NEW - 1}


def test_scheduler_queue_room_frees_as_requests_are_admitted() -> None:
    s = build_scheduler(
        ServerConfig(
            max_total_tokens=4096, chunked_prefill_size=256, torch_threads=1, max_queued_requests=1
        )
    )
    submit(s, 1, PROMPT[:40], MAX_NEW)
    reasons = finishes(s)  # admits 1: the queue is empty again
    assert not reasons and s.num_waiting == 0
    submit(s, 2, PROMPT[40:80], MAX_NEW)
    submit(s, 3, PROMPT[80:120], MAX_NEW)
    reasons = {}
    while s.has_work():
        reasons.update(finishes(s))
    assert isinstance(reasons[1], FinishLength) and isinstance(reasons[2], FinishLength)
    assert isinstance(reasons[3], FinishAbort) and reasons[3].retry_after is not None


def test_scheduler_without_a_bound_queues_everything() -> None:
    s = build_scheduler(
        ServerConfig(max_total_tokens=4096, chunked_prefill_size=256, torch_threads=1)
    )
    for req_id in range(1, 9):
        submit(s, req_id, PROMPT[:40], 2)
    assert s.num_waiting == 8


# --- against a real server ---------------------------------------------------------------

QUEUE, RUNNING, BURST, GEN = 4, 2, 32, 64
LIMIT_ARGS = ["--max-queued-requests", str(QUEUE), "--max-running-requests", str(RUNNING)]


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server ``prometheus`` (imported from test_metrics) scrapes: this module's, bounded."""
    srv = ServerProcess(tmp_path_factory.mktemp("queue") / "tmp", LIMIT_ARGS).wait_ready()
    yield srv
    srv.stop()


def assert_queue_full(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["Retry-After"]) >= 1
    error = resp.json()["error"]
    assert error["type"] == "service_unavailable" and error["code"] == 503
    assert (
        f"the waiting queue is full ({QUEUE} requests wait for admission); retry later"
        == error["message"]
    )


def one_request(srv: ServerProcess, i: int) -> tuple[int, int | None]:
    """Status, and for a success the completion_tokens the client saw (the stream's last
    meta_info, checked against the ids it received)."""
    body = {
        "text": f"Request {i} of the burst",
        "sampling_params": {"max_new_tokens": GEN, "ignore_eos": True},
    }
    with srv.client() as c:
        if i % 2 == 0:
            resp = c.post("/generate", json=body)
            if resp.status_code != 200:
                assert_queue_full(resp)
                return resp.status_code, None
            meta = resp.json()["meta_info"]
            assert len(resp.json()["output_ids"]) == meta["completion_tokens"]
            return 200, meta["completion_tokens"]
        with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
            if resp.status_code != 200:
                resp.read()
                assert_queue_full(resp)
                return resp.status_code, None
            ids: list[int] = []
            meta = {}
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    ids = event["output_ids"]  # the output so far (SGLang's default stream)
                    meta = event["meta_info"]
            assert len(ids) == meta["completion_tokens"]
            return 200, meta["completion_tokens"]


class QueueSampler:
    """Reads the scheduler's report from /server_info in a thread while the burst runs."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.reports: list[dict] = []  # type: ignore[type-arg]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with self.srv.client() as c:
            while not self._stop.is_set():
                report = c.get("/server_info").json()["scheduler"]
                if report is not None:
                    self.reports.append(report)
                time.sleep(0.05)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


LONG_BODY = {"text": "A long one", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}


def scheduler_holds(c: httpx.Client, running: int, queued: int) -> bool:
    report = c.get("/server_info").json()["scheduler"]
    return report is not None and (report["num_running_reqs"], report["num_queue_reqs"]) == (
        running,
        queued,
    )


def occupy(
    srv: ServerProcess, c: httpx.Client, pool: ThreadPoolExecutor, running: int, queued: int
) -> list[Future[httpx.Response]]:
    """Long requests that hold ``running`` slots, then ``queued`` places in the queue. In two
    waves: sent at once, they could all reach the scheduler before its next step, and those
    past the queue bound would be refused instead of admitted."""

    def send(k: int) -> Future[httpx.Response]:
        return pool.submit(
            lambda: srv.client().post("/generate", json={**LONG_BODY, "rid": f"long-{k}"})
        )

    first = [send(k) for k in range(running)]
    assert wait_until(lambda: scheduler_holds(c, running, 0), timeout=60, interval=0.1), (
        "the long requests never ran"
    )
    second = [send(running + k) for k in range(queued)]
    assert wait_until(lambda: scheduler_holds(c, running, queued), timeout=60, interval=0.1), (
        "the long requests never queued"
    )
    return first + second


def test_burst_beyond_the_queue_gets_503_and_prometheus_counts_them(
    metrics_server: ServerProcess,
    prometheus: str,  # noqa: F811
) -> None:
    """Two long requests hold the running slots, then 32 concurrent requests arrive: the
    first four to reach the scheduler queue and the other 28 get 503 at once, however fast the
    machine. Once the long ones are aborted, the four run and finish with all their tokens."""
    with (
        QueueSampler(metrics_server) as sampler,
        ThreadPoolExecutor(BURST + RUNNING) as pool,
        metrics_server.client() as c,
    ):
        blockers = occupy(metrics_server, c, pool, RUNNING, 0)
        burst = [pool.submit(one_request, metrics_server, i) for i in range(BURST)]
        assert wait_until(
            lambda: sum(f.done() for f in burst) == BURST - QUEUE, timeout=60, interval=0.05
        )
        assert scheduler_holds(c, RUNNING, QUEUE) or wait_until(
            lambda: scheduler_holds(c, RUNNING, QUEUE), timeout=10
        )
        for k in range(RUNNING):  # the long ones only (by rid): the queued four must run
            assert c.post("/abort_request", json={"rid": f"long-{k}"}).status_code == 200
        assert all(f.result(60).status_code == 200 for f in blockers)
        results = [f.result(120) for f in burst]
    ok = [tokens for status, tokens in results if status == 200]
    refused = sum(1 for status, _ in results if status == 503)
    assert (len(ok), refused) == (QUEUE, BURST - QUEUE), results
    assert ok == [GEN] * QUEUE, "a queued request lost tokens"
    # The bound held at every report the scheduler made during the burst.
    assert max(r["num_queue_reqs"] for r in sampler.reports) == QUEUE
    assert max(r["live_reqs"] for r in sampler.reports) <= QUEUE + RUNNING
    expr = 'tokenpipe:num_rejected_requests_total{reason="queue_full"}'
    assert wait_until(lambda: scalar(prometheus, expr) == refused, timeout=30, interval=0.5), query(
        prometheus, expr
    )


def test_every_route_answers_a_full_queue_with_503(tmp_path: Path) -> None:
    """The queue filled by long requests, then each route in turn, streaming or not, with
    several choices: a 503 with Retry-After, never a 200 stream, and no state left behind.
    The operator's abort_all (also a 503, but without retry_after) stays the long requests'
    output, a 200."""
    srv = ServerProcess(tmp_path / "tmp", LIMIT_ARGS).wait_ready()
    try:
        with ThreadPoolExecutor(RUNNING + QUEUE) as pool, srv.client() as c:
            long = occupy(srv, c, pool, RUNNING, QUEUE)
            prompt = {"model": "tokenpipe-tiny", "max_tokens": 4}
            chat = {
                "model": "tokenpipe-tiny",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            assert_queue_full(
                c.post(
                    "/generate",
                    json={"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 4}},
                )
            )
            assert_queue_full(
                c.post(
                    "/v1/completions", json={**prompt, "prompt": ["a", "b"], "n": 2, "stream": True}
                )
            )
            assert_queue_full(c.post("/v1/completions", json={**prompt, "prompt": "a"}))
            assert_queue_full(c.post("/v1/chat/completions", json={**chat, "stream": True}))
            assert_queue_full(c.post("/v1/chat/completions", json={**chat, "n": 3}))
            # Anthropic's clients know a full server as 529 overloaded_error, and retry it.
            for stream in (False, True):
                overloaded = c.post("/v1/messages", json={**chat, "stream": stream})
                assert overloaded.status_code == 529, overloaded.text
                assert int(overloaded.headers["retry-after"]) >= 1
                assert overloaded.json()["error"]["type"] == "overloaded_error"
            # The health check's own 1-token request is refused too: not healthy.
            health = c.get("/health_generate")
            assert health.status_code == 503, health.text
            assert "the waiting queue is full" in health.json()["error"]["message"], health.text

            # A refused choice answers for its request at once; its siblings' own refusals
            # (and the aborts sent for them) come back a scheduler step or two later.
            def live() -> int:
                return int(c.get("/server_info").json()["live_requests"])

            assert wait_until(lambda: live() == RUNNING + QUEUE, timeout=10), (
                f"refused choices left state behind: {live()} live"
            )
            c.post("/abort_request", json={"abort_all": True})
            assert all(f.result().status_code == 200 for f in long)
    finally:
        srv.stop()


def test_refused_choice_aborts_its_siblings_and_a_queued_stream_that_disconnects_is_aborted(
    tmp_path: Path,
) -> None:
    """Room for one more in the queue: of an n=2 request, one choice queues and the other is
    refused, so the request is a 503 and the queued choice is aborted, not left to run. Then
    a stream that waits in the queue (no 200 yet) and whose client goes away is aborted."""
    srv = ServerProcess(tmp_path / "tmp", LIMIT_ARGS).wait_ready()
    try:
        with ThreadPoolExecutor(RUNNING + QUEUE + 1) as pool, srv.client() as c:
            long = occupy(srv, c, pool, RUNNING, QUEUE - 1)
            body = {
                "model": "tokenpipe-tiny",
                "prompt": "two",
                "max_tokens": 4,
                "n": 2,
                "stream": True,
            }
            assert_queue_full(c.post("/v1/completions", json=body))
            assert wait_until(
                lambda: c.get("/server_info").json()["live_requests"] == RUNNING + QUEUE - 1,
                timeout=10,
            )
            assert wait_until(lambda: scheduler_holds(c, RUNNING, QUEUE - 1), timeout=10), (
                "the queued sibling was not aborted"
            )

            # A stream that queues (so no answer has started), and whose client then leaves.
            with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
                payload = json.dumps({**LONG_BODY, "stream": True}).encode()
                sock.sendall(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
                assert wait_until(
                    lambda: scheduler_holds(c, RUNNING, QUEUE), timeout=30, interval=0.05
                ), "the stream never queued"
            assert wait_until(lambda: scheduler_holds(c, RUNNING, QUEUE - 1), timeout=30), (
                "the queued stream was not aborted"
            )
            assert c.get("/server_info").json()["live_requests"] == RUNNING + QUEUE - 1
            c.post("/abort_request", json={"abort_all": True})
            assert all(f.result().status_code == 200 for f in long)
    finally:
        srv.stop()
