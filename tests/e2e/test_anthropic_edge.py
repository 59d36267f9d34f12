"""The HTTP edge as Anthropic's clients meet it, on a real ``tokenpipe serve`` with
``--api-key``: the key as ``x-api-key`` (the ``anthropic`` SDK's and Claude Code's header) or
as ``Authorization: Bearer``; error answers on /v1/messages in Anthropic's shape, the key
check's 401 and the body limit's 413 included; ``HEAD /`` open, as Claude Code checks it; and
``GET /v1/models`` read by the official SDK as Anthropic's model list."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any, Protocol

import anthropic
import pytest

from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
API_KEY = "tp-anthropic-Secret-0123456789"
LIMIT = 16384  # --max-request-bytes: small, so a body over it is quick to send


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ["--api-key", API_KEY, "--max-request-bytes", str(LIMIT)]
    srv = ServerProcess(tmp_path_factory.mktemp("anthropic-edge") / "tmp", args).wait_ready()
    yield srv
    srv.stop()


def sdk(keyed: ServerProcess, api_key: str) -> anthropic.Anthropic:
    """The official client without retries (a retry would hide the error looked for)."""
    return anthropic.Anthropic(base_url=keyed.url, api_key=api_key, max_retries=0, timeout=60)


class Answer(Protocol):
    """An HTTP response, httpx's or the one the SDK's exception carries."""

    @property
    def status_code(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def text(self) -> str: ...
    @property
    def headers(self) -> Mapping[str, str]: ...

    def json(self) -> Any: ...


def assert_anthropic_error(response: Answer, status: int, err_type: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == err_type, body
    assert body["error"]["message"] and set(body["error"]) == {"type", "message"}
    assert response.headers["content-length"] == str(len(response.content))


def test_a_wrong_key_is_anthropics_authentication_error(keyed: ServerProcess) -> None:
    with sdk(keyed, "wrong") as client:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            client.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}]
            )
    assert_anthropic_error(raised.value.response, 401, "authentication_error")
    assert raised.value.body == raised.value.response.json()
    message = raised.value.response.json()["error"]["message"]
    assert "x-api-key: KEY" in message and "Authorization: Bearer KEY" in message
    wrong = [
        "",
        API_KEY[:-1],
        API_KEY + "x",
        API_KEY.swapcase(),
        f"Bearer {API_KEY}",  # the Bearer form is for Authorization only
        API_KEY[:-1] + "\u00ff",
    ]
    with keyed.client() as c:
        for key in wrong:
            headers = {b"x-api-key": key.encode("latin-1")}
            answer = c.post("/v1/messages/count_tokens", json={}, headers=headers)
            assert_anthropic_error(answer, 401, "authentication_error")
            assert API_KEY not in answer.text
        # Elsewhere the 401 keeps the server's own shape.
        models = c.get("/v1/models", headers={"x-api-key": API_KEY[:-1]})
        assert models.status_code == 401
        assert models.json()["error"]["type"] == "authentication_error"


def test_either_header_carries_the_key(keyed: ServerProcess) -> None:
    with keyed.client() as c:
        assert c.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        bearer = {"Authorization": f"Bearer {API_KEY}"}
        assert c.get("/v1/models", headers=bearer).status_code == 200
        # One right header is enough, whatever the other says.
        both = {"Authorization": "Bearer wrong", "x-api-key": API_KEY}
        assert c.get("/v1/models", headers=both).status_code == 200
        assert c.get("/v1/models").status_code == 401


def test_root_answers_200_without_a_key(keyed: ServerProcess) -> None:
    with keyed.client() as c:
        head = c.head("/")
        assert head.status_code == 200 and head.content == b""
        get = c.get("/")
        assert get.status_code == 200 and get.json() == {"status": "ok"}


def test_models_list_reads_as_anthropics_model_list(keyed: ServerProcess) -> None:
    with sdk(keyed, API_KEY) as client:
        page = client.models.list()
        assert [m.id for m in page.data] == [MODEL]
        info = page.data[0]
        assert info.type == "model" and info.display_name == MODEL
        assert isinstance(info.created_at, datetime) and info.created_at.tzinfo is not None
        assert page.has_more is False and page.first_id == page.last_id == MODEL
        # Auto-pagination stops after the one page.
        assert [m.id for m in client.models.list()] == [MODEL]
        retrieved = client.models.retrieve(MODEL)
        assert retrieved.id == MODEL and retrieved.type == "model"
        with pytest.raises(anthropic.NotFoundError):
            client.models.retrieve("other")
    with keyed.client(headers={"x-api-key": API_KEY}) as c:
        listed = c.get("/v1/models").json()
        # The OpenAI keys stay.
        assert listed["object"] == "list" and listed["data"][0]["object"] == "model"
        assert {"created", "owned_by", "root", "max_model_len"} <= set(listed["data"][0])


def test_the_body_limit_and_unknown_paths_answer_in_anthropics_shape(
    keyed: ServerProcess,
) -> None:
    too_large = b"x" * (LIMIT + 1)
    with keyed.client(headers={"x-api-key": API_KEY}) as c:
        answer = c.post(
            "/v1/messages", content=too_large, headers={"content-type": "application/json"}
        )
        assert_anthropic_error(answer, 413, "request_too_large")
        assert "--max-request-bytes" in answer.json()["error"]["message"]
        assert answer.headers["connection"] == "close"
        missing = c.post("/v1/messages/no-such-path", json={})
        assert_anthropic_error(missing, 404, "not_found_error")
    # Without the key the key check answers first: the client learns nothing of the limit.
    with keyed.client() as c:
        answer = c.post("/v1/messages", content=too_large)
        assert_anthropic_error(answer, 401, "authentication_error")
