"""Exactness through a real ``tokenpipe serve``: each request gets its own tokens, and stops
end and cut the text where SGLang, vLLM and OpenAI do, streamed or not."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import ServerProcess, wait_until

TOKENIZER = load_tokenizer(None)
PROMPT = "Once upon a time"  # greedy: " 15 wanting sources 51 cho losing ...", plain text


def generate(c: httpx.Client, sampling: dict[str, Any], *, text: str = PROMPT) -> dict[str, Any]:
    resp = c.post(
        "/generate", json={"text": text, "sampling_params": {"temperature": 0, **sampling}}
    )
    assert resp.status_code == 200, resp.text
    return resp.json()  # type: ignore[no-any-return]


def generate_streamed(
    c: httpx.Client, sampling: dict[str, Any], *, text: str = PROMPT, rid: str | None = None
) -> tuple[str, list[int], dict[str, Any]]:
    """The text and ids a stream delivered (its last event's: each holds the output so far,
    and each must hold the one before it), and its last meta_info."""
    body: dict[str, Any] = {
        "text": text,
        "sampling_params": {"temperature": 0, **sampling},
        "stream": True,
    }
    if rid is not None:
        body["rid"] = rid
    text, ids, meta = "", [], {}
    with c.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            assert event["text"].startswith(text) and event["output_ids"][: len(ids)] == ids, (
                "an event took back what was sent"
            )
            text, ids, meta = event["text"], event["output_ids"], event["meta_info"]
    return text, ids, meta


def both(c: httpx.Client, sampling: dict[str, Any]) -> str:
    """The non-streamed text, after checking that the stream delivers the same."""
    whole = generate(c, sampling)
    text, ids, meta = generate_streamed(c, sampling)
    assert (text, ids) == (whole["text"], whole["output_ids"]), sampling
    assert meta["finish_reason"] == whole["meta_info"]["finish_reason"]
    return whole["text"]  # type: ignore[no-any-return]


def token_texts(ids: list[int]) -> list[str]:
    """The text each token adds to the decode of those before it."""
    out, before = [], ""
    for k in range(1, len(ids) + 1):
        now = TOKENIZER.decode(ids[:k])
        out.append(now[len(before) :])
        before = now
    return out


@pytest.fixture(scope="module")
def greedy(server: ServerProcess) -> tuple[str, list[int]]:
    with server.client() as c:
        out = generate(c, {"max_new_tokens": 24, "ignore_eos": True})
    assert "\ufffd" not in out["text"], "pick a prompt whose greedy text is plain"
    return out["text"], out["output_ids"]


def test_a_stop_token_leaves_no_text(server: ServerProcess, greedy: tuple[str, list[int]]) -> None:
    """stop_token_ids [a token the model will produce]: the text ends before that token,
    in /generate, streamed, and in /v1/completions (once: its text was kept)."""
    text, ids = greedy
    k = next(k for k in range(2, len(ids)) if ids[k] not in ids[:k] and token_texts(ids)[k])
    expected = TOKENIZER.decode(ids[:k])
    with server.client() as c:
        assert both(c, {"max_new_tokens": 24, "stop_token_ids": [ids[k]]}) == expected
        kept = generate(c, {"max_new_tokens": 24, "stop_token_ids": [ids[k]], "no_stop_trim": True})
        assert kept["text"] == TOKENIZER.decode(ids[: k + 1])
        resp = c.post(
            "/v1/completions",
            json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop_token_ids": [ids[k]]},
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected


def test_min_new_tokens_keeps_an_early_stop_string_and_cuts_at_a_later_one(
    server: ServerProcess, greedy: tuple[str, list[int]]
) -> None:
    """The first token's text is a stop string; min_new_tokens 3 lets it through, and the
    request ends only where the string occurs again, cut there, streamed or not."""
    text, ids = greedy
    pieces = token_texts(ids)
    stop = pieces[0].strip()
    assert stop, "the first token should have visible text"
    before_min = len("".join(pieces[:2]))  # min_new_tokens 3: an occurrence must end after this
    later = text.find(stop, before_min - len(stop) + 1)
    expected = text[:later] if later >= 0 else text[: len("".join(pieces[:12]))]
    with server.client() as c:
        got = both(
            c, {"max_new_tokens": 12, "min_new_tokens": 3, "stop": [stop], "ignore_eos": True}
        )
    assert got == expected
    assert got.startswith(pieces[0]), "the occurrence before min_new_tokens stays in the text"


def test_the_earliest_of_several_stop_strings_wins_and_the_text_holds_none(
    server: ServerProcess, greedy: tuple[str, list[int]]
) -> None:
    """Two stop strings completed by the same token: the text is cut where the earlier one
    starts, whichever is listed first, and holds neither."""
    text, ids = greedy
    pieces = token_texts(ids)
    for k in range(1, len(ids)):
        piece, before = pieces[k], "".join(pieces[:k])
        if len(piece) < 4 or not piece[1:].strip():
            continue
        first, second = piece[-2:], piece[1:3]  # both end in this token; ``second`` starts first
        if first in before + piece[:-1] or second in before + piece[1:2]:
            continue  # met earlier: the request would end before token k
        break
    else:
        pytest.skip("the greedy text has no token long enough")  # never in CI: the prompt is fixed
    expected = before + piece[:1]
    with server.client() as c:
        for stops in ([first, second], [second, first]):
            got = both(c, {"max_new_tokens": 24, "stop": stops, "ignore_eos": True})
            assert got == expected, stops
            assert first not in got and second not in got


def test_aborted_queued_requests_never_take_a_running_streams_tokens(tmp_path: Path) -> None:
    """One running slot: A streams 600 greedy tokens two per row while 16 queued requests
    are aborted by rid. Their empty rows share frames with A's two-token rows; A must get
    every token, and each aborted request none (once: A lost 1-4 tokens to them)."""
    server = ServerProcess(tmp_path / "tmp", ["--max-running-requests", "1"]).wait_ready()
    try:
        sampling = {"max_new_tokens": 600, "ignore_eos": True, "stream_interval": 2}
        with server.client() as c:
            reference = generate(c, sampling)["output_ids"]
            result: dict[str, Any] = {}
            streamer = threading.Thread(
                target=lambda: result.update(a=generate_streamed(c, sampling, rid="A"))
            )
            streamer.start()
            assert wait_until(lambda: c.get("/server_info").json()["live_requests"] >= 1, 30)
            victims: dict[str, dict[str, Any]] = {}

            def queued(rid: str) -> None:
                with server.client() as own:
                    resp = own.post(
                        "/generate",
                        json={
                            "text": f"victim {rid}",
                            "rid": rid,
                            "sampling_params": {"max_new_tokens": 8},
                        },
                    )
                    victims[rid] = resp.json()

            threads = [threading.Thread(target=queued, args=(f"v{i}",)) for i in range(16)]
            for t in threads:
                t.start()
            assert wait_until(lambda: c.get("/server_info").json()["live_requests"] >= 17, 30)
            for i in range(16):
                assert c.post("/abort_request", json={"rid": f"v{i}"}).status_code == 200
                time.sleep(0.01)  # spread the aborts over several steps of A
            for t in threads:
                t.join(60)
            streamer.join(120)
        _, ids, meta = result["a"]
        assert ids == reference and meta["completion_tokens"] == 600
        for rid, out in victims.items():
            assert out["output_ids"] == [] and out["meta_info"]["completion_tokens"] == 0, rid
            assert out["meta_info"]["finish_reason"]["type"] == "abort", rid
    finally:
        server.stop()
