"""``tokenpipe serve`` keeps the service whole: a dead child takes everything down fast and
clean; SIGTERM drains in-flight requests first."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from bench.small_checkpoint import write
from tests.server_harness import ServerProcess, pid_alive, wait_until


@pytest.mark.parametrize("victim", ["scheduler", "detokenizer", "api"])
def test_kill_9_of_a_child_stops_the_whole_service(tmp_path: Path, victim: str) -> None:
    srv = ServerProcess(tmp_path / "tmp").wait_ready()
    children = srv.children()
    assert set(children) == {"scheduler", "detokenizer", "api"}, children
    assert len(list((tmp_path / "tmp").iterdir())) == 1  # the private ipc directory

    started = time.monotonic()
    os.kill(children[victim], signal.SIGKILL)
    code = srv.proc.wait(timeout=10)
    elapsed = time.monotonic() - started

    assert code != 0
    assert elapsed < 5.0, f"took {elapsed:.2f} s to stop"
    assert wait_until(lambda: not any(pid_alive(p) for p in children.values()), timeout=1.0), (
        "orphan left"
    )
    assert list((tmp_path / "tmp").iterdir()) == [], "socket files left behind"
    assert f"child process {victim}" in srv.output() and "killed by signal 9" in srv.output()


def test_health_never_answers_200_for_a_server_whose_scheduler_fails_to_start(
    tmp_path: Path,
) -> None:
    """A checkpoint the API can read (config, tokenizer) but the scheduler cannot load: the
    service stops, and until it does /health answers 503, never the 200 that would send a
    router's traffic to a server that is not there."""
    model = tmp_path / "model"
    write(model, layers=1, hidden=64, seed=0)
    (model / "model.safetensors").write_bytes(b"not a safetensors file")
    srv = ServerProcess(tmp_path / "tmp", ["--model-path", str(model)])
    statuses: set[int] = set()
    deadline = time.monotonic() + 120
    while srv.proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.add(httpx.get(srv.url + "/health", timeout=5).status_code)
        except httpx.TransportError:
            pass  # not listening (yet, or any more)
        time.sleep(0.02)
    assert srv.proc.wait(timeout=30) != 0, srv.output()[-2000:]
    assert 200 not in statuses, statuses
    assert "child process scheduler" in srv.output(), srv.output()[-2000:]


def test_sigterm_lets_in_flight_requests_finish(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "tmp").wait_ready()
    children = srv.children()
    results: list[tuple[float, dict]] = []  # type: ignore[type-arg]
    started = threading.Barrier(5)

    def stream_one(i: int) -> None:
        body = {
            "text": f"story {i}",
            "stream": True,
            "sampling_params": {"max_new_tokens": 600, "ignore_eos": True, "temperature": 0},
        }
        events = []
        with (
            httpx.Client(base_url=srv.url, timeout=60) as c,
            c.stream("POST", "/generate", json=body) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        started.wait()
        results.append((time.monotonic(), events[-1]["meta_info"]))

    threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)  # every request is running now
    sigterm_at = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    code = srv.proc.wait(timeout=60)

    assert code == 0, srv.output()[-3000:]
    assert len(results) == 4
    assert all(done_at > sigterm_at for done_at, _ in results), (
        "a request finished before the SIGTERM"
    )
    assert all(
        m["finish_reason"] == {"type": "length", "length": 600} and m["completion_tokens"] == 600
        for _, m in results
    )
    assert not any(pid_alive(p) for p in children.values())
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_graceful_timeout_under_a_second_bounds_the_drain(tmp_path: Path) -> None:
    """--graceful-timeout 0.5 drains for half a second, not for ever: a stream whose client
    stopped reading (it can never finish) is cut, and the API stops by itself, so the
    supervisor need not kill it."""
    srv = ServerProcess(tmp_path / "tmp", ["--graceful-timeout", "0.5"]).wait_ready()
    payload = json.dumps(
        {
            "text": "never read",
            "stream": True,
            "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True},
        }
    ).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 200"), "the stream never started"
        # Not read from here on: the server's writes back up, and the stream cannot end.
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=60)
    assert code == 0, srv.output()[-3000:]
    assert "did not stop within" not in srv.output(), srv.output()[-3000:]


def test_ready_line_has_a_curl_example(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "tmp").wait_ready()
    try:
        # Ready means ready: /health answers 200 from the moment the line is out.
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        assert srv.ready_line is not None and f"http://127.0.0.1:{srv.port}" in srv.ready_line
        # The curl example is the ready line's second line: it may be read a moment later.
        assert wait_until(lambda: "curl -s" in srv.output(), timeout=5.0)
    finally:
        assert srv.stop() == 0
