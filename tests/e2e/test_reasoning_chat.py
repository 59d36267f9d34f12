"""Reasoning on /v1/chat/completions (``--reasoning-parser qwen3``) against a small checkpoint
whose tokenizer has ``<think>`` and ``</think>`` as single added tokens, as Qwen3's has, and a
template that closes an empty think block when ``chat_template_kwargs.enable_thinking`` is
false, as Qwen3's does (docs/api.md, "Tools and reasoning").

Its ``<tool_call>`` and ``</tool_call>`` are special tokens, as in Hermes 2 Pro's tokenizer:
an answer read for tool calls keeps special tokens in its text, or the parser would never
see them.

A random model never thinks by itself: a ``guided_regex`` spells the answer, and a bias on the
two tag tokens makes the model write each tag as its one token where the grammar allows it
(a masked token stays masked whatever its bias). Which tokens spell the rest is the model's
choice; the logprobs list them, so the test counts the tokens between the tags from them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.small_checkpoint import write
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, SHIPPED_VOCAB_SIZE
from tests.server_harness import ServerProcess

MODEL = "reasoner"
THINK, END_THINK = SHIPPED_VOCAB_SIZE, SHIPPED_VOCAB_SIZE + 1  # the added tokens' ids
TOOL_CALL = (
    SHIPPED_VOCAB_SIZE + 2
)  # <tool_call>, a special token here (as in Hermes 2 Pro's tokenizer)
TAGS = {str(THINK): 100, str(END_THINK): 100}
MESSAGES = [{"role": "user", "content": "Think, then answer."}]
# Qwen3's switch: with thinking off, the generation prompt holds an empty, closed think block.
QWEN3_SWITCH = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    directory = tmp_path_factory.mktemp("reasoner")
    write(
        directory / "model",
        layers=2,
        hidden=64,
        seed=3,
        added_tokens=("<think>", "</think>"),
        special_tokens=("<tool_call>", "</tool_call>"),
    )
    template = (DEFAULT_TOKENIZER_DIR / "chat_template.jinja").read_text()
    (directory / "model" / "chat_template.jinja").write_text(template + QWEN3_SWITCH)
    args = [
        "--model-path",
        str(directory / "model"),
        "--served-model-name",
        MODEL,
        "--reasoning-parser",
        "qwen3",
    ]
    srv = ServerProcess(directory / "tmp", args).wait_ready()
    try:
        with srv.client() as client:
            yield client
    finally:
        srv.stop()


def _body(pattern: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 0,
        "guided_regex": pattern,
        "logit_bias": TAGS,
        "logprobs": True,
        **extra,
    }


def _streamed(http: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """A stream's reasoning and content, each its deltas joined, and its usage chunk."""
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=stream) as response:
        assert response.status_code == 200, response.read()
        chunks = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")
        ]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    joined = {
        key: "".join(d.get(key, "") for d in deltas) for key in ("reasoning_content", "content")
    }
    return joined, chunks[-1]["usage"]


def _between_tags(logprobs: dict[str, Any]) -> int:
    tokens = [entry["token"] for entry in logprobs["content"]]
    assert tokens.count("<think>") <= 1 and tokens.count("</think>") == 1, tokens
    start = tokens.index("<think>") + 1 if "<think>" in tokens else 0
    return tokens.index("</think>") - start


@pytest.mark.parametrize(
    ("pattern", "reasoning", "content"),
    [
        pytest.param("<think>abc déf</think>answer", "abc déf", "answer", id="tagged"),
        pytest.param(
            "plan first</think>\nthen answer",
            "plan first",
            "\nthen answer",
            id="opened-by-the-template",
        ),
        pytest.param("<think></think>just this", None, "just this", id="empty"),
    ],
)
def test_reasoning_is_split_out_counted_from_the_ids_and_streamed_the_same(
    http: httpx.Client, pattern: str, reasoning: str | None, content: str
) -> None:
    answer = http.post("/v1/chat/completions", json=_body(pattern)).json()
    choice = answer["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"] == reasoning
    assert message["content"] == content and choice["finish_reason"] == "stop"
    usage = answer["usage"]
    expected = _between_tags(choice["logprobs"])
    assert usage["completion_tokens_details"]["reasoning_tokens"] == expected
    assert (expected > 0) == bool(reasoning)
    # Every generated token is a completion token, the tags and the EOS included.
    assert usage["completion_tokens"] == len(choice["logprobs"]["content"])

    streamed, stream_usage = _streamed(http, _body(pattern))
    assert streamed == {"reasoning_content": reasoning or "", "content": content}
    # (The stream's prompt was in the prefix cache: only its cached tokens differ.)
    assert {**stream_usage, "prompt_tokens_details": None} == {
        **usage,
        "prompt_tokens_details": None,
    }


def test_a_tool_call_inside_reasoning_is_reasoning(http: httpx.Client) -> None:
    block = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "now"}}]
    body = _body(f"<think>{re.escape(block)}</think>ok", tools=tools, max_tokens=80)
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == block
    assert choice["message"]["content"] == "ok" and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


def test_enable_thinking_false_reaches_the_template_and_leaves_the_text_as_content(
    http: httpx.Client,
) -> None:
    on = http.post("/v1/chat/completions", json=_body("<think>x</think>y")).json()
    off = http.post(
        "/v1/chat/completions",
        json=_body("<think>x</think>y", chat_template_kwargs={"enable_thinking": False}),
    ).json()
    # The template's empty think block: <think>, "\n\n", </think>, "\n\n".
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]
    message = off["choices"][0]["message"]
    assert message["content"] == "<think>x</think>y" and message["reasoning_content"] is None
    assert off["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_a_marker_that_is_a_special_token_stays_in_the_text_for_the_parser(
    http: httpx.Client,
) -> None:
    """The model writes ``<tool_call>`` as its one special token (a bias forces it; nothing
    can follow in one token, so the block is malformed and comes back as content). Under
    "auto" the marker reaches the parser; a request that asks to skip special tokens, and
    one without tools, lose it as special tokens are lost."""
    tools = [{"type": "function", "function": {"name": "now"}}]
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 1,
        "temperature": 0,
        "logit_bias": {str(TOOL_CALL): 100},
        "tools": tools,
    }
    kept = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert kept["message"]["content"] == "<tool_call>" and kept["finish_reason"] == "length", kept
    for other in (
        {**body, "skip_special_tokens": True},
        {k: v for k, v in body.items() if k != "tools"},
    ):
        skipped = http.post("/v1/chat/completions", json=other).json()["choices"][0]
        assert skipped["message"]["content"] == "" and skipped["finish_reason"] == "length", skipped


def test_the_responses_api_gives_a_reasoning_item_streamed_the_same(http: httpx.Client) -> None:
    """/v1/responses over the same parser: a reasoning item (``reasoning_text``), then the
    message; reasoning tokens as chat counts them; streamed as ``response.reasoning_text``
    deltas that add up to the same items."""
    pattern = "<think>abc déf</think>answer"
    body = {
        "model": MODEL,
        "input": "Think, then answer.",
        "max_output_tokens": 64,
        "temperature": 0,
        "logit_bias": TAGS,
    }
    body["structured_outputs"] = {"regex": pattern}
    whole = http.post("/v1/responses", json=body).json()
    assert whole["status"] == "completed", whole
    reasoning, message = whole["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": "abc déf"}
    ]
    assert message["type"] == "message" and message["content"][0]["text"] == "answer"
    chat = http.post("/v1/chat/completions", json=_body(pattern)).json()
    assert (
        whole["usage"]["output_tokens_details"]["reasoning_tokens"]
        == chat["usage"]["completion_tokens_details"]["reasoning_tokens"]
        > 0
    )
    assert whole["usage"]["output_tokens"] == chat["usage"]["completion_tokens"]

    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        events = [
            json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        == "abc déf"
    )
    assert (
        "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "answer"
    )
    final = events[-1]
    assert final["type"] == "response.completed"
    assert [item["type"] for item in final["response"]["output"]] == ["reasoning", "message"]
    assert (
        final["response"]["usage"]["output_tokens_details"]
        == whole["usage"]["output_tokens_details"]
    )
