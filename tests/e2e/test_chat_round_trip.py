"""A conversation goes on from the server's own answers, and ``/tokenize`` gives the ids a chat
request runs (docs/api.md, "Tools and reasoning", the tokenizer endpoints and "The Responses
API"). The checkpoint has ``<think>`` and ``</think>`` as single tokens; the server runs
``--reasoning-parser qwen3`` and a template that shows an assistant turn's
``reasoning_content`` in a think block and closes an empty one in the generation prompt when
``enable_thinking`` is false, as Qwen3's does.

A random model thinks only where made to: a bias on ``Z`` and on ``</think>`` has it write
Zs until it closes its reasoning (seeded: the same Zs every run), and the grammar, which
applies after the reasoning, spells a call of ``now``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from bench.small_checkpoint import write
from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, SHIPPED_VOCAB_SIZE
from tests.server_harness import ServerProcess

MODEL = "round-trip"
END_THINK = SHIPPED_VOCAB_SIZE + 1  # the second added token
Z = 63  # "Z" in the shipped vocabulary
SEED = 7  # with this seed the model writes ZZZZ before it closes its reasoning
USER: Any = {"role": "user", "content": "What time is it?"}
NOW = {"name": "now", "parameters": {"type": "object", "properties": {}}}
TOOLS: Any = [{"type": "function", "function": NOW}]
CALL_BLOCK = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
CALL = {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}}
RESULT = {"role": "tool", "tool_call_id": "c1", "content": "12:00"}

_CONTENT = "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
_REASONING = (
    "{%- if message['reasoning_content'] is defined and message['reasoning_content'] is not none"
    " %}{{- '<|im_start|>' + message['role'] + '\\n<think>\\n' + message['reasoning_content']"
    " + '\\n</think>\\n\\n' + message['content'] }}{%- else %}" + _CONTENT + "{%- endif %}"
)
QWEN3_SWITCH = (
    "{%- if add_generation_prompt and enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("round-trip")
    write(directory / "model", layers=2, hidden=64, seed=3, added_tokens=("<think>", "</think>"))
    template = (DEFAULT_TOKENIZER_DIR / "chat_template.jinja").read_text()
    assert _CONTENT in template, "the shipped template no longer renders content this way"
    template = template.replace(_CONTENT, _REASONING) + QWEN3_SWITCH
    (directory / "model" / "chat_template.jinja").write_text(template)
    args = ["--model-path", str(directory / "model"), "--served-model-name", MODEL]
    srv = ServerProcess(directory / "tmp", [*args, "--reasoning-parser", "qwen3"]).wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return server.openai_client()


def _tokens(http: httpx.Client, **fields: Any) -> list[int]:
    response = http.post("/tokenize", json={"model": MODEL, **fields})
    assert response.status_code == 200, response.text
    tokens: list[int] = response.json()["tokens"]
    return tokens


def test_an_answer_with_reasoning_and_a_call_goes_back_into_the_conversation(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    """The assistant message as the official client returns it (``reasoning_content``,
    ``reasoning``, ``tool_calls``, ``content`` null), appended to the history, is taken (as
    vLLM takes it), dumped with its nulls too, and with either name of the reasoning alone;
    the reasoning reaches the template, which shows it."""
    first = oai.chat.completions.create(
        model=MODEL,
        messages=[USER],
        tools=TOOLS,
        max_tokens=64,
        temperature=1.0,
        seed=SEED,
        extra_body={
            "guided_regex": re.escape(CALL_BLOCK),
            "logit_bias": {str(Z): 100, str(END_THINK): 100},
        },
    )
    message = first.choices[0].message
    reasoning = (message.model_extra or {}).get("reasoning_content")
    assert reasoning and message.content is None and len(message.tool_calls or []) == 1, message
    assert message.tool_calls is not None
    answer = message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "12:00"}
    sent_back: list[Any] = [
        answer,
        message.model_dump(),  # refusal, annotations, audio, function_call: null
        {k: v for k, v in answer.items() if k != "reasoning_content"},
        {k: v for k, v in answer.items() if k != "reasoning"},
    ]
    prompts = []
    for sent in sent_back:
        again = oai.chat.completions.create(
            model=MODEL,
            messages=[USER, sent, result],  # type: ignore[list-item]
            tools=TOOLS,
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        prompts.append((again.model_extra or {})["prompt_token_ids"])
    assert all(prompt == prompts[0] for prompt in prompts)
    text = http.post("/detokenize", json={"tokens": prompts[0]}).json()["prompt"]
    assert f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n<tool_call>" in text, text
    # Reasoning belongs to assistant turns only.
    body = {"model": MODEL, "messages": [{**USER, "reasoning": "x"}], "max_tokens": 1}
    refused = http.post("/v1/chat/completions", json=body)
    assert (
        refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].reasoning"
    )


TOKENIZE_CASES: dict[str, dict[str, Any]] = {
    "tools-history-thinking-off": {
        "messages": [USER, {"role": "assistant", "content": None, "reasoning": "ZZ"}, USER],
        "tools": TOOLS,
        "chat_template_kwargs": {"enable_thinking": False},
    },
    "tool-results": {
        "messages": [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, RESULT],
        "tools": TOOLS,
    },
    "continue-final-message": {
        "messages": [USER, {"role": "assistant", "content": "It is"}],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
}


@pytest.mark.parametrize("fields", TOKENIZE_CASES.values(), ids=list(TOKENIZE_CASES))
def test_tokenize_gives_the_ids_the_same_chat_request_runs(
    http: httpx.Client, fields: dict[str, Any]
) -> None:
    """vLLM's ``tools``, ``chat_template_kwargs``, ``continue_final_message`` and
    ``add_generation_prompt`` on ``/tokenize``: the ids are the prompt the chat request with
    the same fields ran (its ``prompt_token_ids``), and the fields change them."""
    tokens = _tokens(http, **fields)
    chat = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, **fields, "max_tokens": 1, "return_token_ids": True},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["prompt_token_ids"] == tokens
    assert tokens != _tokens(http, messages=fields["messages"])


BAD_TOOL: Any = [{"type": "function", "function": {"name": "a b"}}]
TOKENIZE_REFUSALS: dict[str, tuple[dict[str, Any], str]] = {
    "prompt-tools": ({"prompt": "hi", "tools": TOOLS}, "tools"),
    "prompt-kwargs": ({"prompt": "hi", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    "generation-prompt": (  # only both sent true: one alone is no generation prompt
        {"messages": [USER], "continue_final_message": True, "add_generation_prompt": True},
        "continue_final_message",
    ),
    "tool-name": ({"messages": [USER], "tools": BAD_TOOL}, "tools[0].function.name"),
    "template": ({"messages": [USER], "chat_template": "{{ messages }}"}, "chat_template"),
}


@pytest.mark.parametrize(
    ("fields", "param"), TOKENIZE_REFUSALS.values(), ids=list(TOKENIZE_REFUSALS)
)
def test_tokenize_refuses_what_the_chat_route_refuses_by_name(
    http: httpx.Client, fields: dict[str, Any], param: str
) -> None:
    response = http.post("/tokenize", json={"model": MODEL, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_responses_reasoning_item_is_the_reasoning_of_the_turn_after_it(
    http: httpx.Client,
) -> None:
    """Sent back to ``/v1/responses``, a reasoning item and the call after it are one assistant
    turn with that reasoning, as the chat route renders it (the same prompt as ``/tokenize``
    of those chat messages); without the item, the turn has none."""
    call = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"}
    thought = [{"type": "reasoning_text", "text": "ZZ"}]
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": thought}
    output = {"type": "function_call_output", "call_id": "c1", "output": "12:00"}
    body = {"model": MODEL, "tools": [{"type": "function", **NOW}], "max_output_tokens": 1}
    used = {}
    conversations = {"with": [USER, reasoning, call, output], "without": [USER, call, output]}
    for name, items in conversations.items():
        response = http.post("/v1/responses", json={**body, "input": items, "store": False})
        assert response.status_code == 200, response.text
        used[name] = response.json()["usage"]["input_tokens"]
    turn = {"role": "assistant", "content": None, "tool_calls": [CALL]}
    chat = {
        "with": _tokens(http, messages=[USER, {**turn, "reasoning": "ZZ"}, RESULT], tools=TOOLS),
        "without": _tokens(http, messages=[USER, turn, RESULT], tools=TOOLS),
    }
    assert used == {name: len(tokens) for name, tokens in chat.items()}
    assert used["with"] > used["without"]
