"""Reasoning on /v1/chat/completions (``--reasoning-parser qwen3``) against a small checkpoint
whose tokenizer has ``<think>`` and ``</think>`` as single added tokens, as Qwen3's has, and a
template that closes an empty think block when ``chat_template_kwargs.enable_thinking`` is
false, as Qwen3's does (docs/api.md, "Tools and reasoning").

Its ``<tool_call>`` and ``</tool_call>`` are special tokens, as in Hermes 2 Pro's tokenizer:
an answer read for tool calls keeps special tokens in its text, or the parser would never
see them.

A random model never thinks by itself: a bias on ``</think>`` makes it close its reasoning
after a few free tokens (the seed decides how many), and a constraint (which applies from the
end of the reasoning) spells the answer. The logprobs list the tokens each part took.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.small_checkpoint import write
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, SHIPPED_VOCAB_SIZE
from tests.grammar_bias import STEADY
from tests.server_harness import ServerProcess

MODEL = "reasoner"
THINK, END_THINK = SHIPPED_VOCAB_SIZE, SHIPPED_VOCAB_SIZE + 1  # the added tokens' ids
TOOL_CALL = (
    SHIPPED_VOCAB_SIZE + 2
)  # <tool_call>, a special token here (as in Hermes 2 Pro's tokenizer)
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
    """A seeded answer that thinks a few tokens, then follows ``pattern``."""
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 64,
        "temperature": 1.0,
        "seed": THINKS[0],
        "guided_regex": pattern,
        "logit_bias": {str(END_THINK): THINKS[1]},
        "logprobs": True,
        **extra,
    }


# Seeds and biases on </think> under which the model thinks a few tokens; the second writes a
# broken UTF-8 sequence in its reasoning (shown as U+FFFD), which the count must see through.
THINKS = (2, 5)
THINKS_TOO = (0, 5)


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
        # reasoning_content is on every delta, null where the chunk has none (SGLang's).
        key: "".join(d.get(key) or "" for d in deltas)
        for key in ("reasoning_content", "content")
    }
    return joined, chunks[-1]["usage"]


def _between_tags(logprobs: dict[str, Any]) -> int:
    tokens = [entry["token"] for entry in logprobs["content"]]
    assert tokens.count("<think>") <= 1 and tokens.count("</think>") == 1, tokens
    start = tokens.index("<think>") + 1 if "<think>" in tokens else 0
    return tokens.index("</think>") - start


@pytest.mark.parametrize(
    ("seed", "bias"),
    [
        pytest.param(*THINKS, id="thinks-then-answers"),
        pytest.param(*THINKS_TOO, id="thinks-with-a-broken-character"),
        pytest.param(0, 100, id="empty"),
    ],
)
def test_reasoning_is_split_out_counted_from_the_ids_and_streamed_the_same(
    http: httpx.Client, seed: int, bias: int
) -> None:
    body = _body("answer", seed=seed, logit_bias={str(END_THINK): bias})
    answer = http.post("/v1/chat/completions", json=body).json()
    choice = answer["choices"][0]
    message = choice["message"]
    assert message["reasoning_content"] == message["reasoning"]
    # The grammar applied from the end of the reasoning, so the answer is the pattern.
    assert message["content"] == "answer" and choice["finish_reason"] == "stop"
    usage = answer["usage"]
    expected = _between_tags(choice["logprobs"])
    assert usage["completion_tokens_details"]["reasoning_tokens"] == expected
    assert (expected > 0) == bool(message["reasoning"]) == (bias < 100), message
    if (seed, bias) == THINKS_TOO:
        assert "\ufffd" in message["reasoning"], message  # the case this one is here for
    # Every generated token is a completion token, the tag and the EOS included.
    assert usage["completion_tokens"] == len(choice["logprobs"]["content"])

    streamed, stream_usage = _streamed(http, body)
    assert streamed == {"reasoning_content": message["reasoning"] or "", "content": "answer"}
    # (The stream's prompt was in the prefix cache: only its cached tokens differ.)
    assert {**stream_usage, "prompt_tokens_details": None} == {
        **usage,
        "prompt_tokens_details": None,
    }


YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def test_json_schema_tools_and_max_tokens_after_reasoning(http: httpx.Client) -> None:
    """Grammars after reasoning (issue: the JSON landed in reasoning_content): the answer
    under ``response_format`` is the JSON, the reasoning is the model's own text; a named tool
    call's arguments and ``required`` calls parse; ``max_tokens`` spent inside the reasoning
    ends with ``length`` and nothing breaks."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": YES_NO}}
    tools = [{"type": "function", "function": {"name": "vote", "parameters": YES_NO}}]
    base = {k: v for k, v in _body("").items() if k != "guided_regex"}
    base["logit_bias"] = {**STEADY, **base["logit_bias"]}  # no runs of whitespace in the JSON
    answer = http.post("/v1/chat/completions", json={**base, "response_format": schema_format})
    message = answer.json()["choices"][0]["message"]
    assert json.loads(message["content"])["answer"] in ("yes", "no"), message
    assert message["reasoning_content"], message
    named = {"type": "function", "function": {"name": "vote"}}
    for choice in (named, "required"):
        body = {**base, "tools": tools, "tool_choice": choice}
        reply = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        (call,) = reply["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"])["answer"] in ("yes", "no"), reply
        assert reply["message"]["reasoning_content"], reply
    never_closes = {**base, "logit_bias": {str(END_THINK): -100}, "max_tokens": 6}
    for extra in ({"response_format": schema_format}, {"tools": tools, "tool_choice": named}):
        cut = http.post("/v1/chat/completions", json={**never_closes, **extra})
        assert cut.status_code == 200, cut.text
        assert cut.json()["choices"][0]["finish_reason"] == "length", cut.text
        streamed, usage = _streamed(http, {**never_closes, **extra})
        assert usage["completion_tokens"] == 6


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
    body = {
        "model": MODEL,
        "input": MESSAGES[0]["content"],
        "max_output_tokens": 64,
        "temperature": 1.0,
        "seed": THINKS[0],
        "logit_bias": {str(END_THINK): THINKS[1]},
        "structured_outputs": {"regex": "answer"},
    }
    whole = http.post("/v1/responses", json=body).json()
    assert whole["status"] == "completed", whole
    reasoning, message = whole["output"]
    chat = http.post("/v1/chat/completions", json=_body("answer")).json()
    thought = chat["choices"][0]["message"]["reasoning_content"]
    assert thought
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [
        {"type": "reasoning_text", "text": thought}
    ]
    assert message["type"] == "message" and message["content"][0]["text"] == "answer"
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
        == thought
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
