"""SGLang batch requests on /generate (``tokenizer_proc/native/batch.py``), and the peers'
error wording on /generate and the OpenAI routes, against this module's server, which runs
``--enable-deterministic-inference``.

A batch item is the single request it stands for: same text, ids, logprobs and meta_info
(ids, timings and cached tokens aside, which depend on when it ran and what ran before),
whether its prompt was prefilled or served from the prefix cache."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess

N = 20
# Top-level /generate fields of every request the batch test sends (one value for all items).
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose answers do not depend on the prefix cache or the batch (deterministic
    inference), so the batch test compares answers bit for bit with no cache flushes."""
    tmp: Path = tmp_path_factory.mktemp("deterministic-server") / "tmp"
    srv = ServerProcess(tmp, ["--enable-deterministic-inference"]).wait_ready()
    yield srv
    srv.stop()


_VARYING = {
    "id",
    "cached_tokens",
    "cached_tokens_details",
    "e2e_latency",
    "queue_time",
    "forward_entry_time",
    "prefill_finished_time",
    "storage_prefetch_wait",
    "first_token_latency",
    "request_received_ts",
    "request_finished_ts",
    "decode_throughput",
}


def _sampling(i: int) -> dict[str, Any]:
    """Even items greedy, odd ones sampled with a seed of their own."""
    if i % 2 == 0:
        return {"max_new_tokens": 6 + i % 5, "temperature": 0, "ignore_eos": True}
    return {
        "max_new_tokens": 6 + i % 5,
        "temperature": 0.9,
        "top_k": 40,
        "seed": 1000 + i,
        "ignore_eos": True,
    }


def _comparable(answer: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in answer["meta_info"].items() if k not in _VARYING}
    return {"text": answer.get("text"), "output_ids": answer["output_ids"], "meta_info": meta}


def _stream(c: httpx.Client, body: dict[str, Any]) -> list[Any]:
    """The stream's events in order ("[DONE]" as the string)."""
    events: list[Any] = []
    with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line:
                assert line.startswith("data: ")
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _last_per_index(events: list[Any], n: int) -> list[dict[str, Any]]:
    """Each item's last event (SGLang's default stream: the whole answer so far), checking
    that the stream ends with exactly one [DONE] and each item finishes last."""
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    last: dict[int, dict[str, Any]] = {}
    for event in events[:-1]:
        index = event["index"]
        assert index not in last or last[index]["meta_info"]["finish_reason"] is None, (
            "an event after the item's finish"
        )
        last[index] = event
    assert sorted(last) == list(range(n))
    return [{k: v for k, v in last[i].items() if k != "index"} for i in range(n)]


def _num_requests(c: httpx.Client) -> float:
    text = c.get("/metrics").text
    return sum(
        float(v)
        for v in re.findall(r"^tokenpipe:num_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    )


@pytest.mark.parametrize("field", ["text", "input_ids"])
def test_a_batch_answers_as_its_single_requests_do(server: ServerProcess, field: str) -> None:
    """20 prompts, greedy and seeded, non-streamed and streamed: each item's answer (tokens
    and logprobs) equals the same single request's, in order. The singles fill the prefix
    cache and the batches find their prompts there: the answers do not change."""
    prompts: list[Any] = [f"Batch prompt number {i}: once upon a time" for i in range(N)]
    if field == "input_ids":
        prompts = [[5 + i, 17, 230 + 3 * i, 41, 9] for i in range(N)]
    samplings = [_sampling(i) for i in range(N)]
    with server.client() as c:
        singles = [
            c.post("/generate", json={field: p, "sampling_params": s, **LOGPROBS}).json()
            for p, s in zip(prompts, samplings)
        ]
        both = {field: prompts, "sampling_params": samplings, **LOGPROBS}
        batch = c.post("/generate", json=both)
        assert batch.status_code == 200, batch.text
        streamed = _last_per_index(_stream(c, both), N)
    answers = batch.json()
    assert isinstance(answers, list) and len(answers) == N
    expected = [_comparable(s) for s in singles]
    assert [_comparable(a) for a in answers] == expected
    assert [_comparable(a) for a in streamed] == expected
    assert all(a["output_ids"] for a in answers)
    assert all(
        len(s["meta_info"]["output_token_logprobs"]) == len(s["output_ids"]) for s in singles
    )
    assert all(a["meta_info"]["cached_tokens"] > 0 for a in answers), "the cache served nothing"


def test_one_sampling_params_and_one_rid_serve_every_item(server: ServerProcess) -> None:
    """One sampling_params object applies to every item; one rid names item i ``{rid}_{i}``
    (SGLang's naming); a list of rids names each."""
    sampling = {"max_new_tokens": 4, "temperature": 0}
    with server.client() as c:
        shared = c.post(
            "/generate",
            json={"text": ["a b", "c d", "e f"], "sampling_params": sampling, "rid": "bt"},
        ).json()
        listed = c.post(
            "/generate",
            json={"input_ids": [[3, 4], [5, 6]], "sampling_params": sampling, "rid": ["x1", "x2"]},
        ).json()
        single = c.post("/generate", json={"text": "c d", "sampling_params": sampling}).json()
    assert [a["meta_info"]["id"] for a in shared] == ["bt_0", "bt_1", "bt_2"]
    assert [a["meta_info"]["id"] for a in listed] == ["x1", "x2"]
    assert _comparable(shared[1]) == _comparable(single)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"text": ["a", "b", "c", 7]}, "text[3]"),
        (
            {"text": ["a", "b", "c"], "sampling_params": [{}, {}, {"temperature": -1}]},
            "sampling_params[2].temperature",
        ),
        (
            {
                "text": ["a", "b"],
                "sampling_params": [{}, {"max_new_tokens": 4, "min_new_tokens": 9}],
            },
            "sampling_params[1].min_new_tokens",
        ),
        ({"input_ids": [[1, 2], [3, 10**9]]}, "input_ids[1]"),
        ({"input_ids": [[1, 2], []]}, "input_ids[1]"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "rid": ["same", "same"]}, "rid[1]"),
    ],
    ids=[
        "text-type",
        "temperature",
        "min-new-tokens",
        "out-of-vocabulary",
        "empty-prompt",
        "sampling-count",
        "duplicate-rid",
    ],
)
def test_one_bad_item_refuses_the_whole_batch_before_any_runs(
    server: ServerProcess, body: dict[str, Any], param: str
) -> None:
    with server.client() as c:
        before = _num_requests(c)
        for stream in (False, True):
            resp = c.post("/generate", json={**body, "stream": stream})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == param, error
            if "[" in param:
                assert error["message"].startswith(param), error
        assert c.get("/server_info").json()["live_requests"] == 0
        assert _num_requests(c) == before, "a refused batch ran something"


def test_unknown_fields_of_a_batch_are_ignored_and_named_within_it(server: ServerProcess) -> None:
    """A field no schema knows is no bad item: ignored, and named once in X-Ignored-Fields,
    a listed field's with its item (docs/api.md, "Unknown fields")."""
    body = {
        "text": ["a", "b"],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 1, "bar": 2}],
        "bogus": 1,
    }
    with server.client() as c:
        resp = c.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()) == 2
    assert resp.headers["x-ignored-fields"] == "bogus, sampling_params[1].bar"


def test_an_item_too_long_for_the_context_names_it_in_sglang_words(server: ServerProcess) -> None:
    with server.client() as c:
        context = c.get("/model_info").json()["max_context_length"]
        before = _num_requests(c)
        resp = c.post(
            "/generate",
            json={
                "input_ids": [[1, 2], [7] * (context + 5)],
                "sampling_params": {"max_new_tokens": 1},
            },
        )
        assert _num_requests(c) == before
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "input_ids[1]"
    assert error["message"].startswith(
        f"input_ids[1]: The input ({context + 5} tokens) is longer than the model's context length "
        f"({context} tokens)."
    ), error


def test_a_live_rid_refuses_a_batch_naming_the_item(server: ServerProcess) -> None:
    with server.client() as c:
        body = {
            "text": "x",
            "rid": "live-1",
            "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        }
        with c.stream("POST", "/generate", json=body) as live:
            assert live.status_code == 200
            # Held, not dropped: a dropped iterator closes the stream, and the server then
            # aborts the request as a disconnect, racing what the test checks.
            lines = live.iter_lines()
            next(lines)  # it runs
            resp = c.post("/generate", json={"text": ["a", "b"], "rid": ["ok-1", "live-1"]})
            c.post("/abort_request", json={"rid": "live-1"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "rid[1]"
    assert "Duplicate request ID detected: live-1" in error["message"], error


# --- the peers' error wording: both peers' phrases, the route's own first (SGLang's on
# /generate, vLLM's on the OpenAI routes); the rule's own tests are in
# test_peer_errors_and_defaults.py -------------------------------------------------------------


def _error(c: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = c.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error: dict[str, Any] = resp.json()["error"]
    return error


def _in_order(message: str, first: str, second: str) -> None:
    assert message.startswith(first) and second in message[len(first) :], message


def test_a_prompt_longer_than_the_context_gets_the_peers_wording(server: ServerProcess) -> None:
    with server.client() as c:
        ctx = c.get("/model_info").json()["max_context_length"]
        native = _error(
            c, "/generate", {"input_ids": [7] * (ctx + 9), "sampling_params": {"max_new_tokens": 1}}
        )
        completion = _error(c, "/v1/completions", {"prompt": [7] * (ctx + 9), "max_tokens": 1})
        chat = _error(
            c,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * (ctx + 9)}]},
        )
    sglang = (
        f"The input ({ctx + 9} tokens) is longer than the model's context length ({ctx} tokens)."
    )
    vllm = (
        f"This model's maximum context length is {ctx} tokens. However, your request has {ctx + 9} "
        "input tokens. Please reduce the length of the input messages."
    )
    _in_order(native["message"], sglang, vllm)
    assert native["param"] == "text"
    _in_order(completion["message"], vllm, sglang)
    assert completion["param"] == "prompt"
    assert chat["message"].startswith(
        f"This model's maximum context length is {ctx} tokens. However, your request has "
    )
    assert "is longer than the model's context length" in chat["message"]
    assert chat["param"] == "messages"


def test_a_prompt_plus_max_tokens_beyond_the_context_gets_the_peers_wording(
    server: ServerProcess,
) -> None:
    with server.client() as c:
        ctx = c.get("/model_info").json()["max_context_length"]
        native = _error(
            c, "/generate", {"input_ids": [7] * 10, "sampling_params": {"max_new_tokens": ctx}}
        )
        completion = _error(c, "/v1/completions", {"prompt": [7] * 10, "max_tokens": ctx})
        chat = _error(
            c,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": ctx},
        )
    sglang = (
        f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
        "requested a total of "
        f"{ctx + 10} tokens: 10 tokens from the input messages and {ctx} tokens for the completion."
    )
    vllm = (
        f"'max_tokens' or 'max_completion_tokens' is too large: {ctx}. This model's maximum "
        f"context length is {ctx} tokens and your request has 10 input tokens ({ctx} > {ctx} - 10)."
    )
    _in_order(native["message"], sglang, vllm)
    assert native["param"] == "sampling_params.max_new_tokens"
    _in_order(completion["message"], vllm, sglang)
    assert completion["param"] == "max_tokens"
    assert chat["message"].startswith(
        f"'max_tokens' or 'max_completion_tokens' is too large: {ctx}. This model's maximum "
        f"context length is {ctx} tokens"
    )
    assert chat["param"] == "max_tokens"


def test_an_out_of_vocabulary_id_gets_the_peers_wording(server: ServerProcess) -> None:
    """Chat takes text only, so its prompt cannot hold an id: /generate and /v1/completions."""
    with server.client() as c:
        vocab = c.get("/model_info").json()["vocab_size"]
        native = _error(c, "/generate", {"input_ids": [1, vocab + 3, 2]})
        completion = _error(c, "/v1/completions", {"prompt": [1, vocab + 3, 2], "max_tokens": 2})
    sglang = f"The input_ids [{vocab + 3}] contains values greater than the vocab size ({vocab})."
    vllm = f"Token id {vocab + 3} is out of vocabulary"
    _in_order(native["message"], sglang, vllm)
    assert native["param"] == "input_ids"
    _in_order(completion["message"], vllm, sglang)
    assert completion["param"] == "prompt"


def test_a_duplicate_live_rid_gets_sglangs_wording(server: ServerProcess) -> None:
    """Only /generate takes a client's rid (the OpenAI routes name their own requests)."""
    with server.client() as c:
        body = {
            "text": "x",
            "rid": "dup-wording",
            "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        }
        with c.stream("POST", "/generate", json=body) as live:
            assert live.status_code == 200
            # Held, not dropped: a dropped iterator closes the stream, and the server then
            # aborts the request as a disconnect, racing what the test checks.
            lines = live.iter_lines()
            next(lines)  # it runs
            error = _error(c, "/generate", {"text": "y", "rid": "dup-wording"})
            c.post("/abort_request", json={"rid": "dup-wording"})
    assert error["message"].startswith("Duplicate request ID detected: dup-wording"), error
    assert error["param"] == "rid"
