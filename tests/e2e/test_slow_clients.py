"""``--request-read-timeout``: a client too slow sending its request headers or body is
disconnected, counted in ``num_rejected_requests_total{reason="read_timeout"}``, and nobody
else is affected; a request fully read is never cut, however long its response streams."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Iterator

import pytest

from tests.server_harness import ServerProcess, wait_until

READ_TIMEOUT = 1.0
# Generous: the server must close within the timeout plus scheduling noise on a busy machine.
CLOSE_WITHIN = 15.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # At info level: a client gone mid-upload is an info line (test below), not an error.
    args = ["--request-read-timeout", str(READ_TIMEOUT), "--log-level", "info"]
    server = ServerProcess(tmp_path_factory.mktemp("slow-clients") / "tmp", args)
    server.wait_ready()
    yield server
    server.stop()


def _connect(srv: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=CLOSE_WITHIN + 5)


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes ``sock`` (reads until EOF or reset)."""
    started = time.monotonic()
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail("the server kept a too slow client's connection open")
    return time.monotonic() - started


def _read_timeouts(srv: ServerProcess) -> float:
    with srv.client() as c:
        text = c.get("/metrics").text
    match = re.search(
        r'^tokenpipe:num_rejected_requests_total\{[^}]*reason="read_timeout"[^}]*\} (\S+)$',
        text,
        re.MULTILINE,
    )
    assert match is not None, "no read_timeout rejection counter in /metrics"
    return float(match.group(1))


def test_half_headers_are_dropped_while_others_are_served(srv: ServerProcess) -> None:
    before = _read_timeouts(srv)
    with _connect(srv) as slow:
        slow.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Ty")
        # Meanwhile a normal client is served, on its own connection.
        with srv.client() as c:
            resp = c.post(
                "/generate",
                json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
            )
        assert resp.status_code == 200, resp.text
        assert _closed_after(slow) < CLOSE_WITHIN
    assert _read_timeouts(srv) == before + 1


def test_a_connection_that_sends_nothing_is_dropped_uncounted(srv: ServerProcess) -> None:
    """Closed like an idle kept-alive connection, and not a rejected request: nothing came."""
    before = _read_timeouts(srv)
    with _connect(srv) as idle:
        assert _closed_after(idle) < CLOSE_WITHIN
    assert _read_timeouts(srv) == before


def test_a_body_slower_than_the_timeout_is_dropped(srv: ServerProcess) -> None:
    before = _read_timeouts(srv)
    with _connect(srv) as slow:
        slow.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{"
        )
        assert _closed_after(slow) < CLOSE_WITHIN
    assert _read_timeouts(srv) == before + 1


def test_a_body_trickled_forever_is_dropped(srv: ServerProcess) -> None:
    """One byte per quarter timeout never leaves a gap long enough, but the whole body has
    a bound too (ten read timeouts)."""
    with _connect(srv) as slow:
        slow.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        started = time.monotonic()
        with pytest.raises(OSError):
            while time.monotonic() - started < 10 * READ_TIMEOUT + CLOSE_WITHIN:
                slow.sendall(b" ")
                time.sleep(READ_TIMEOUT / 4)
            pytest.fail("a body trickled one byte at a time was never cut off")
        assert time.monotonic() - started > 3 * READ_TIMEOUT, "cut off before any bound was reached"


def test_a_stream_longer_than_the_timeout_is_not_cut(srv: ServerProcess) -> None:
    """The client reads slowly, so the response lasts longer than the read timeout however
    fast the server is; then the kept-alive connection serves another request."""
    body = {
        "text": "a long story",
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0},
    }
    events = []
    with srv.client() as c:
        with c.stream("POST", "/generate", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        time.sleep(READ_TIMEOUT * 2.5)
        # After a pause longer than the read timeout: the idle time between two requests is
        # the keep-alive timeout's (uvicorn's 5 s), not a slow request.
        time.sleep(READ_TIMEOUT * 1.5)
        again = c.post(
            "/generate",
            json={"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        )
    assert again.status_code == 200, again.text
    assert events[-1]["meta_info"]["completion_tokens"] == 300
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("path", ["/generate", "/tokenize"])
def test_a_client_gone_mid_upload_is_an_info_line_not_an_error(
    srv: ServerProcess, path: str
) -> None:
    """Half a body, then the client leaves: expected, so an info line, never an ERROR with a
    traceback; on the generation routes (served ahead of FastAPI) and the others alike."""
    seen = len(srv.output())
    with _connect(srv) as sock:
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n"
            ).encode()
            + b'{"text": "half a bo'
        )
    line = f"a client disconnected while sending its request (POST {path})"
    assert wait_until(lambda: line in srv.output()[seen:], timeout=CLOSE_WITHIN), srv.output()[
        seen:
    ]
    logged = srv.output()[seen:]
    assert "Traceback" not in logged and "ERROR" not in logged, logged
    with srv.client() as c:
        assert c.get("/health").status_code == 200
