"""The HTTP series as vLLM exports them (``http_requests_total{handler, method, status}``, from
prometheus-fastapi-instrumentator) count every answer by route, the edge's 401 and 413
included; and vLLM's ``X-Request-Id`` names a request: its answer's id, the response header
under ``--enable-request-id-headers``, and ``/abort_request`` by it. One server, with a key,
a small body limit and room for one running and one waiting request."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import ServerProcess, wait_until

KEY = "test-key"
MODEL = "tokenpipe-tiny"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
MAX_BYTES = 4096
LONG = {"text": "A long one", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
SERVER_ARGS = [
    "--api-key",
    KEY,
    "--max-request-bytes",
    str(MAX_BYTES),
    "--max-running-requests",
    "1",
    "--max-queued-requests",
    "1",
    "--enable-request-id-headers",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("http-ids") / "tmp", SERVER_ARGS).wait_ready()
    yield srv
    srv.stop()


def keyed(srv: ServerProcess) -> httpx.Client:
    return srv.client(headers={"Authorization": f"Bearer {KEY}"})


def request_counts(c: httpx.Client) -> Counter[tuple[str, str, str]]:
    """``http_requests_total`` by (handler, method, status), as /metrics serves it now."""
    counts: Counter[tuple[str, str, str]] = Counter()
    for family in text_string_to_metric_families(c.get("/metrics").text):
        if family.name == "http_requests":
            for s in family.samples:
                if s.name == "http_requests_total":
                    key = (s.labels["handler"], s.labels["method"], s.labels["status"])
                    counts[key] = int(s.value)
    return counts


def holds(c: httpx.Client, running: int, queued: int) -> bool:
    report = c.get("/server_info").json()["scheduler"]
    return report is not None and (report["num_running_reqs"], report["num_queue_reqs"]) == (
        running,
        queued,
    )


def fill_the_queue(
    srv: ServerProcess, c: httpx.Client, pool: ThreadPoolExecutor
) -> list[Future[httpx.Response]]:
    """Two long /generate requests: one runs, one waits (the queue's one place)."""

    def send(k: int) -> httpx.Response:
        return keyed(srv).post("/generate", json={**LONG, "rid": f"long-{k}"})

    sent = [pool.submit(send, 0)]
    assert wait_until(lambda: holds(c, 1, 0), timeout=60, interval=0.1)
    sent.append(pool.submit(send, 1))
    assert wait_until(lambda: holds(c, 1, 1), timeout=60, interval=0.1)
    return sent


def test_http_requests_total_counts_every_answer_by_handler(server: ServerProcess) -> None:
    with keyed(server) as c, ThreadPoolExecutor(2) as pool:
        before = request_counts(c)
        ok = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
        assert ok.status_code == 200
        chat = server.openai_client(KEY).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=3, stream=True
        )
        assert [chunk.id for chunk in chat]
        bad = c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400
        no_key = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL})
        assert no_key.status_code == 401
        unknown_model = c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert unknown_model.status_code == 404
        assert c.get("/no/such/route").status_code == 404
        too_large = c.post("/generate", json={"text": "x" * MAX_BYTES})
        assert too_large.status_code == 413
        blockers = fill_the_queue(server, c, pool)
        assert c.post("/generate", json=LONG).status_code == 503
        for k in range(2):
            assert c.post("/abort_request", json={"rid": f"long-{k}"}).status_code == 200
        assert [f.result(60).status_code for f in blockers] == [200, 200]
        expected = {
            ("/generate", "POST", "2xx"): 3,
            ("/generate", "POST", "4xx"): 1,
            ("/generate", "POST", "5xx"): 1,
            ("/v1/chat/completions", "POST", "2xx"): 1,
            ("/v1/chat/completions", "POST", "4xx"): 1,
            ("/v1/completions", "POST", "4xx"): 2,
            ("none", "GET", "4xx"): 1,
            ("/abort_request", "POST", "2xx"): 2,
        }

        def increments() -> dict[tuple[str, str, str], int]:
            after = request_counts(c)
            return {k: after[k] - before[k] for k in after if after[k] != before[k]}

        # An answer is counted once its last byte is sent, a moment after the client has it.
        assert wait_until(lambda: increments() == expected, timeout=30, interval=0.1), increments()
    # /metrics and /server_info are left out, as vLLM leaves them out.
    assert not any(handler in ("/metrics", "/server_info") for handler, _, _ in expected)


def test_x_request_id_is_the_answer_id_and_comes_back(server: ServerProcess) -> None:
    client = server.openai_client(KEY)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"X-Request-Id": "trace-a.1"}
    )
    assert raw.headers["x-request-id"] == "trace-a.1"
    assert raw.parse().id == "chatcmpl-trace-a.1"
    streamed = client.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=3, stream=True, extra_headers={"X-Request-Id": "s-2"}
    )
    assert streamed.headers["x-request-id"] == "s-2"
    assert {chunk.id for chunk in streamed.parse()} == {"cmpl-s-2"}
    # Without one, the header carries the id the server made: the answer's, after its prefix.
    made = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=3
    )
    assert made.parse().id == f"chatcmpl-{made.headers['x-request-id']}"


def test_generate_takes_the_header_when_the_body_has_no_rid(server: ServerProcess) -> None:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    with keyed(server) as c:
        named = c.post("/generate", json=body, headers={"X-Request-Id": "gen-7"})
        assert named.json()["meta_info"]["id"] == named.headers["x-request-id"] == "gen-7"
        both = c.post("/generate", json={**body, "rid": "body-7"}, headers={"X-Request-Id": "h"})
        assert both.json()["meta_info"]["id"] == both.headers["x-request-id"] == "body-7"
        # Every answer carries one, an edge refusal too.
        assert httpx.post(f"{server.url}/generate", json=body).headers["x-request-id"]


@pytest.mark.parametrize("value", ["a b", "x" * 129, 'quote"d', "comma,"])
def test_a_malformed_x_request_id_is_a_400_naming_it(server: ServerProcess, value: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        server.openai_client(KEY).completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": value}
        )
    assert refused.value.param == "X-Request-Id" and "X-Request-Id" in refused.value.message
    assert value not in refused.value.response.headers.get("x-request-id", "")


def test_abort_by_x_request_id_stops_a_stream_and_a_duplicate_is_refused(
    server: ServerProcess,
) -> None:
    client = server.openai_client(KEY)

    def long_stream() -> openai.Stream[ChatCompletionChunk]:
        return client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=1500,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": "live-1"},
        )

    chunks = iter(long_stream())
    first = next(chunks)
    assert first.id == "chatcmpl-live-1"
    with pytest.raises(openai.BadRequestError) as duplicate:
        long_stream()
    assert "live-1" in duplicate.value.message
    with keyed(server) as c:
        aborted = c.post("/abort_request", json={"rid": "live-1"})
        assert aborted.status_code == 200, aborted.text
    rest = list(chunks)
    finishes = [
        c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["abort"], json.dumps([c.model_dump() for c in rest[-3:]])
