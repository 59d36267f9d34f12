"""A scheduler that restarts under the API (as supervisord restarts a killed program): every
request it held is lost, and each client gets a 503 with a message saying so, never a 500.

The scheduler, detokenizer and API run as three processes (``tokenpipe scheduler|detokenizer|api``
over ipc://, as deploy/supervisord.conf runs them); the test kills the scheduler with -9 and
starts another, whose first stats report carries a new ``instance``. With
``--max-running-requests 1`` one request runs and the others wait in the queue, so none of
them has had an output row (and its stats) when the scheduler dies, however fast the machine.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import RoleProcesses, wait_until

LOST = "the scheduler restarted and lost this request; send it again"
GREEDY = {"temperature": 0, "ignore_eos": True}


class ThreeProcesses(RoleProcesses):
    """The three processes over ipc:// in ``run_dir``, one request running at a time."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(["--max-running-requests", "1"], ipc_dir=run_dir)

    def scheduler_report(self) -> dict[str, Any] | None:
        report: dict[str, Any] | None = httpx.get(self.url + "/server_info", timeout=30).json()[
            "scheduler"
        ]
        return report

    def scheduler_live_reqs(self) -> int:
        report = self.scheduler_report()
        return int(report["live_reqs"]) if report else 0

    def restart_scheduler(self) -> None:
        self.restart("scheduler")


@pytest.fixture
def three() -> Iterator[ThreeProcesses]:
    run_dir = Path(
        tempfile.mkdtemp(prefix="tp-restart-")
    )  # short: ipc paths are limited to ~107 bytes
    procs = ThreeProcesses(run_dir)
    try:
        procs.wait_ready()
        yield procs
    finally:
        procs.stop(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """The status and the SSE data lines; for an error status, the error body as the one line."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as resp:
        if resp.status_code != 200:
            return resp.status_code, [resp.read().decode()]
        return resp.status_code, [line for line in resp.iter_lines() if line.startswith("data: ")]


LOST_BODY = {"error": {"message": LOST, "type": "service_unavailable", "code": 503}}


def assert_lost(resp: httpx.Response) -> None:
    assert resp.status_code == 503, resp.text
    assert resp.json() == LOST_BODY


@pytest.mark.timeout(240)
def test_requests_lost_by_a_restarted_scheduler_get_503(three: ThreeProcesses) -> None:
    url = three.url
    long = {"text": "a long request", "sampling_params": {"max_new_tokens": 1900, **GREEDY}}
    short = {"max_new_tokens": 16, **GREEDY}
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(post, url, "/generate", long)  # admitted first: the one that runs
        assert wait_until(lambda: three.scheduler_live_reqs() == 1, 60)
        queued: dict[str, Future[Any]] = {
            "completions": pool.submit(post, url, "/v1/completions",
                {"prompt": "queued", "max_tokens": 16, **GREEDY}),
            "generate stream": pool.submit(stream, url, "/generate",
                {"text": "queued", "sampling_params": short}),
            "chat stream": pool.submit(
                stream, url, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "queued"}], "max_tokens": 16, **GREEDY}
            ),
        }  # fmt: skip
        assert wait_until(lambda: three.scheduler_live_reqs() == 4, 60), (
            "the requests never all reached the scheduler"
        )
        assert not running.done(), "the long request finished before the scheduler was killed"
        three.restart_scheduler()

        assert_lost(running.result(120))
        assert_lost(queued["completions"].result(120))
        # A stream starts only with its first output: a queued one never started, so its
        # loss is the HTTP status, as for the others.
        for name in ("generate stream", "chat stream"):
            status, events = queued[name].result(120)
            assert status == 503 and len(events) == 1, (name, events)
            assert json.loads(events[0]) == LOST_BODY, name

    # The new scheduler serves the next request.
    after = post(
        url, "/generate", {"text": "again", "sampling_params": {"max_new_tokens": 4, **GREEDY}}
    )
    assert after.status_code == 200 and after.json()["meta_info"]["completion_tokens"] == 4
    assert httpx.get(url + "/server_info", timeout=30).json()["live_requests"] == 0
    # Each lost request is counted as a request and as an abort, like /server_info counts it.
    metrics = httpx.get(url + "/metrics", timeout=30).text
    assert metric_total(metrics, "tokenpipe:num_aborted_requests_total") == 4
    assert metric_total(metrics, "tokenpipe:num_requests_total") == 5


@pytest.mark.timeout(240)
def test_a_request_sent_while_the_scheduler_is_down_is_not_run_by_the_next_one(
    three: ThreeProcesses,
) -> None:
    """ZeroMQ keeps what the API sends while no scheduler runs and hands it to the next one.
    The API tells that request's client it was lost (it cannot know the new scheduler will
    get it), so the new scheduler must not run it: no work for nobody, and none done twice
    for the client that sends it again."""
    url = three.url
    # The API tells a restart by the new ``instance`` of the scheduler's reports, so it must
    # hold one from the old scheduler first. Killed at once after the ready check, the old
    # one may take its first report down with it (queued behind the answer, not yet written
    # to the socket), and then the API rightly takes the new one for the first.
    assert wait_until(lambda: three.scheduler_report() is not None, 30)
    three.procs["scheduler"].stop(signal.SIGKILL, timeout=30)
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(
            post,
            url,
            "/generate",
            {"text": "sent into the gap", "sampling_params": {"max_new_tokens": 1900, **GREEDY}},
        )
        assert wait_until(
            lambda: httpx.get(url + "/server_info", timeout=30).json()["live_requests"] == 1, 60
        )
        three.procs["scheduler"] = three.start("scheduler")
        assert_lost(sent.result(120))

    # The new scheduler got the request, and stopped it within a few steps of its start,
    # not after its 1900 tokens.
    def idle() -> bool:
        report = three.scheduler_report()
        return report is not None and report["live_reqs"] == 0 and report["num_queue_reqs"] == 0

    assert wait_until(idle, 120), "the new scheduler still holds the lost request"
    report = three.scheduler_report()
    assert report is not None and report["forward_steps_total"] < 500, report
    after = post(
        url, "/generate", {"text": "again", "sampling_params": {"max_new_tokens": 4, **GREEDY}}
    )
    assert after.status_code == 200 and after.json()["meta_info"]["completion_tokens"] == 4


def metric_total(exposition: str, name: str) -> float:
    """The sum of a counter's samples over its labels."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in exposition.splitlines()
        if line.startswith(name + "{")
    )
