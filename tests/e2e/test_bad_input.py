"""Bad input gets a 400 whose JSON body names the problem, and never disturbs the server
or other requests. A key no schema knows is no bad input: it is ignored, and named in the
answer's X-Ignored-Fields."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.server_harness import ServerProcess

GOOD = {
    "text": "Hello there",
    "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
}

CASES = [
    ("empty text", {"text": "", "sampling_params": {"max_new_tokens": 4}}, "empty"),
    ("empty input_ids", {"input_ids": []}, "empty"),
    ("neither text nor ids", {"sampling_params": {"max_new_tokens": 4}}, "text"),
    ("both text and ids", {"text": "a", "input_ids": [1]}, "exactly one"),
    (
        "negative max_new_tokens",
        {"text": "a", "sampling_params": {"max_new_tokens": -5}},
        "max_new_tokens",
    ),
    (
        "absurd max_new_tokens",
        {"text": "a", "sampling_params": {"max_new_tokens": 10**12}},
        "max_new_tokens",
    ),
    (
        "max_new_tokens as string",
        {"text": "a", "sampling_params": {"max_new_tokens": "ten"}},
        "max_new_tokens",
    ),
    ("temperature negative", {"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ("top_p zero", {"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ("text as number", {"text": 42}, "text"),
    ("stream as string", {"text": "a", "stream": "yes"}, "stream"),
    ("input_ids with strings", {"input_ids": [1, "two"]}, "input_ids"),
    ("token id outside vocab", {"input_ids": [1, 10**7]}, "input_ids"),
    ("negative token id", {"input_ids": [1, -3]}, "input_ids"),
    ("body is a list", [1, 2, 3], "object"),
    ("sampling_params not an object", {"text": "a", "sampling_params": 3}, "sampling_params"),
    ("stop with empty string", {"text": "a", "sampling_params": {"stop": [""]}}, "stop"),
]


@pytest.mark.parametrize("name,body,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_body_gets_400_naming_the_field(
    server: ServerProcess, name: str, body: object, needle: str
) -> None:
    with server.client() as c:
        resp = c.post("/generate", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert needle.lower() in error["message"].lower(), error


IGNORED = [
    (
        "unknown sampling key",
        {"text": "a", "sampling_params": {"max_new_tokenz": 4, "max_new_tokens": 1}},
        "sampling_params.max_new_tokenz",
    ),
    ("unknown top-level key", {"text": "a", "prompt": "b"}, "prompt"),
]


@pytest.mark.parametrize("name,body,header", IGNORED, ids=[c[0] for c in IGNORED])
def test_unknown_key_is_ignored_and_named(
    server: ServerProcess, name: str, body: object, header: str
) -> None:
    with server.client() as c:
        resp = c.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-ignored-fields"] == header


def test_prompt_longer_than_context(server: ServerProcess) -> None:
    with server.client() as c:
        resp = c.post(
            "/generate", json={"input_ids": [7] * 3000, "sampling_params": {"max_new_tokens": 4}}
        )
    assert resp.status_code == 400
    assert "is longer than the model's context length" in resp.json()["error"]["message"]


@pytest.mark.parametrize(
    "raw,needle",
    [
        (b"\xff\xfe{not utf8", "utf-8"),
        (b'{"text": "a"', "json"),
        (b"", "empty"),
        (b"null", "object"),
    ],
    ids=["non-utf8", "truncated-json", "empty-body", "null"],
)
def test_unparsable_bodies(server: ServerProcess, raw: bytes, needle: str) -> None:
    with server.client() as c:
        resp = c.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"].lower()


def test_unknown_route_is_json_404(server: ServerProcess) -> None:
    with server.client() as c:
        resp = c.get("/nope")
    assert resp.status_code == 404 and "error" in resp.json()


def test_bad_input_does_not_disturb_other_requests(server: ServerProcess) -> None:
    def good(_: int) -> int:
        with server.client() as c:
            return c.post("/generate", json=GOOD).json()["meta_info"]["completion_tokens"]

    def bad(i: int) -> int:
        _, body, _ = CASES[i % len(CASES)]
        with server.client() as c:
            return c.post("/generate", json=body).status_code

    with ThreadPoolExecutor(16) as pool:
        goods = pool.map(good, range(16))
        bads = pool.map(bad, range(60))
        assert list(goods) == [8] * 16
        assert set(bads) == {400}
    with server.client() as c:
        assert c.get("/health_generate").status_code == 200
