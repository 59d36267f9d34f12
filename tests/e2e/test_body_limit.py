"""``--max-request-bytes`` against a real ``tokenpipe serve``: an oversized body gets 413
with the JSON error shape while it is being read, so the API process's memory never holds
it, the connection is closed instead of drained, and the refusal is counted in /metrics.
Bodies are streamed from generators, so this process never holds them either."""

from __future__ import annotations

import base64
import re
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pipeline.config import ServerConfig
from tests.server_harness import ServerProcess, descendants
from tokenizer_proc.media import MAX_ITEM_BYTES

MiB = 1024 * 1024
LIMIT = MiB  # small, so a body at the limit is quick to send
HUGE = 200 * MiB
COUNTER = "tokenpipe:num_rejected_requests_total{"
API_KEY = "tp-body-limit-Secret-0123456789"


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("body-limit") / "tmp", ["--max-request-bytes", str(LIMIT)]
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--max-request-bytes", str(LIMIT), "--api-key", API_KEY]
    srv = ServerProcess(tmp_path_factory.mktemp("body-limit-keyed") / "tmp", args).wait_ready()
    yield srv
    srv.stop()


def chunks(total: int, size: int = MiB) -> Iterator[bytes]:
    """``total`` bytes of padding (not JSON), one reused chunk at a time, so the test never
    holds them."""
    block = b"x" * size
    sent = 0
    while sent < total:
        n = min(size, total - sent)
        yield block[:n] if n < size else block
        sent += n


def json_of_size(size: int) -> bytes:
    """A valid /generate body of exactly ``size`` bytes: its prompt is far over the token
    budget, so the server answers 400 for that, which is not the body limit's 413."""
    head, tail = b'{"text": "', b'", "sampling_params": {"max_new_tokens": 1}}'
    words, odd = divmod(size - len(head) - len(tail), 2)
    return head + b"a " * words + b"a" * odd + tail


def post(
    url: str, body: Iterator[bytes] | bytes, declared: int | None, key: str | None = None
) -> httpx.Response:
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    if declared is not None:
        headers["content-length"] = str(declared)
    return httpx.post(url, content=body, headers=headers, timeout=120.0)


def assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["type"] == "request_too_large" and error["code"] == 413
    assert str(LIMIT) in error["message"] and "--max-request-bytes" in error["message"]
    # Closed, not drained: uvicorn would otherwise read the rest of the body to reuse the
    # connection.
    assert response.headers["connection"] == "close"


def api_pid(server: ServerProcess) -> int:
    return next(pid for pid, role in descendants(server.proc.pid).items() if role == "api")


def reset_peak(pid: int) -> None:
    # "5" resets VmHWM to the current RSS (proc(5)), so an earlier test's peak cannot hide this
    # one's.
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def vm_hwm_kib(pid: int) -> int:
    match = re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.MULTILINE)
    assert match is not None
    return int(match.group(1))


def rejected(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    lines = [
        line
        for line in text.splitlines()
        if line.startswith(COUNTER) and 'reason="body_too_large"' in line
    ]
    assert len(lines) == 1, text
    return float(lines[0].rsplit(" ", 1)[1])


@pytest.mark.parametrize("declared", [None, HUGE], ids=["chunked", "content-length"])
def test_eight_concurrent_200mib_bodies_get_413_and_the_api_does_not_hold_them(
    limited: ServerProcess, declared: int | None
) -> None:
    pid = api_pid(limited)
    reset_peak(pid)
    before_kib, before_count = vm_hwm_kib(pid), rejected(limited)
    with ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(lambda _: post(limited.url + "/generate", chunks(HUGE), declared), range(8))
        )
    after_kib = vm_hwm_kib(pid)
    print(
        f"API VmHWM before {before_kib / 1024:.1f} MiB, after {after_kib / 1024:.1f} MiB "
        f"({declared=})"
    )
    assert after_kib - before_kib < 128 * 1024
    for response in responses:
        assert_too_large(response)
    assert rejected(limited) - before_count == 8


@pytest.mark.parametrize(
    "path", ["/generate", "/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"]
)
def test_every_route_refuses_a_chunked_body_over_the_limit(
    limited: ServerProcess, path: str
) -> None:
    before = rejected(limited)
    assert_too_large(post(limited.url + path, chunks(LIMIT + 1, 64 * 1024), None))
    assert rejected(limited) - before == 1


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_at_the_limit_is_read_and_one_byte_more_is_not(
    limited: ServerProcess, declared: bool
) -> None:
    at_limit = json_of_size(LIMIT)
    assert len(at_limit) == LIMIT
    answer = post(
        limited.url + "/generate",
        iter([at_limit[: LIMIT // 2], at_limit[LIMIT // 2 :]]),
        LIMIT if declared else None,
    )
    # The server read it all and judged the prompt: too many tokens, an ordinary 400.
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "invalid_request_error"
    over = at_limit[:-1] + b" }"
    assert_too_large(post(limited.url + "/generate", iter([over]), LIMIT + 1 if declared else None))


def declared_huge_post(port: int) -> tuple[bytes, bytes]:
    """Headers and a few bytes of a body declared as 200 MiB, on a raw socket; the answer's
    head and body, read until the server closes the connection (a timeout fails the test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(
            (
                "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {HUGE}\r\n\r\n"
            ).encode()
            + b"{" * 1024
        )
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    return head, body


def test_declared_oversize_body_is_answered_without_being_read(limited: ServerProcess) -> None:
    """The 413 comes at once and the server closes the connection, instead of waiting for
    (or draining) the rest."""
    head, body = declared_huge_post(limited.port)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert b"connection: close" in head.lower()
    assert b'"request_too_large"' in body


def test_a_media_item_over_the_body_limit_is_refused_by_it_first(limited: ServerProcess) -> None:
    # One item at the media limit (20 MiB decoded, ~26.7 MiB of base64) fits the default body
    # limit ...
    assert 4 * -(-MAX_ITEM_BYTES // 3) < ServerConfig().max_request_bytes
    # ... and one over a smaller body limit never reaches the media decoding (whose error is a 400).
    image = base64.b64encode(b"\x89PNG" + b"\0" * LIMIT).decode()
    response = httpx.post(
        limited.url + "/generate", json={"text": "hi", "image_data": image}, timeout=120.0
    )
    assert_too_large(response)


def test_a_keyed_server_checks_the_key_before_the_body_limit(keyed: ServerProcess) -> None:
    for declared in (None, HUGE):
        assert_too_large(post(keyed.url + "/generate", chunks(HUGE), declared, API_KEY))
        # Without the key the answer is 401, and that needs no body either.
        assert post(keyed.url + "/generate", chunks(HUGE), declared).status_code == 401
    # A keyless client cannot make the server drain a huge body either: 401, then close.
    head, _ = declared_huge_post(keyed.port)
    assert head.startswith(b"HTTP/1.1 401") and b"connection: close" in head.lower(), head
    # Under the limit, with the key, the body is read and judged: its prompt is too long.
    under = post(keyed.url + "/generate", json_of_size(LIMIT), LIMIT, API_KEY)
    assert under.status_code == 400, under.text
