"""Request leniency as vLLM has it (docs/api.md, "Unknown fields"): a field no schema knows is
ignored, named in the answer's ``X-Ignored-Fields`` and in a warning; a chat role may be any
string, and the template renders it as given. A field that asks for what the server cannot
do stays a 400. ``--reject-unknown-fields`` keeps the old strictness: both are 400s.

vLLM's clients put their extra fields in the official ``openai`` client's ``extra_body``;
/generate is SGLang's, sent with httpx; /v1/messages through the ``anthropic`` SDK, whose
peers (vLLM's and SGLang's Messages API) ignore unknown fields too. The lenient half runs on
the session's shared server (its defaults are the rule's); the strict half on its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import ServerProcess, wait_until

MODEL = "tokenpipe-tiny"
TOKENIZER = load_tokenizer(None)
HI: Any = [{"role": "user", "content": "hi"}]
# A role of the conversation's own, as a model's template may know it (Llama 3.1's "ipython").
CUSTOM: Any = [{"role": "narrator", "content": "Once upon a time"}, *HI]


def chatml(*turns: tuple[str, str]) -> str:
    """The built-in template's rendering, with the generation prompt, by hand."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + "<|im_start|>assistant\n"


def named(response: httpx.Response) -> list[str]:
    """The paths an answer's X-Ignored-Fields names, in its order."""
    return response.headers["x-ignored-fields"].split(", ")


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp: Path = tmp_path_factory.mktemp("strict") / "tmp"
    srv = ServerProcess(tmp, ["--reject-unknown-fields"]).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def strict_oai(strict: ServerProcess) -> Iterator[openai.OpenAI]:
    with strict.openai_client() as c:
        yield c


# --- by default: ignored and named ------------------------------------------------------


def test_extra_body_fields_pass_and_the_answer_names_them(
    server: ServerProcess, oai: openai.OpenAI
) -> None:
    raw = oai.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi", "baz": 1}],  # type: ignore[misc, list-item]
        max_tokens=2,
        extra_body={"unknown_thing": 1},
    )
    assert raw.http_response.status_code == 200
    assert raw.parse().choices[0].message.content is not None
    assert sorted(named(raw.http_response)) == ["messages[0].baz", "unknown_thing"]
    # Streamed too: the header comes with the stream's start.
    with oai.completions.with_streaming_response.create(
        model=MODEL,
        prompt="hi",
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "x": 1}, "foo": [1]},
    ) as stream:
        assert named(stream.http_response) == ["stream_options.x", "foo"]
        assert any(line.startswith("data: ") for line in stream.iter_lines())
    # And in the server's log: the route and the paths (never what a field held).
    line = "POST /v1/chat/completions: the request's unknown fields were ignored: "
    assert wait_until(lambda: line + "messages[0].baz, unknown_thing" in server.output(), 30)


def test_generate_names_fields_at_their_paths_on_errors_too(server: ServerProcess) -> None:
    with server.client() as c:
        ok = c.post(
            "/generate", json={"text": "a", "sampling_params": {"max_new_tokens": 1, "bar": 2}}
        )
        # A 400 for another field still names what was ignored.
        refused = c.post(
            "/generate", json={"text": "a", "foo": 1, "sampling_params": {"temperature": -1}}
        )
    assert ok.status_code == 200 and named(ok) == ["sampling_params.bar"], ok.text
    assert refused.status_code == 400 and named(refused) == ["foo"], refused.text
    assert refused.json()["error"]["param"] == "sampling_params.temperature"


def test_a_field_asking_for_what_the_server_cannot_do_stays_a_400(oai: openai.OpenAI) -> None:
    """vLLM's beam search is a known field this server does not implement: ignoring it would
    be wrong output. The refusal still names the unknown field beside it."""
    with pytest.raises(openai.BadRequestError) as refused:
        oai.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, extra_body={"use_beam_search": True, "foo": 1}
        )
    assert refused.value.body["param"] == "use_beam_search"  # type: ignore[index]
    assert named(refused.value.response) == ["foo"]


def test_a_custom_role_is_rendered_as_given(oai: openai.OpenAI) -> None:
    answer = oai.chat.completions.create(model=MODEL, messages=CUSTOM, max_tokens=1)
    assert answer.usage is not None
    prompt = chatml(("narrator", "Once upon a time"), ("user", "hi"))
    assert answer.usage.prompt_tokens == len(TOKENIZER.encode(prompt))


def test_the_messages_api_ignores_as_vllm_and_sglang_do(server: ServerProcess) -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}, "color": "red"}
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        raw = client.messages.with_raw_response.create(
            model=MODEL,
            max_tokens=2,
            messages=HI,
            tools=[tool],  # type: ignore[list-item]
            extra_body={"foo": 1},
        )
    assert raw.http_response.status_code == 200
    assert named(raw.http_response) == ["foo", "tools[0].color"]


# --- --reject-unknown-fields: as strict as before -------------------------------------------


def test_under_the_flag_unknown_fields_and_custom_roles_are_400s(
    strict: ServerProcess, strict_oai: openai.OpenAI
) -> None:
    with pytest.raises(openai.BadRequestError) as unknown:
        strict_oai.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=2, extra_body={"unknown_thing": 1}
        )
    assert unknown.value.body["param"] == "unknown_thing"  # type: ignore[index]
    assert "x-ignored-fields" not in unknown.value.response.headers
    with pytest.raises(openai.BadRequestError) as role:
        strict_oai.chat.completions.create(model=MODEL, messages=CUSTOM, max_tokens=1)
    assert role.value.body["param"] == "messages[0].role"  # type: ignore[index]
    with strict.client() as c:
        generate = c.post("/generate", json={"text": "a", "sampling_params": {"bar": 2}})
        message = c.post(
            "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HI, "foo": 1}
        )
    assert generate.status_code == 400 and "x-ignored-fields" not in generate.headers
    assert generate.json()["error"]["param"] == "sampling_params.bar"
    assert message.status_code == 400 and "`foo`" in message.json()["error"]["message"]
