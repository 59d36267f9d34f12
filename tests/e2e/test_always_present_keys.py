"""Keys that clients read as attributes are always there (docs/api.md, "Keys that are always
there"): each key vLLM or SGLang always sends on a completions or chat object, null when it
has no value. Read with the official openai client as its users read them: as attributes
(the client keeps keys it does not type as pydantic extras, so a missing one is an
``AttributeError``), and for keys it does type, as keys it was given (``model_fields_set``).
Against the shared server; ``tools`` makes the chat answers go through the tool parser's path.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from pydantic import BaseModel

MODEL = "tokenpipe-tiny"
MESSAGES: list[Any] = [{"role": "user", "content": "Hi"}]
# Greedy and 3 tokens: a length finish, and too short for a whole tool call.
SHORT: dict[str, Any] = {"max_tokens": 3, "temperature": 0}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
    }
]
READ_FOR_CALLS = [{}, {"tools": TOOLS}]


def given(obj: BaseModel, *keys: str) -> bool:
    """Whether the answer had each key (a typed field the client fills with None either way)."""
    return set(keys) <= obj.model_fields_set | set(obj.model_extra or {})


@pytest.mark.parametrize("tools", READ_FOR_CALLS, ids=["plain", "tools"])
def test_a_whole_chat_answer_has_every_key_either_peer_always_sends(
    oai: openai.OpenAI, tools: dict[str, Any]
) -> None:
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, **SHORT, **tools)
    choice = chat.choices[0]
    message: Any = choice.message
    # SGLang's ChatMessage; vLLM's (reasoning_content before its rename to reasoning).
    assert message.reasoning_content is None and message.reasoning is None
    assert message.tool_calls is None and given(message, "tool_calls")
    assert given(message, "refusal", "annotations", "audio", "function_call")
    assert choice.finish_reason == "length"
    extras: Any = choice
    assert extras.token_ids is None and extras.routed_experts is None
    assert extras.matched_stop is None and extras.stop_reason is None
    top: Any = chat
    assert top.prompt_token_ids is None and top.prompt_text is None
    assert top.prompt_logprobs is None
    assert top.kv_transfer_params is None and top.ec_transfer_params is None
    assert top.metrics is None and given(chat, "service_tier", "system_fingerprint")
    assert chat.metadata == {"weight_version": "default"}  # SGLang's
    # The answer goes back into the conversation as the client holds it, null keys and all.
    turn: Any = [*MESSAGES, message, {"role": "user", "content": "More"}]
    again: Any = oai.chat.completions.create(model=MODEL, messages=turn, **SHORT, **tools)
    assert again.choices[0].message.reasoning_content is None


@pytest.mark.parametrize("tools", READ_FOR_CALLS, ids=["plain", "tools"])
def test_every_chat_chunk_has_every_key_either_peer_always_sends(
    oai: openai.OpenAI, tools: dict[str, Any]
) -> None:
    stream = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **SHORT, **tools
    )
    first, *rest = list(stream)
    opening: Any = first
    assert first.choices[0].delta.role == "assistant"
    assert opening.prompt_token_ids is None and opening.prompt_text is None  # vLLM's
    assert rest and rest[-1].choices[0].finish_reason == "length"
    for chunk in [first, *rest]:
        choice: Any = chunk.choices[0]
        assert choice.delta.reasoning_content is None  # SGLang's, on every delta
        assert choice.matched_stop is None  # SGLang's, on every chunk (null: a length finish)
    # vLLM's, on every chunk after the role chunk.
    assert all(getattr(chunk.choices[0], "token_ids", "missing") is None for chunk in rest)


def test_completions_whole_and_streamed_have_every_key_either_peer_always_sends(
    oai: openai.OpenAI,
) -> None:
    whole: Any = oai.completions.create(model=MODEL, prompt="Hello", **SHORT)
    choice = whole.choices[0]
    assert choice.token_ids is None and choice.prompt_token_ids is None  # vLLM's
    assert choice.routed_experts is None and choice.prompt_logprobs is None
    assert choice.matched_stop is None  # SGLang's
    assert whole.service_tier is None and given(whole, "system_fingerprint")
    assert whole.kv_transfer_params is None and whole.ec_transfer_params is None
    assert whole.metrics is None and whole.metadata == {"weight_version": "default"}
    chunks = list(oai.completions.create(model=MODEL, prompt="Hello", stream=True, **SHORT))
    assert len(chunks) == 3 and chunks[-1].choices[0].finish_reason == "length"
    for chunk in chunks:
        assert chunk.usage is None and given(chunk, "usage")  # SGLang's, on every chunk
        streamed: Any = chunk.choices[0]
        assert streamed.prompt_token_ids is None and streamed.token_ids is None  # vLLM's
        assert streamed.matched_stop is None  # SGLang's
