"""Priority scheduling against a real server (``--scheduling-policy priority``: lower values
first): a higher-priority request preempts the latest lower running one at the next step and
finishes before the equal-priority requests that queued before it, the victim's seeded output
is unchanged, and a full queue gives its lowest waiting request up (503) to a higher arrival
while an equal arrival is the one refused. Orders are read from the requests' own stats."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess, wait_until

EXACT = ["--enable-deterministic-inference", "--torch-threads", "1"]
ARGS = ["--max-running-requests", "2", "--max-queued-requests", "5"]
LONG = 2000  # the context's worth: the test pauses the server while it sets the queue up


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("priority") / "tmp"
    srv = ServerProcess(tmp, [*ARGS, "--scheduling-policy", "priority", *EXACT]).wait_ready()
    yield srv
    srv.stop()


def body(rid: str, priority: int, max_new: int, text: str | None = None) -> dict[str, Any]:
    # Seeded sampling, EOS ignored: the output is a function of (seed, position) only.
    sampling = {"max_new_tokens": max_new, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    return {
        "rid": rid,
        "text": text or f"Request {rid}",
        "priority": priority,
        "sampling_params": sampling,
    }


class Stream:
    """A streamed /generate read on its own thread: its latest event's output_ids and meta."""

    def __init__(self, srv: ServerProcess, request: dict[str, Any]) -> None:
        self.ids: list[int] = []
        self.meta: dict[str, Any] = {}
        self.done = threading.Event()
        threading.Thread(target=self._read, args=(srv, request), daemon=True).start()

    def _read(self, srv: ServerProcess, request: dict[str, Any]) -> None:
        with (
            srv.client() as c,
            c.stream("POST", "/generate", json={**request, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    self.ids, self.meta = event["output_ids"], event["meta_info"]
        self.done.set()


def post(srv: ServerProcess, request: dict[str, Any]) -> httpx.Response:
    with srv.client() as c:
        return c.post("/generate", json=request)


def live(c: httpx.Client) -> int:
    """Requests the API has sent to the scheduler (in order, over one socket)."""
    return int(c.get("/server_info").json()["live_requests"])


def hold_two_running(srv: ServerProcess, c: httpx.Client, victim_text: str) -> list[Stream]:
    """Two long priority-10 requests running (the later one is "victim"), then the server
    paused in place: nothing moves, so the queue is set up without a race against them."""
    streams = []
    for rid, text in (("first", None), ("victim", victim_text)):
        streams.append(Stream(srv, body(rid, 10, LONG, text)))
        assert wait_until(lambda: bool(streams[-1].ids), timeout=60, interval=0.01)
    assert c.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    return streams


def send(
    pool: ThreadPoolExecutor, srv: ServerProcess, c: httpx.Client, request: dict[str, Any]
) -> Future[httpx.Response]:
    """Sends one request and waits until the API has passed it on, so arrivals keep order."""
    before = live(c)
    future = pool.submit(post, srv, request)
    assert wait_until(lambda: live(c) > before or future.done(), timeout=60, interval=0.01)
    return future


def test_a_higher_priority_request_preempts_and_the_victim_output_is_unchanged(
    server: ServerProcess,
) -> None:
    prompt = "The victim's own prompt"
    with ThreadPoolExecutor(8) as pool, server.client() as c:
        first, victim = hold_two_running(server, c, prompt)
        waiting = [send(pool, server, c, body(f"w{k}", 10, 8)) for k in range(4)]
        urgent_future = send(pool, server, c, body("urgent", 0, 8))
        assert c.post("/continue_generation", json={}).status_code == 200
        urgent = urgent_future.result(60)
        assert urgent.status_code == 200, urgent.text
        meta = urgent.json()["meta_info"]
        assert meta["completion_tokens"] == 8 and meta["num_retractions"] == 0
        assert not any(f.done() for f in waiting), "a waiting request finished first"
        # The victim (the later of the two) was retracted, re-admitted, and goes on.
        resumed = len(victim.ids)
        assert wait_until(lambda: len(victim.ids) > resumed + 20, timeout=60, interval=0.01)
        for rid in ("first", "victim"):
            assert c.post("/abort_request", json={"rid": rid}).status_code == 200
        assert first.done.wait(60) and victim.done.wait(60)
        results = [f.result(60) for f in waiting]
    # Equal priorities never preempted each other: only the urgent request did, once.
    assert (victim.meta["num_retractions"], first.meta["num_retractions"]) == (1, 0)
    for r in results:  # queued first, admitted only after the urgent one's first token
        assert r.status_code == 200 and r.json()["meta_info"]["num_retractions"] == 0
        assert r.json()["meta_info"]["forward_entry_time"] > meta["prefill_finished_time"]
    # The victim's seeded output is its uninterrupted run's.
    alone = post(server, body("alone", 10, len(victim.ids), prompt)).json()
    assert alone["output_ids"] == victim.ids and alone["meta_info"]["num_retractions"] == 0


def test_a_full_queue_gives_its_lowest_request_up_to_a_higher_one_only(
    server: ServerProcess,
) -> None:
    with ThreadPoolExecutor(9) as pool, server.client() as c:
        running = hold_two_running(server, c, "another prompt")
        queued = [send(pool, server, c, body(f"q{k}", 10, 4)) for k in range(5)]
        higher = pool.submit(post, server, body("higher", 5, 4))  # takes a place, live or not
        displaced = queued[-1].result(60)  # the latest of the lowest
        assert displaced.status_code == 503, displaced.text
        assert int(displaced.headers["Retry-After"]) >= 1
        assert "gave its place to one of higher priority" in displaced.json()["error"]["message"]
        equal = post(server, body("equal", 10, 4))
        assert equal.status_code == 503, equal.text
        assert "the waiting queue is full (5 requests" in equal.json()["error"]["message"]
        assert not any(f.done() for f in [*queued[:-1], higher])
        assert c.post("/continue_generation", json={}).status_code == 200
        c.post("/abort_request", json={"abort_all": True})
        assert higher.result(60).status_code == 200
        assert all(f.result(60).status_code == 200 for f in queued[:-1])
        assert all(stream.done.wait(60) for stream in running)
