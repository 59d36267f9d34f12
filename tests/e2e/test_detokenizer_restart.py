"""A detokenizer that restarts under running streams (as supervisord restarts a killed
program): it has none of their text, so each stream ends with the 503 that says so, never
with a normal finish over truncated text, and the API stops the requests in the scheduler.

The scheduler, detokenizer and API run as three processes (``tokenpipe
scheduler|detokenizer|api`` over ipc://, as deploy/supervisord.conf runs them). Once both
streams have events, the test pauses the scheduler (SIGSTOP), kills the detokenizer with -9,
starts another on the same endpoints, waits until it listens, and lets the scheduler go on
(SIGCONT). The pause keeps the streams mid-way over the restart however fast or slow the
machine is: no request can finish, or run far, while no detokenizer reads its rows.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import RoleProcesses, wait_until

TOKENIZER = load_tokenizer(None)
LOST = "the detokenizer restarted and lost this request's text; send it again"
MAX_NEW = 2000  # with the prompt, within the model's 2048 positions
GREEDY = {"temperature": 0, "ignore_eos": True}


class LiveStream:
    """A streaming POST read on its own thread; ``payloads`` are its SSE data lines so far."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.payloads: list[str] = []
        self.status: int | None = None
        self.failure: Exception | None = None
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.payloads.append(line[len("data: ") :])
        except Exception as exc:  # reported by events(), on the test's thread
            self.failure = exc

    def events(self, timeout: float) -> list[dict[str, Any]]:
        """The stream's events once it ended, ``[DONE]`` checked and left out."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the stream never ended"
        assert self.failure is None, self.failure
        assert self.status == 200 and self.payloads[-1] == "[DONE]", (
            self.status,
            self.payloads[-3:],
        )
        return [json.loads(p) for p in self.payloads[:-1]]


def client_output(events: list[dict[str, Any]]) -> tuple[str, list[int]]:
    """The text and ids a /generate stream gave its client: the last event's when each event
    holds the output so far (SGLang's default), else the events' parts joined."""
    if all(len(e["output_ids"]) == e["meta_info"]["completion_tokens"] for e in events):
        return events[-1]["text"], events[-1]["output_ids"]
    return "".join(e["text"] for e in events), [t for e in events for t in e["output_ids"]]


def listening(ipc_endpoint: str) -> bool:
    """Whether a process listens on the ipc:// endpoint (a killed one's socket file is left
    behind, but refuses connections)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(ipc_endpoint.removeprefix("ipc://"))
        except OSError:
            return False
    return True


@pytest.fixture
def three() -> Iterator[RoleProcesses]:
    run_dir = Path(
        tempfile.mkdtemp(prefix="tp-detok-")
    )  # short: ipc paths are limited to ~107 bytes
    procs = RoleProcesses(["--max-total-tokens", "8192"], ipc_dir=run_dir)
    try:
        procs.wait_ready()
        yield procs
    finally:
        scheduler = procs.procs["scheduler"].proc
        if scheduler.poll() is None:
            os.kill(scheduler.pid, signal.SIGCONT)  # never leave it paused
        procs.stop(timeout=30)
        shutil.rmtree(run_dir, ignore_errors=True)


def scheduler_report(url: str) -> dict[str, Any] | None:
    report: dict[str, Any] | None = httpx.get(url + "/server_info", timeout=30).json()["scheduler"]
    return report


@pytest.mark.timeout(300)
def test_streams_lost_by_a_restarted_detokenizer_end_with_503(three: RoleProcesses) -> None:
    url = three.url
    generate = LiveStream(
        url + "/generate",
        {"text": "a long stream", "sampling_params": {"max_new_tokens": MAX_NEW, **GREEDY}},
    )
    completion = LiveStream(
        url + "/v1/completions", {"prompt": "another long stream", "max_tokens": MAX_NEW, **GREEDY}
    )
    assert wait_until(lambda: len(generate.payloads) >= 3 and len(completion.payloads) >= 3, 120), (
        "the streams never started"
    )

    scheduler = three.procs["scheduler"].proc
    os.kill(scheduler.pid, signal.SIGSTOP)
    try:
        three.restart("detokenizer")
        assert wait_until(lambda: listening(three.endpoints["detokenizer"]), 120), (
            "the new detokenizer never listened"
        )
    finally:
        os.kill(scheduler.pid, signal.SIGCONT)

    # /generate: the last event fails the request with the 503 and says why; none before it
    # finished. What the client got before is consistent: its text is that of its ids.
    events = generate.events(120)
    finishes = [e["meta_info"]["finish_reason"] for e in events]
    assert finishes[-1] == {"type": "abort", "message": LOST, "status_code": 503}, finishes[-1]
    assert finishes[:-1] == [None] * (len(events) - 1)
    text, ids = client_output(events)
    assert 3 <= len(ids) < MAX_NEW and events[-1]["meta_info"]["completion_tokens"] == len(ids)
    assert TOKENIZER.decode(ids).startswith(text)

    # OpenAI's stream ends as an abort, never as "length" over part of the text.
    chunks = completion.events(120)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert reasons[-1] == "abort" and set(reasons[:-1]) <= {None}, reasons[-3:]

    # The API stopped both requests in the scheduler, long before their MAX_NEW tokens, and
    # no process keeps state for them.
    def idle() -> bool:
        report = scheduler_report(url)
        return report is not None and report["live_reqs"] == 0 and report["num_queue_reqs"] == 0

    assert wait_until(idle, 120), "the scheduler still runs the lost requests"
    report = scheduler_report(url)
    assert report is not None and report["forward_steps_total"] < MAX_NEW, report

    # The new detokenizer serves the next requests, streamed or not, with their whole text.
    body = {"text": "again", "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    after = httpx.post(url + "/generate", json=body, timeout=120).json()
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert after["text"] == TOKENIZER.decode(after["output_ids"])
    streamed = LiveStream(url + "/generate", body).events(120)
    assert streamed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert client_output(streamed) == (after["text"], after["output_ids"])
    assert wait_until(
        lambda: httpx.get(url + "/server_info", timeout=30).json()["live_requests"] == 0, 60
    )

    def no_decode_state() -> bool:
        report = scheduler_report(url)
        return report is not None and report["detokenizer_live_reqs"] == 0

    assert wait_until(no_decode_state, 60), scheduler_report(url)
