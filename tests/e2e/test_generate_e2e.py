"""``/generate`` end to end through ``tokenpipe serve``: three real processes, real sockets."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import ServerProcess

TOKENIZER = load_tokenizer(None)
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "num_retractions",
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


def stream_events(client: httpx.Client, body: dict) -> list[dict]:  # type: ignore[type-arg]
    events = []
    with client.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                events.append({"done": True})
                break
            events.append(json.loads(payload))
    return events


def test_generate_non_streaming_meta_info(tmp_path: Path) -> None:
    # A server of its own: in the shared one, fuzzed prompts may have cached any first token.
    server = ServerProcess(tmp_path / "tmp").wait_ready()
    prompt = f"{uuid.uuid4().hex} {PROMPT}"
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
    }
    try:
        with server.client() as c:
            out = c.post("/generate", json=body).json()
    finally:
        server.stop()
    meta = out["meta_info"]
    assert META_KEYS <= set(meta), META_KEYS - set(meta)
    assert meta["prompt_tokens"] == len(TOKENIZER.encode(prompt))
    assert meta["completion_tokens"] == len(out["output_ids"]) == 24
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert meta["num_retractions"] == 0 and meta["cached_tokens"] == 0
    # Even where a random model ends on an incomplete UTF-8 sequence: U+FFFD, as the decode.
    assert out["text"] == TOKENIZER.decode(out["output_ids"])
    assert (
        meta["request_received_ts"]
        <= meta["forward_entry_time"]
        <= meta["prefill_finished_time"]
        <= meta["request_finished_ts"]
    )
    assert 0 < meta["first_token_latency"] <= meta["e2e_latency"]
    assert meta["queue_time"] >= 0


def test_each_streamed_event_holds_the_output_so_far(server: ServerProcess) -> None:
    """SGLang's default stream: each event's text and output_ids are the whole output through
    it, so SGLang's own clients (``text[len(previous):]``) read the new part; the last event
    is the whole answer."""
    for sampling in (
        {"temperature": 0},
        {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234},
    ):
        body = {
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, **sampling},
        }
        with server.client() as c:
            whole = c.post("/generate", json=body).json()
            events = stream_events(c, body)
        assert events[-1] == {"done": True}
        chunks = events[:-1]
        assert len(chunks) > 1
        previous = ""
        for e in chunks:
            assert e["text"].startswith(previous)
            previous = e["text"]
            assert e["output_ids"] == whole["output_ids"][: e["meta_info"]["completion_tokens"]]
        assert (
            chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
        )
        last = chunks[-1]["meta_info"]
        assert last["completion_tokens"] == len(whole["output_ids"])
        assert last["prompt_tokens"] == whole["meta_info"]["prompt_tokens"]
        assert [e["meta_info"]["completion_tokens"] for e in chunks] == sorted(
            e["meta_info"]["completion_tokens"] for e in chunks
        )
        assert all(e["meta_info"]["finish_reason"] is None for e in chunks[:-1])


def test_stream_interval_groups_tokens(server: ServerProcess) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": 10,
            "temperature": 0,
            "ignore_eos": True,
            "stream_interval": 3,
        },
    }
    with server.client() as c:
        chunks = stream_events(c, body)[:-1]
    assert [len(e["output_ids"]) for e in chunks] == [1, 4, 7, 10]


def test_max_new_tokens_0_answers_with_no_output(server: ServerProcess) -> None:
    """SGLang's way to score a prompt: no token, finish length 0, streamed or not (the
    prompt's logprobs, when asked, are in tests/e2e/test_logprobs_e2e.py)."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}
    with server.client() as c:
        whole = c.post("/generate", json=body).json()
        events = stream_events(c, body)[:-1]
    for answer in (whole, *events):
        assert answer["text"] == "" and answer["output_ids"] == []
    for meta in (whole["meta_info"], events[-1]["meta_info"]):
        assert (
            meta["finish_reason"] == {"type": "length", "length": 0}
            and meta["completion_tokens"] == 0
        )
        assert meta["prompt_tokens"] == len(TOKENIZER.encode(PROMPT))


def test_a_finished_text_ending_in_an_open_utf8_run_is_the_decode_of_its_ids(
    server: ServerProcess,
) -> None:
    """logit_bias forces every token to be the byte 0xF0, a 4-byte character's lead byte
    that nothing completes: the finished text is the tokenizer's decode of the ids (U+FFFD
    where the bytes form no character), as the token's logprob text shows it, streamed or
    not; nothing is dropped at the end."""
    lead = TOKENIZER.tokenizer.token_to_id("ð")  # byte 0xF0 in the byte-level alphabet
    for n in (1, 3):
        sampling = {
            "max_new_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "logit_bias": {str(lead): 100},
        }
        body = {
            "text": PROMPT,
            "sampling_params": sampling,
            "return_logprob": True,
            "return_text_in_logprobs": True,
        }
        with server.client() as c:
            whole = c.post("/generate", json=body).json()
            events = stream_events(c, body)[:-1]
        assert whole["output_ids"] == [lead] * n
        assert whole["text"] == TOKENIZER.decode([lead] * n) == "\ufffd" * n
        assert [entry[2] for entry in whole["meta_info"]["output_token_logprobs"]] == ["\ufffd"] * n
        # Only the finish can show the held bytes, so the last event's text is the whole
        # text whether events carry the output so far or only what is new.
        assert [e["text"] for e in events[:-1]] == [""] * (len(events) - 1) and events[-1][
            "text"
        ] == whole["text"]


def test_input_ids_and_stop_token(server: ServerProcess) -> None:
    ids = TOKENIZER.encode(PROMPT)
    with server.client() as c:
        free = c.post(
            "/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
            },
        ).json()
        stop_at = free["output_ids"][4]
        body = {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
                "stop_token_ids": [stop_at],
            },
        }
        stopped = c.post("/generate", json=body).json()
    first = free["output_ids"].index(stop_at)
    assert stopped["output_ids"] == free["output_ids"][: first + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_stop_string_is_trimmed(server: ServerProcess) -> None:
    with server.client() as c:
        free = c.post(
            "/generate",
            json={
                "text": PROMPT,
                "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True},
            },
        ).json()
        text = free["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), "the model's text should have a non-blank middle"
        body = {
            "text": PROMPT,
            "sampling_params": {
                "max_new_tokens": 30,
                "temperature": 0,
                "ignore_eos": True,
                "stop": [stop],
            },
        }
        whole = c.post("/generate", json=body).json()
        streamed = stream_events(c, body)[-2]["text"]
    assert whole["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert whole["text"] == text[: text.index(stop)]
    assert streamed == whole["text"]


def test_fifty_concurrent_requests_all_finish(server: ServerProcess) -> None:
    def one(i: int) -> dict:  # type: ignore[type-arg]
        body = {
            "text": f"{PROMPT} {i}",
            "sampling_params": {
                "max_new_tokens": 16,
                "temperature": 0.7,
                "seed": i,
                "ignore_eos": True,
            },
        }
        with server.client() as c:
            if i % 2:
                events = stream_events(c, body)
                return {"n": len(events[-2]["output_ids"]), "meta": events[-2]["meta_info"]}
            out = c.post("/generate", json=body).json()
            return {"n": len(out["output_ids"]), "meta": out["meta_info"]}

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(50)))
    assert all(r["n"] == 16 == r["meta"]["completion_tokens"] for r in results)
    assert all(r["meta"]["finish_reason"]["type"] == "length" for r in results)


def test_health_server_info_and_abort(server: ServerProcess) -> None:
    with server.client() as c:
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").json() == {"status": "ok"}
        info = c.get("/server_info").json()
        assert info["model_name"] == "tokenpipe-tiny" and info["max_total_tokens"] == 8192
        missing = c.post("/abort_request", json={"rid": "no-such-request"})
        assert (
            missing.status_code == 404 and "no-such-request" in missing.json()["error"]["message"]
        )


def test_abort_request_finishes_with_abort_reason(server: ServerProcess) -> None:
    body = {
        "text": PROMPT,
        "rid": "to-abort",
        "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True},
    }
    with server.client() as c, c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert server.client().post("/abort_request", json={"rid": "to-abort"}).json() == {
            "aborted": "to-abort"
        }
        events = [json.loads(line[6:]) for line in lines if line and line != "data: [DONE]"]
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    assert final["completion_tokens"] < 1500


def _wait_idle(c: httpx.Client, timeout: float = 20.0) -> dict:  # type: ignore[type-arg]
    import time

    deadline = time.monotonic() + timeout
    info = c.get("/server_info").json()
    while info["live_requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
        info = c.get("/server_info").json()
    return info


def test_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
    }
    with server.client() as c:
        before = _wait_idle(c)["aborted_requests"]
        # Streaming: read one event, then hang up.
        with (
            httpx.Client(base_url=server.url, timeout=30) as s,
            s.stream("POST", "/generate", json={**body, "stream": True}) as resp,
        ):
            next(line for line in resp.iter_lines() if line)
        after_stream = _wait_idle(c)
        assert after_stream["live_requests"] == 0
        assert after_stream["aborted_requests"] == before + 1
        # Non-streaming: the client gives up while the server is still generating.
        try:
            httpx.post(f"{server.url}/generate", json=body, timeout=0.5)
        except httpx.ReadTimeout:
            pass
        after_plain = _wait_idle(c)
        assert after_plain["live_requests"] == 0
        assert after_plain["aborted_requests"] == before + 2
