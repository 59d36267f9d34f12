"""Streams hold one event per token while the client keeps up, and merge only what piled up
while the client's socket was not writable: against a real ``tokenpipe serve``, whose
/generate events hold the whole output so far (SGLang's default), and one started with
``--incremental-streaming-output``, whose events hold only what is new.

"Late" is made deterministic by SIGSTOPping the API process mid-stream: the scheduler keeps
generating, and on SIGCONT the API's ZeroMQ loop takes every queued frame back to back
before the stream generator runs. "Slow" is a raw socket with a tiny receive buffer and MSS
that does not read until the request has finished server-side, so the server's send blocks.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import h11
import httpx
import openai
import pytest

from tests.server_harness import ServerProcess, wait_until

MODEL = "tokenpipe-tiny"
PAUSE_S = 0.5
MODES = ["cumulative", "incremental"]


@pytest.fixture(scope="module")
def incremental(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("incremental") / "tmp", ["--incremental-streaming-output"]
    ).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def server_of(mode: str, request: pytest.FixtureRequest) -> ServerProcess:
    """The shared server (SGLang's cumulative events) or the incremental one."""
    name = "server" if mode == "cumulative" else "incremental"
    return request.getfixturevalue(name)  # type: ignore[no-any-return]


def greedy(max_new_tokens: int) -> dict[str, Any]:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}


def pause(pid: int) -> None:
    """Stops the API process for a while: the scheduler's frames queue up meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(PAUSE_S)
    finally:
        os.kill(pid, signal.SIGCONT)


def generate_events(
    server: ServerProcess, body: dict[str, Any], after_first: Callable[[], None] | None = None
) -> list[dict[str, Any]]:
    """The data events of a /generate stream, without [DONE]; ``after_first`` runs once the
    first event has been read."""
    events: list[dict[str, Any]] = []
    with server.client() as c, c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        for line in lines:
            if line == "data: [DONE]":
                break
            events.append(json.loads(line[len("data: ") :]))
            if after_first is not None and len(events) == 1:
                after_first()
    assert lines[-1] == "data: [DONE]"
    return events


def check_events(events: list[dict[str, Any]], whole: dict[str, Any], mode: str) -> None:
    """Every token exactly once (in its own event, or in the events from its own on), counts
    through each event, the finish on the last event only."""
    if mode == "incremental":
        assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]
        assert "".join(e["text"] for e in events) == whole["text"]
        through = 0
        for e in events:
            through += len(e["output_ids"])
            assert e["meta_info"]["completion_tokens"] == through
    else:
        for e in events:
            assert e["output_ids"] == whole["output_ids"][: e["meta_info"]["completion_tokens"]]
            assert whole["text"].startswith(e["text"])
        assert (
            events[-1]["output_ids"] == whole["output_ids"] and events[-1]["text"] == whole["text"]
        )
    assert [e["meta_info"]["finish_reason"] is not None for e in events] == [False] * (
        len(events) - 1
    ) + [True]
    assert "e2e_latency" in events[-1]["meta_info"] and all(
        "e2e_latency" not in e["meta_info"] for e in events[:-1]
    )


def test_generate_stream_sends_one_event_per_token(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """Greedy 8 tokens: 8 events of one new id each; and 32 tokens with the API paused after
    the first event (the frames of the pause are taken back to back): still 32 events."""
    server = server_of(mode, request)
    api = server.children()["api"]
    for n, after_first in ((8, None), (32, lambda: pause(api))):
        body = {"text": "Once upon a time", "sampling_params": greedy(n)}
        with server.client() as c:
            whole = c.post("/generate", json=body).json()
        events = generate_events(server, body, after_first)
        counts = [1] * n if mode == "incremental" else list(range(1, n + 1))
        assert [len(e["output_ids"]) for e in events] == counts, (
            f"{n} tokens came as {len(events)} events"
        )
        check_events(events, whole, mode)


def test_generate_stream_logprobs_follow_the_mode(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """An event's output logprob entries are those of its output_ids: every one so far
    (cumulative, as SGLang) or its own; the prompt's are on every cumulative event (SGLang
    lists them on each) and on the first incremental one only."""
    server = server_of(mode, request)
    body = {
        "text": "Once upon a time",
        "sampling_params": greedy(6),
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    with server.client() as c:
        whole = c.post("/generate", json=body).json()
    events = generate_events(server, body)
    for e in events:
        assert [entry[1] for entry in e["meta_info"]["output_token_logprobs"]] == e["output_ids"]
    prompt = [entry[1] for entry in whole["meta_info"]["input_token_logprobs"]]
    with_prompt = [e for e in events if "input_token_logprobs" in e["meta_info"]]
    assert with_prompt == (events if mode == "cumulative" else events[:1])
    assert all(
        [entry[1] for entry in e["meta_info"]["input_token_logprobs"]] == prompt
        for e in with_prompt
    )
    check_events(events, whole, mode)


def test_chat_stream_sends_one_content_chunk_per_token(server: ServerProcess) -> None:
    """64 greedy chat tokens through the official client, the API paused after the first
    content chunk: 64 content chunks. (Every token of this prompt's greedy output decodes
    to text on its own; a token ending inside a UTF-8 character would show no content.)"""
    api = server.children()["api"]
    messages = [{"role": "user", "content": "Good morning"}]
    args: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": 64,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as oai:
        whole = oai.chat.completions.create(**args)
        contents: list[str] = []
        finishes: list[str | None] = []
        for chunk in oai.chat.completions.create(**args, stream=True):
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            finishes.append(choice.finish_reason)
            if choice.delta.content:
                contents.append(choice.delta.content)
                if len(contents) == 1:
                    pause(api)
    assert whole.usage is not None and whole.usage.completion_tokens == 64
    assert "".join(contents) == whole.choices[0].message.content
    assert len(contents) == 64, f"64 tokens came as {len(contents)} content chunks"
    assert finishes[-1] == "length" and not any(finishes[:-1])


def test_slow_reader_gets_every_token_once_in_merged_events(
    mode: str, request: pytest.FixtureRequest
) -> None:
    """A client that reads nothing until its 1000-token request has finished server-side:
    the server's send blocks on the full socket, the rows of that time merge, and the client
    still reads every token exactly once, with the finish on the last event. How many events
    merged depends on the kernel's buffers, so only events <= tokens is asserted."""
    server = server_of(mode, request)
    n = 1000
    # A 256-character rid makes every event's meta_info larger, so the buffers fill sooner.
    rid = f"slow-{uuid.uuid4().hex}".ljust(256, "x")
    body = {"text": "a slow reader", "sampling_params": greedy(n)}
    with server.client() as c:
        whole = c.post("/generate", json=body).json()
        sock = socket.socket()
        try:
            # Before connect, so that they shape the connection: a small window and segments.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
            sock.settimeout(120)
            sock.connect(("127.0.0.1", server.port))
            conn = h11.Connection(h11.CLIENT)
            send_request(sock, conn, {**body, "rid": rid, "stream": True})
            # The head comes once the request is live; then nothing is read until it is done.
            assert read_event(sock, conn).status_code == 200  # type: ignore[union-attr]
            assert wait_until(lambda: not live(c), 120), (
                "the request did not finish while its client was not reading"
            )
            raw = read_body(sock, conn)
        finally:
            sock.close()
    blocks = raw.decode().split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    events = [json.loads(b[len("data: ") :]) for b in blocks[:-2]]
    check_events(events, whole, mode)
    assert len(events) <= n
    print(f"\n{n} tokens to a slow reader as {len(events)} events ({len(raw)} bytes)")


def live(c: httpx.Client) -> int:
    return int(c.get("/server_info").json()["live_requests"])


def send_request(sock: socket.socket, conn: h11.Connection, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [
        ("Host", "127.0.0.1"),
        ("Content-Type", "application/json"),
        ("Content-Length", str(len(payload))),
    ]
    sock.sendall(conn.send(h11.Request(method="POST", target="/generate", headers=headers)) or b"")
    sock.sendall(
        (conn.send(h11.Data(data=payload)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    )


def read_event(sock: socket.socket, conn: h11.Connection) -> h11.Event:
    while (event := conn.next_event()) is h11.NEED_DATA:
        conn.receive_data(sock.recv(65536))
    return event  # type: ignore[return-value]


def read_body(sock: socket.socket, conn: h11.Connection) -> bytes:
    body = bytearray()
    while not isinstance(event := read_event(sock, conn), h11.EndOfMessage):
        assert isinstance(event, h11.Data), event
        body += event.data
    return bytes(body)
