"""Anthropic's Messages API (``/v1/messages``) through the official ``anthropic`` SDK,
against one server (docs/api.md, "The Anthropic Messages API"); Claude Code has its own
module (tests/e2e/test_claude_code.py).

The checkpoint is the small random one with ``<think>`` and ``</think>`` as single added
tokens, as Qwen3's tokenizer has them, served with ``--reasoning-parser qwen3``.
``--max-new-tokens-limit`` is set, to show a larger ``max_tokens`` capped to it. The SDK has
no ``temperature``; greedy answers pass it in ``extra_body``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.small_checkpoint import write
from pipeline.tokenizer_loader import SHIPPED_VOCAB_SIZE
from tests.grammar_bias import STEADY
from tests.server_harness import ServerProcess

MODEL = "claude-local"
KEY = "sk-local-test"
END_THINK = SHIPPED_VOCAB_SIZE + 1  # </think>, an added token
OUTPUT_LIMIT = 1100  # room for a thinking budget (1,024 at least) and its answer
GREEDY = {"temperature": 0}
NO_EOS = {"logit_bias": {"0": -100}}  # EOS (id 0) never drawn: a sampled answer runs its length
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("anthropic")
    write(
        directory / "model",
        layers=2,
        hidden=64,
        seed=3,
        added_tokens=("<think>", "</think>"),
    )
    args = [
        *("--model-path", str(directory / "model"), "--served-model-name", MODEL),
        *("--reasoning-parser", "qwen3", "--api-key", KEY),
        *("--max-new-tokens-limit", str(OUTPUT_LIMIT)),
    ]
    srv = ServerProcess(directory / "tmp", args).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0) as c:
        yield c


def _blocks(content: Any) -> list[dict[str, Any]]:
    """Content blocks as data (a stream's final message has the SDK's parsed block types,
    with a ``parsed_output`` of None for plain text)."""
    return [block.model_dump(exclude={"parsed_output"}) for block in content]


def _chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY}"}
    answer = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_text_answer_equals_chat(client: anthropic.Anthropic, server: ServerProcess) -> None:
    """A system prompt and a user turn run as the chat route's request for the same
    messages: the same greedy text and token counts; cut by max_tokens it says so."""
    message = client.messages.create(
        model=MODEL,
        max_tokens=12,
        system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": "Tell me a story."}],
        extra_body=GREEDY,
    )
    chat = _chat(
        server,
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story."},
        ],
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    [block] = message.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    assert usage.output_tokens == 12 == chat["usage"]["completion_tokens"]
    # The chat request came second: all but its last prompt token came from the cache.
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        chat["usage"]["prompt_tokens"] - 1
    )


def test_stop_sequence_ends_the_answer_where_it_matched(client: anthropic.Anthropic) -> None:
    messages: Any = [{"role": "user", "content": "Count for me."}]
    whole = client.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body=GREEDY)
    [block] = whole.content
    assert block.type == "text"
    text = block.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text
    cut = client.messages.create(
        model=MODEL, max_tokens=24, messages=messages, stop_sequences=[stop], extra_body=GREEDY
    )
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    [cut_block] = cut.content
    assert cut_block.type == "text" and cut_block.text == text[: text.index(stop)]


def test_stream_assembles_to_the_whole_answer(
    client: anthropic.Anthropic, server: ServerProcess
) -> None:
    """``messages.stream()``: the text stream and the final message equal the whole answer;
    the raw events are Anthropic's, in Anthropic's order, with a ping after the start."""
    request: Any = {
        "model": MODEL,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": "Hello there"}],
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert (
        _blocks(final.content) == _blocks(whole.content) and final.stop_reason == whole.stop_reason
    )
    [block] = whole.content
    assert block.type == "text" and text == block.text
    assert final.usage.output_tokens == whole.usage.output_tokens == 20

    body = {**request.pop("extra_body"), **request, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = list(response.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert datas[0]["message"]["usage"]["output_tokens"] == 0  # (no content yet)
    assert datas[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}


def test_forced_tool_round_trip(client: anthropic.Anthropic) -> None:
    """``tool_choice: {"type": "tool"}`` gives a ``tool_use`` block whose input follows the
    schema (constrained decoding), with ``stop_reason`` ``tool_use``; its result goes back as
    a ``tool_result`` and the next answer reads it (the prompt holds it)."""
    ask: Any = [{"role": "user", "content": "Weather in Oslo for 3 days?"}]
    first = client.messages.create(
        model=MODEL,
        max_tokens=OUTPUT_LIMIT,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"logit_bias": STEADY, "top_k": 20},
    )
    assert first.stop_reason == "tool_use", first
    calls = [b for b in first.content if b.type == "tool_use"]
    assert len(calls) == 1, first.content
    [call] = calls
    assert call.name == "get_weather" and set(call.input) == {"city", "days"}
    assert call.input["city"][0].isupper() and 1 <= call.input["days"] <= 7
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}
    turns: Any = [*ask, {"role": "assistant", "content": first.content}]
    turns.append({"role": "user", "content": [result]})
    second = client.messages.create(
        model=MODEL, max_tokens=8, messages=turns, tools=[WEATHER], extra_body=GREEDY
    )
    assert second.stop_reason in ("max_tokens", "end_turn", "tool_use")
    with_result = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    turns[-1]["content"] = [{**result, "content": "Sunny, 21 C, light wind from the west"}]
    longer = client.messages.count_tokens(model=MODEL, messages=turns, tools=[WEATHER])
    assert longer.input_tokens > with_result.input_tokens
    usage = second.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == with_result.input_tokens


def test_count_tokens_is_the_prompt_a_request_runs(client: anthropic.Anthropic) -> None:
    fields: Any = {
        "model": MODEL,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "A fresh question about counting"}],
    }
    counted = client.messages.count_tokens(**fields)
    answer = client.messages.create(max_tokens=2, **fields)
    assert counted.input_tokens == (
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    )
    assert answer.usage.cache_read_input_tokens < counted.input_tokens


def test_max_tokens_is_a_ceiling_and_zero_only_warms_the_cache(
    client: anthropic.Anthropic,
) -> None:
    """Anthropic's ``max_tokens`` is the most the answer may take: above what the server
    allows (``--max-new-tokens-limit`` here) the answer stops there. 0 computes the prompt
    (so the next request reads it from the cache) and answers nothing."""
    messages: Any = [{"role": "user", "content": "Warm the cache with this prompt, please."}]
    warm = client.messages.create(model=MODEL, max_tokens=0, messages=messages)
    assert warm.content == [] and warm.stop_reason == "max_tokens"
    assert warm.usage.output_tokens == 0
    # (The SDK streams a request that may run long: it refuses such a max_tokens unstreamed.)
    with client.messages.stream(
        model=MODEL, max_tokens=32000, messages=messages, extra_body=NO_EOS
    ) as stream:
        big = stream.get_final_message()
    assert big.usage.output_tokens == OUTPUT_LIMIT and big.stop_reason == "max_tokens"
    prompt = warm.usage.input_tokens + warm.usage.cache_read_input_tokens
    assert big.usage.cache_read_input_tokens == prompt - 1


def test_prefill_continues_the_last_assistant_turn(
    client: anthropic.Anthropic, server: ServerProcess
) -> None:
    turns: Any = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "The colour is"},
    ]
    message = client.messages.create(model=MODEL, max_tokens=6, messages=turns, extra_body=GREEDY)
    chat = _chat(
        server,
        model=MODEL,
        max_tokens=6,
        temperature=0,
        messages=turns,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    [block] = message.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]


def test_thinking_comes_first_and_streams_as_thinking_deltas(
    client: anthropic.Anthropic,
) -> None:
    """With the reasoning parser on, what the model writes before ``</think>`` is a thinking
    block ahead of the text (a bias makes the random model close it after a few tokens);
    streamed, it comes as ``thinking_delta`` and assembles to the same blocks."""
    request: Any = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "thinking": {"type": "adaptive"},
        "extra_body": {"temperature": 1.0, "top_k": 40, "seed": 9, "logit_bias": {END_THINK: 3}},
    }
    whole = client.messages.create(**request)
    kinds = [block.type for block in whole.content]
    assert kinds == ["thinking", "text"], whole.content
    with client.messages.stream(**request) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "thinking_delta" in deltas and "text_delta" in deltas
    assert _blocks(final.content) == _blocks(whole.content)
    off = client.messages.create(**{**request, "thinking": {"type": "disabled"}})
    assert [block.type for block in off.content] == ["text"], off.content


def test_errors_are_anthropic_errors(client: anthropic.Anthropic, server: ServerProcess) -> None:
    too_long: Any = [{"role": "user", "content": "word " * 3000}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=MODEL, max_tokens=4, messages=too_long)
    body = refused.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "context length" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(
            model="other", max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as stranger:
        with pytest.raises(anthropic.AuthenticationError) as denied:
            stranger.messages.create(
                model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}]
            )
    assert isinstance(denied.value.body, dict)
    assert denied.value.body["error"]["type"] == "authentication_error"
    headers = {"x-api-key": KEY}
    for body_fields, named in (
        ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools[0]",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [WEATHER],
                "tool_choice": {"type": "any"},
                "thinking": {"type": "adaptive"},
            },
            "tool_choice forces tool use",
        ),
    ):
        answer = httpx.post(
            f"{server.url}/v1/messages", json={"model": MODEL, **body_fields}, headers=headers
        )
        assert answer.status_code == 400, answer.text
        error = answer.json()
        assert error["type"] == "error" and named in error["error"]["message"], error


def _counted(server: ServerProcess, name: str) -> float:
    """A counter's sum over its labels, from /metrics."""
    metrics = httpx.get(f"{server.url}/metrics").text
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == name
    )


def test_a_message_is_counted_as_any_request_is(
    client: anthropic.Anthropic, server: ServerProcess
) -> None:
    names = ("tokenpipe:num_requests_total", "tokenpipe:generation_tokens_total")
    names += ("tokenpipe:prompt_tokens_total",)
    before = [_counted(server, name) for name in names]
    message = client.messages.create(
        model=MODEL,
        max_tokens=7,
        messages=[{"role": "user", "content": "Counted?"}],
        extra_body=NO_EOS,
    )
    after = [_counted(server, name) for name in names]
    prompt = message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert [b - a for a, b in zip(before, after)] == [1, 7, prompt]


def test_output_format_is_a_json_schema_constraint(client: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    message = client.messages.create(
        model=MODEL,
        max_tokens=OUTPUT_LIMIT,
        messages=[{"role": "user", "content": "Yes or no?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body={"logit_bias": STEADY},
    )
    [block] = message.content
    assert block.type == "text" and json.loads(block.text)["answer"] in ("yes", "no"), block
    assert message.stop_reason == "end_turn"


def test_a_thinking_budget_ends_the_thinking_and_the_answer_follows(
    client: anthropic.Anthropic,
) -> None:
    """A model that would think on (a bias keeps it from closing) is made to close its
    thinking once ``budget_tokens`` are spent: the end is forced, then the text follows."""
    budget, answer_tokens = 1024, 6
    request: Any = {
        "model": MODEL,
        "max_tokens": budget + 1 + answer_tokens,
        "messages": [{"role": "user", "content": "Think at length."}],
        "thinking": {"type": "enabled", "budget_tokens": budget},
        "extra_body": {"seed": 4, "logit_bias": {END_THINK: -100}},
    }
    whole = client.messages.create(**request)
    assert [block.type for block in whole.content] == ["thinking", "text"], whole.content
    assert whole.usage.output_tokens == budget + 1 + answer_tokens
    assert whole.stop_reason == "max_tokens"
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert _blocks(final.content) == _blocks(whole.content)
    # Without the budget it never closes, and qwen3's parser reads an unclosed answer that
    # did not open with <think> as all text.
    unbounded = client.messages.create(**{**request, "thinking": {"type": "adaptive"}})
    assert [block.type for block in unbounded.content] == ["text"], unbounded.content


def test_a_billing_header_that_changes_misses_no_cache(client: anthropic.Anthropic) -> None:
    """Claude Code's first system block carries a hash that changes per request; the server
    leaves it out, so the rest of the prompt is read from the prefix cache."""
    rest: Any = {"type": "text", "text": "You are a careful assistant who answers briefly."}
    messages: Any = [{"role": "user", "content": "A question that is asked twice."}]
    usages = []
    for nonce in ("1a2b3", "9f8e7"):
        header = f"x-anthropic-billing-header: cc_version=2.1.197.abc; cch={nonce};"
        system: Any = [{"type": "text", "text": header}, rest]
        answer = client.messages.create(model=MODEL, max_tokens=1, system=system, messages=messages)
        usages.append(answer.usage)
    prompt = usages[0].input_tokens + usages[0].cache_read_input_tokens
    assert usages[1].cache_read_input_tokens == prompt - 1


def test_an_abort_after_output_ends_the_stream_with_an_error_event(
    server: ServerProcess,
) -> None:
    """A message has no stop reason for an operator's abort: the stream that was running ends
    with Anthropic's ``error`` event, after the content it had sent."""
    body = {
        "model": MODEL,
        "max_tokens": OUTPUT_LIMIT,
        "stream": True,
        "messages": [{"role": "user", "content": "Go on and on."}],
        **NO_EOS,  # the answer runs until it is aborted
    }
    headers = {"x-api-key": KEY}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        with http.stream("POST", "/v1/messages", json=body) as response:
            assert response.status_code == 200
            events = []
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(json.loads(line[6:]))
                if events[-1]["type"] == "content_block_delta" and len(events) == 4:
                    rid = events[0]["message"]["id"] + "-0"
                    aborted = http.post("/abort_request", json={"rid": rid})
                    assert aborted.status_code == 200, aborted.text
    kinds = [event["type"] for event in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"], kinds
    assert kinds[-1] == "error" and "message_stop" not in kinds, kinds
    assert events[-1]["error"]["message"] == "aborted by /abort_request"
