"""A Messages API body read as the chat request it runs as (``MessagesRequest.chat``), and an
answer's deltas built into content blocks and stream events (``ContentBlocks``)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from pipeline.io_struct import FinishLength, FinishStop
from tokenizer_proc.anthropic.content import ContentBlocks, stop_reason_of, tool_input
from tokenizer_proc.anthropic.request import MessagesRequest
from tokenizer_proc.openai.chat_parsing import ChatDelta
from tokenizer_proc.parsers.tool_calls import ToolCallDelta
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError


def _request(**fields: Any) -> MessagesRequest:
    body = {"model": "m", "max_tokens": 8, **fields}
    request = decode_body(json.dumps(body).encode(), MessagesRequest)
    request.refuse_unsupported(None)  # strict: an unknown tool field is a 400
    return request


def _messages(**fields: Any) -> list[dict[str, Any]]:
    return _request(**fields).chat().template_messages()


def test_blocks_become_chat_messages_in_order() -> None:
    call = {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}
    messages = _messages(
        system=[{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": ""},
                    {"type": "text", "text": "let me"},
                    call,
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "9", "is_error": True},
                    {"type": "text", "text": "and?"},
                ],
            },
            {"role": "system", "content": "mid-conversation"},
        ],
    )
    assert [(m["role"], m["content"]) for m in messages] == [
        ("system", "A\nB"),
        ("user", "hi"),
        ("assistant", "let me"),
        ("tool", "Error: 9"),
        ("user", "and?"),
        ("system", "mid-conversation"),
    ]
    assistant = messages[2]
    assert assistant["reasoning_content"] == "hmm"
    [template_call] = assistant["tool_calls"]
    assert template_call["id"] == "t1" and template_call["function"]["arguments"] == {"x": 1}
    assert messages[3]["tool_call_id"] == "t1"


def test_consecutive_turns_of_a_role_are_one_and_a_last_assistant_turn_is_a_prefill() -> None:
    request = _request(
        messages=[
            {"role": "user", "content": "one"},
            {"role": "user", "content": [{"type": "text", "text": "two"}]},
            {"role": "assistant", "content": "The answer is"},
        ]
    )
    chat = request.chat()
    assert [(m["role"], m["content"]) for m in chat.template_messages()] == [
        ("user", "one\ntwo"),
        ("assistant", "The answer is"),
    ]
    assert chat.continue_final_message and chat.add_generation_prompt is False


def test_clear_thinking_keeps_the_latest_turns_thinking() -> None:
    def turn(n: int) -> dict[str, Any]:
        thinking = {"type": "thinking", "thinking": f"t{n}", "signature": ""}
        return {"role": "assistant", "content": [thinking, {"type": "text", "text": f"a{n}"}]}

    conversation = [
        {"role": "user", "content": "q1"},
        turn(1),
        {"role": "user", "content": "q2"},
        turn(2),
        {"role": "user", "content": "q3"},
    ]
    keep_one = {"edits": [{"type": "clear_thinking_20251015"}]}
    kept = _messages(messages=conversation, context_management=keep_one)
    assert [m.get("reasoning_content") for m in kept if m["role"] == "assistant"] == [None, "t2"]
    keep_all = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    every = _messages(messages=conversation, context_management=keep_all)
    assert [m.get("reasoning_content") for m in every if m["role"] == "assistant"] == ["t1", "t2"]


def test_fields_map_onto_chats() -> None:
    tool = {"name": "f", "description": "d", "input_schema": {"type": "object"}}
    chat = _request(
        messages=[{"role": "user", "content": "x"}],
        stop_sequences=["END"],
        top_k=0,
        tools=[tool],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=2000,
        output_config={"effort": "low"},
    ).chat()
    assert chat.stop == ["END"] and chat.top_k is None and chat.max_tokens == 2000
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    [chat_tool] = chat.tools or []
    assert chat_tool.function.parameters == {"type": "object"}
    assert chat.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    thinking = _request(
        messages=[{"role": "user", "content": "x"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        max_tokens=2000,
        tools=[tool],
        tool_choice={"type": "auto"},
    ).chat()
    assert thinking.chat_template_kwargs == {"enable_thinking": True}
    assert thinking.tool_choice == "auto" and thinking.parallel_tool_calls is None
    # No thinking asked: none, as Anthropic's models do not think unless asked.
    plain = _request(messages=[{"role": "user", "content": "x"}]).chat()
    assert plain.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "f", "input_schema": {}, "defer_loading": True}]}, "defer_loading"),
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "edits[0]"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "budget_tokens"),
        ({"container": "c1"}, "container"),
        ({"temperature": 1.5}, "temperature"),
        ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ],
)
def test_what_the_server_cannot_do_is_a_400_naming_the_field(
    fields: dict[str, Any], named: str
) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1024, **fields}
    with pytest.raises(RequestValidationError) as refused:
        _request(**body).chat()
    assert named in str(refused.value)


def test_chat_errors_name_the_anthropic_fields() -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    request = _request(messages=[{"role": "user", "content": "x"}], tools=[tool, tool])
    with pytest.raises(RequestValidationError) as refused:
        request.chat().tool_plan()
    # (The chat side's tool check speaks chat's names; the route renames them on the way out.)
    assert "tools[1].function.name" in str(refused.value)


def _delta(
    reasoning: str = "", content: str = "", calls: tuple[ToolCallDelta, ...] = ()
) -> ChatDelta:
    return ChatDelta(reasoning, content, calls)


def test_one_block_open_at_a_time_in_the_order_the_answer_wrote_them() -> None:
    blocks = ContentBlocks()
    events = blocks.add(_delta(reasoning="think "))
    events += blocks.add(_delta(reasoning="more", content="Hi"))
    events += blocks.add(_delta(calls=(ToolCallDelta(0, "c0", "f", '{"a": '),)))
    events += blocks.add(_delta(calls=(ToolCallDelta(0, None, None, "1}"),), content=""))
    events += blocks.add(_delta(content=" after"))
    events += blocks.close()
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("content_block_start", 3),
        ("content_block_delta", 3),
        ("content_block_stop", 3),
    ]
    assert blocks.blocks == [
        {"type": "thinking", "thinking": "think more", "signature": ""},
        {"type": "text", "text": "Hi"},
        {"type": "tool_use", "id": "c0", "name": "f", "input": {"a": 1}},
        {"type": "text", "text": " after"},
    ]
    assert events[8]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": '}


def test_a_cut_tool_input_keeps_what_was_written() -> None:
    assert tool_input('{"city": "Os') == {"city": "Os"}
    assert tool_input("") == {} and tool_input("[1]") == {}


def test_stop_reasons() -> None:
    assert stop_reason_of(FinishLength(5), called=True) == ("max_tokens", None)
    assert stop_reason_of(FinishStop(0), called=True) == ("tool_use", None)
    assert stop_reason_of(FinishStop("END"), called=False) == ("stop_sequence", "END")
    assert stop_reason_of(FinishStop(0), called=False) == ("end_turn", None)


def test_an_unknown_block_type_is_refused_by_the_decoder() -> None:
    body = {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "x"}]}],
    }
    with pytest.raises(RequestValidationError):
        decode_body(msgspec.json.encode(body), MessagesRequest)


def test_claude_codes_billing_header_is_not_in_the_prompt() -> None:
    """Its hash changes on every request: at the head of the prompt, no prefix would match."""
    header = "x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=cli; cch=1f2e3;"
    blocks = [{"type": "text", "text": header}, {"type": "text", "text": "You are terse."}]
    messages = [{"role": "user", "content": "hi"}]
    assert _messages(system=blocks, messages=messages)[0] == {
        "role": "system",
        "content": "You are terse.",
    }
    as_text = _messages(system=header + "\nYou are terse.", messages=messages)
    assert as_text[0]["content"] == "You are terse."
    only = _messages(system=[blocks[0]], messages=messages)
    assert [m["role"] for m in only] == ["user"]
