"""Streams under ``tokenpipe serve`` take the direct path: their events go straight to the
client's socket (``pipeline.http.uvicorn_internals.direct_writer``), not through ASGI
``send``. A uvicorn release that renames what the direct path uses would not fail a stream,
only slow every one of them down; this test is what notices. The observable is the API's
own ``tokenpipe:sse_streams_total{write_path}``, counted as each stream starts, and its log,
which shows a direct path chosen and then failing; tests/unit/test_uvicorn_internals.py checks
each name the direct path uses against the installed uvicorn."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
TOKENS = 16
TIMEOUT = 30.0  # per request: a stuck stream fails the test soon

STREAMS = {
    "/generate": {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True},
    },
    "/v1/completions": {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    },
    "/v1/chat/completions": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Good morning"}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    },
}


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # Its own server: the counters then move only with this module's streams.
    server = ServerProcess(tmp_path_factory.mktemp("uvicorn-fast-path") / "tmp").wait_ready()
    yield server
    server.stop()


def write_paths(client: httpx.Client) -> dict[str, float]:
    """``tokenpipe:sse_streams_total`` by ``write_path``."""
    text = client.get("/metrics").text
    found = re.findall(
        r'^tokenpipe:sse_streams_total\{[^}]*write_path="(\w+)"[^}]*\} (\S+)$', text, re.MULTILINE
    )
    return {path: float(value) for path, value in found}


def streamed_text(client: httpx.Client, path: str) -> str:
    """Streams a request to ``path`` to its end; the text its events carried."""
    with client.stream("POST", path, json={**STREAMS[path], "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    if path == "/generate":
        return str(events[-1]["text"])  # each event holds the text so far (SGLang's stream)
    choices = [e["choices"][0] for e in events if e["choices"]]
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for c in choices)


def whole_text(client: httpx.Client, path: str) -> str:
    answer = client.post(path, json=STREAMS[path]).json()
    if path == "/generate":
        return str(answer["text"])
    choice = answer["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


@pytest.mark.parametrize("path", list(STREAMS))
def test_a_stream_takes_the_direct_path(srv: ServerProcess, path: str) -> None:
    with httpx.Client(base_url=srv.url, timeout=TIMEOUT) as client:
        whole = whole_text(client, path)
        logged_before = len(srv.output())
        before = write_paths(client)
        assert set(before) == {"direct", "asgi"}, (
            "no tokenpipe:sse_streams_total{write_path} in /metrics"
        )
        streamed = streamed_text(client, path)
        after = write_paths(client)
    assert after["asgi"] == before["asgi"], (
        f"a {path} stream went through ASGI send, not straight to the socket: has uvicorn changed "
        "what pipeline/http/uvicorn_internals.py uses?"
    )
    assert after["direct"] == before["direct"] + 1, (
        f"the {path} stream was not counted: is SseResponse given on_write_path?"
    )
    # A direct path chosen, then failing as it writes (an after-frame callback's error, logged),
    # would still deliver every event, all at the stream's end, through send.
    logged = srv.output()[logged_before:]
    assert "Traceback" not in logged, f"the {path} stream's direct path failed:\n{logged}"
    # Greedy: the stream (its events written straight to the socket) says what the answer does.
    assert whole and streamed == whole
