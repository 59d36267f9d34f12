"""Tool calling on /v1/chat/completions against the shared server and the built-in random
model, through the real clients: the official client's ``create`` and ``stream``, the OpenAI
Agents SDK, langchain-openai's ``bind_tools`` and pydantic-ai (docs/api.md, "Tools and
reasoning").

A random model never writes a call by itself, so the calls here come from constrained decoding:
``tool_choice`` "required" (an array of calls) or a named function (its arguments), where the
grammar allows only calls whose arguments follow the tool's schema; under "auto" a
``guided_regex`` writes a Hermes ``<tool_call>`` block, which the server's parser reads. The
schemas are bounded and ``tests.grammar_bias.STEADY`` biases whitespace away, so every call
ends within ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Annotated, Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from bench.small_checkpoint import write
from tests.grammar_bias import STEADY, TOKENIZER
from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
MAX_TOKENS = 200
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "days", "unit"],
}
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _valid_weather(arguments: str) -> bool:
    value = json.loads(arguments)
    return (
        set(value) == {"city", "days", "unit"}
        and re.fullmatch("[A-Z][a-z]{1,8}", value["city"]) is not None
        and type(value["days"]) is int
        and 1 <= value["days"] <= 7
        and value["unit"] in ("c", "f")
    )


def _valid_call(name: str, arguments: str) -> bool:
    return (
        _valid_weather(arguments)
        if name == "get_weather"
        else name == "get_time" and json.loads(arguments) == {}
    )


def _calls(message: Any) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def _favouring(text: str) -> dict[str, int]:
    """A bias towards the tokens that spell the start of ``text`` (a tool's name, where the
    grammar lets the model pick among names)."""
    return {
        str(i): 30
        for i in range(TOKENIZER.vocab_size)
        if (piece := TOKENIZER.decode([i]).lstrip('"')) and text.startswith(piece)
    }


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_are_valid_and_streamed_as_whole(oai: openai.OpenAI, parallel: bool) -> None:
    """``tool_choice: "required"``: every choice calls (one call with ``parallel_tool_calls``
    false), each call's arguments follow its tool's schema, ``finish_reason`` is
    ``tool_calls``, and ``chat.completions.stream`` assembles the same calls."""
    seen = set()
    for seed in range(4):
        # Half the seeds favour the tokens of "weather" where the grammar picks a name: a
        # random model left alone may pick the same tool every time.
        bias = {**STEADY, **_favouring("weather")} if seed % 2 else dict(STEADY)
        if parallel:  # where a call ends, "]" ends the array (else a random model calls on and on)
            bias.update(
                {str(i): 20 for i in range(TOKENIZER.vocab_size) if "]" in TOKENIZER.decode([i])}
            )
        kwargs: Any = dict(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
            logit_bias=bias,
        )
        whole = oai.chat.completions.create(**kwargs).choices[0]
        assert whole.finish_reason == "tool_calls", whole
        calls = _calls(whole.message)
        assert calls and all(_valid_call(name, args) for name, args in calls), calls
        if not parallel:
            assert len(calls) == 1
        assert whole.message.content is None
        assert all(call.id.startswith("call_") for call in whole.message.tool_calls or [])
        with oai.chat.completions.stream(**kwargs) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert _calls(streamed.message) == calls and streamed.finish_reason == "tool_calls"
        seen.add(json.dumps(calls))
    assert len(seen) > 1, "every seed made the same calls: the test shows little"


def test_a_named_function_is_called_with_valid_arguments_streamed_or_not(
    oai: openai.OpenAI,
) -> None:
    tool_choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: Any = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=tool_choice,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        logit_bias=STEADY,
    )
    for seed in range(3):
        whole = oai.chat.completions.create(**kwargs, seed=seed).choices[0]
        [(name, arguments)] = _calls(whole.message)
        assert name == "get_weather" and _valid_weather(arguments), arguments
        assert whole.finish_reason == "stop"  # OpenAI's, for a call the client named
        with oai.chat.completions.stream(**kwargs, seed=seed) as stream:
            streamed = stream.get_final_completion().choices[0]
        assert _calls(streamed.message) == [(name, arguments)]


def _sse_chunks(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [
            line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")
        ]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_auto_reads_a_hermes_block_and_streams_openai_deltas(http: httpx.Client) -> None:
    """Under "auto" the hermes parser reads the block the regex makes the model write: text
    before it is content, the call is a call. Streamed, the first delta of the call carries
    its index, id, type and name, later ones argument text, and they add up to the whole."""
    block = (
        '<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Oslo", "days": 2, "unit": "c"}}\n</tool_call>'
    )
    pattern = "Sure[.] " + re.escape(block)
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 120,
        "guided_regex": pattern,
        "temperature": 0,
    }
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == "Sure. "
    [call] = whole["message"]["tool_calls"]
    assert call["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo", "days": 2, "unit": "c"}',
    }

    chunks = _sse_chunks(http, body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    call_deltas = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    first, rest = call_deltas[0], call_deltas[1:]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"]["name"] == "get_weather"
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest
    )
    assert "".join(d["function"]["arguments"] for d in call_deltas) == call["function"]["arguments"]
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_and_no_calls_leave_the_text_as_content(oai: openai.OpenAI) -> None:
    for tool_choice in ("none", "auto"):
        out = oai.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=8,
            extra_body={"guided_regex": "[a-z]{3,6}"},
        ).choices[0]
        assert out.message.tool_calls is None and re.fullmatch(
            "[a-z]{3,6}", out.message.content or ""
        ), out
        assert out.finish_reason == "stop"


BAD = [
    pytest.param(
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "not in tools",
        id="unknown",
    ),
    pytest.param(
        {"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools", id="no-tools"
    ),
    pytest.param({"tools": []}, "tools", "at least one", id="empty"),
    pytest.param({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "twice", id="twice"),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        "tools[0].function.name",
        "letters, digits",
        id="name",
    ),
    pytest.param(
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools[0].function.parameters",
        "object",
        id="not-an-object",
    ),
    pytest.param(
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
                    },
                }
            ]
        },
        "tools",
        "nonsense",
        id="bad-schema",
    ),
    pytest.param(
        {"response_format": {"type": "json_object"}},
        "tools",
        "already gives one",
        id="two-constraints",
    ),
]


@pytest.mark.parametrize(("extra", "param", "reason"), BAD)
def test_bad_tools_are_a_400_naming_the_field(
    http: httpx.Client, extra: dict[str, Any], param: str, reason: str
) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 8,
        **extra,
    }
    body = {k: v for k, v in body.items() if v is not None}
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json={**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and reason in error["message"], error
    assert (
        http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}
        ).status_code
        == 200
    )


def _tool_series(http: httpx.Client) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name in ("tokenpipe:tool_requests_total", "tokenpipe:tool_calls_total"):
                out[(sample.name, sample.labels.get("finish_reason", ""))] = sample.value
    return out


def test_metrics_count_tool_answers_by_finish_reason_and_their_calls(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    before = _tool_series(http)
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        max_tokens=MAX_TOKENS,
        logit_bias=STEADY,
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=MAX_TOKENS
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=3, extra_body={"ignore_eos": True}
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3
    )  # no tools: not counted
    after = _tool_series(http)

    def delta(name: str, label: str = "") -> float:
        return after.get((name, label), 0.0) - before.get((name, label), 0.0)

    assert delta("tokenpipe:tool_requests_total", "tool_calls") == 3
    assert delta("tokenpipe:tool_requests_total", "stop") == 1
    assert delta("tokenpipe:tool_requests_total", "length") == 1
    assert delta("tokenpipe:tool_calls_total") == 4


# --- agent frameworks --------------------------------------------------------------------------


def test_openai_agents_sdk_runs_a_tool_then_answers(server: ServerProcess) -> None:
    """The Agents SDK's chat-completions model: the first turn must call (tool_choice
    "required"), the SDK runs the Python function with arguments that validate against its
    signature, sends the result back, and the next turn (tool_choice reset to auto) ends the
    run with a final answer."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    called: list[tuple[str, int]] = []

    # Bounded, as the schema of a tool for a random model must be: an unbounded string would
    # run until max_tokens cuts the call.
    @function_tool
    def get_weather(
        city: Annotated[str, Field(pattern="^[A-Z][a-z]{1,8}$")],
        days: Annotated[int, Field(ge=1, le=7)],
    ) -> str:
        """The weather in a city for the next days."""
        called.append((city, days))
        return f"sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    settings = ModelSettings(
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        extra_body={"logit_bias": STEADY, "seed": 3},
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=settings,
    )
    result = asyncio.run(Runner.run(agent, "Weather in Oslo?", max_turns=4))
    assert len(called) == 1 and isinstance(called[0][0], str) and isinstance(called[0][1], int), (
        called,
        result.new_items,
    )
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [item.output for item in outputs] == [f"sunny in {called[0][0]} for {called[0][1]} days"]
    assert isinstance(result.final_output, str)


def test_langchain_bind_tools_gives_valid_calls_and_streamed_chunks_merge_to_them(
    server: ServerProcess,
) -> None:
    from langchain_core.messages import AIMessageChunk
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key="unused",
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=4,
        logit_bias=STEADY,
    )
    bound = llm.bind_tools([TOOLS[0]], tool_choice="get_weather")
    whole = bound.invoke("Weather in Oslo?")
    [call] = whole.tool_calls
    assert call["name"] == "get_weather" and _valid_weather(json.dumps(call["args"])), call
    merged: AIMessageChunk | None = None
    for chunk in bound.stream("Weather in Oslo?"):
        merged = chunk if merged is None else merged + chunk
    assert merged is not None
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]


def test_pydantic_ai_agent_calls_its_tool_then_returns_a_validated_output(
    server: ServerProcess,
) -> None:
    """pydantic-ai's agent over the OpenAI chat model, with a tool and a structured output
    (which pydantic-ai asks for as a ``final_result`` tool with ``tool_choice`` "required"):
    the first turn calls ``get_time`` (the bias favours its name where the grammar lets the
    model pick), pydantic-ai validates the arguments against the function's signature and
    runs it; the tool then leaves the list (its ``prepare``), so the next turn's only choice is
    ``final_result``, whose arguments pydantic-ai validates into the output model."""
    from pydantic import BaseModel
    from pydantic_ai import Agent, RunContext
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.tools import ToolDefinition

    class TimeAnswer(BaseModel):
        zone: str = Field(max_length=12)
        hour: int = Field(ge=0, le=23)

    model = OpenAIChatModel(
        MODEL, provider=OpenAIProvider(base_url=f"{server.url}/v1", api_key="unused")
    )
    agent = Agent(model, instructions="Tell the time.", output_type=TimeAnswer)
    called: list[str] = []

    async def once(ctx: RunContext[None], tool: ToolDefinition) -> ToolDefinition | None:
        return None if called else tool

    @agent.tool_plain(prepare=once)
    def get_time(zone: str) -> str:
        """The time in a time zone."""
        called.append(zone)
        return f"noon in {zone}"

    bias = {**STEADY, **_favouring("get_time")}
    # One call per turn: with parallel calls the first turn may call get_time twice. Seeded, so
    # each turn's draw is the same on every run.
    settings = {
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "logit_bias": bias,
        "parallel_tool_calls": False,
        "seed": 7,
    }
    result = agent.run_sync("What time is it?", model_settings=settings)  # type: ignore[arg-type]
    assert len(called) == 1 and isinstance(called[0], str), called
    assert isinstance(result.output, TimeAnswer)


# --- answers a user must get (issue 40) --------------------------------------------------------


def test_a_required_answer_cut_by_max_tokens_is_the_text_the_model_wrote(
    oai: openai.OpenAI,
) -> None:
    """``tool_choice: "required"`` cut before its first call is whole: ``length``, no call,
    and the content is exactly the tokens the model wrote (its logprobs spell them), streamed
    as whole, with no ``[TOOL_CALLS]`` the model never wrote."""
    for max_tokens in (2, 5):
        kwargs: Any = dict(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=max_tokens,
            temperature=0,
            logit_bias=STEADY,
        )
        whole = oai.chat.completions.create(**kwargs, logprobs=True).choices[0]
        assert whole.finish_reason == "length" and whole.message.tool_calls is None, whole
        assert whole.logprobs is not None and whole.logprobs.content is not None
        written = b"".join(bytes(t.bytes or []) for t in whole.logprobs.content).decode()
        assert whole.message.content == written and written.startswith("["), written
        stream = oai.chat.completions.create(**kwargs, stream=True)
        chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
        assert "".join(c.delta.content or "" for c in chunks) == written
        assert chunks[-1].finish_reason == "length"


TWO_BLOCKS = (
    'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, '
    '"unit": "c"}}\n</tool_call> and <tool_call>\n{"name": "get_time", "arguments": {}}\n'
    "</tool_call> done."
)


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(oai: openai.OpenAI) -> None:
    """A regex makes the model write two Hermes calls: by default both are calls; with
    ``parallel_tool_calls`` false only the first, the second dropped with its text (as
    vLLM), and the stream assembles exactly the whole answer."""
    kwargs: Any = dict(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"guided_regex": re.escape(TWO_BLOCKS)},
    )
    both = oai.chat.completions.create(**kwargs).choices[0]
    assert both.finish_reason == "tool_calls", both
    assert [name for name, _ in _calls(both.message)] == ["get_weather", "get_time"]
    one = oai.chat.completions.create(**kwargs, parallel_tool_calls=False).choices[0]
    assert _calls(one.message) == _calls(both.message)[:1]
    assert one.message.content == both.message.content == "Sure.  and  done."
    assert one.finish_reason == "tool_calls"
    with oai.chat.completions.stream(**kwargs, parallel_tool_calls=False) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert _calls(streamed.message) == _calls(one.message)
    assert streamed.message.content == one.message.content
    assert streamed.finish_reason == "tool_calls"


NAME = "^[A-Z][a-z]{1,8}$"


class Address(BaseModel):
    city: str = Field(pattern=NAME)


class Person(BaseModel):
    name: str = Field(pattern=NAME)
    home: Address
    work: Address | None


class Node(BaseModel):
    value: int = Field(ge=0, le=9)
    children: list[Node] = Field(max_length=1)


class Tree(BaseModel):
    label: str = Field(pattern=NAME)
    kids: list[Tree] = Field(max_length=1)


def _shipment() -> type[BaseModel]:
    """A model whose ``$defs`` has an ``Address`` too, another than ``Person``'s."""

    class Address(BaseModel):
        zip: int = Field(ge=1000, le=9999)

    class Shipment(BaseModel):
        to: Address

    return Shipment


def _pydantic_tools() -> tuple[list[Any], dict[str, type[BaseModel]]]:
    """``openai.pydantic_function_tool`` of each model (``$defs`` and ``#/$defs/...``
    references, two ``Address`` of different shapes, a recursive ``Node``), and ``Tree``
    written against its own root (``"$ref": "#"``, as zod-to-json-schema writes one)."""
    models: dict[str, type[BaseModel]] = {
        "Person": Person,
        "Shipment": _shipment(),
        "Node": Node,
        "Tree": Tree,
    }
    tools: list[Any] = [openai.pydantic_function_tool(model) for model in models.values()]
    tree = tools[-1]["function"]["parameters"]
    del tree["$defs"]
    tools[-1]["function"]["parameters"] = json.loads(
        json.dumps(tree).replace('"#/$defs/Tree"', '"#"')
    )
    return tools, models


def _depth(value: Any) -> int:
    """How deep objects nest in a JSON value."""
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return max((_depth(v) for v in value), default=0)
    return 0


def test_pydantic_tools_with_defs_and_recursion_are_called_with_valid_arguments(
    oai: openai.OpenAI,
) -> None:
    """Tools from pydantic models, as ``openai.pydantic_function_tool`` and the Agents SDK
    write them, under "required" (all four in one schema) and named: every call's arguments
    validate against its model, and a recursive tool's children are its own shape (a
    ``"$ref": "#"`` is the tool's arguments, not the array of calls)."""
    tools, models = _pydantic_tools()
    # A slight bias to "]" ends the recursive lists within the budget, yet lets some nest.
    close = {str(i): 1 for i in range(TOKENIZER.vocab_size) if "]" in TOKENIZER.decode([i])}
    nested = set()
    # Seeds whose recursive calls nest, two per recursive tool where one would do.
    forced = [("Person", 0), ("Shipment", 1), ("Node", 7), ("Node", 8), ("Tree", 5), ("Tree", 8)]
    for name, seed in forced:
        message = (
            oai.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=tools,
                tool_choice="required",
                parallel_tool_calls=False,
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=seed,
                logit_bias={**STEADY, **close, **_favouring(name)},
            )
            .choices[0]
            .message
        )
        [(called, arguments)] = _calls(message)
        assert called == name, (called, arguments)
        models[name].model_validate_json(arguments)
        if name in ("Node", "Tree") and _depth(json.loads(arguments)) > 1:
            nested.add(name)
    assert nested == {"Node", "Tree"}, "a recursive tool never nested: the test shows little"
    for name in ("Person", "Tree"):
        named: Any = {"type": "function", "function": {"name": name}}
        message = (
            oai.chat.completions.create(
                model=MODEL,
                messages=MESSAGES,
                tools=tools,
                tool_choice=named,
                max_tokens=MAX_TOKENS,
                temperature=1.0,
                seed=1,
                logit_bias={**STEADY, **close},
            )
            .choices[0]
            .message
        )
        [(called, arguments)] = _calls(message)
        models[called].model_validate_json(arguments)


# --- a Mistral-style model (--tool-call-parser mistral) ----------------------------------------

MISTRAL = "mistral-style"
# Mistral's v3 format cut down to what a tool conversation needs, and its rule on ids: a call's
# id and a result's tool_call_id must be 9 letters and digits, or the template refuses the
# conversation (Mistral's own raises the same exception on any other length).
MISTRAL_TEMPLATE = """
{%- macro check(id) %}
    {%- if not (id is string and id | length == 9 and id.isalnum()) %}
        {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
    {%- endif %}
{%- endmacro %}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools and loop.first %}
            {{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}
        {{- '[TOOL_CALLS][' }}
        {%- for call in message['tool_calls'] %}
            {{- check(call['id']) }}
            {{- '{"name": ' + (call['function']['name'] | tojson) + ', "arguments": ' }}
            {{- (call['function']['arguments'] | tojson) + ', "id": "' + call['id'] + '"}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']</s>' }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + '</s>' }}
    {%- elif message['role'] == 'tool' %}
        {{- check(message['tool_call_id']) }}
        {{- '[TOOL_RESULTS]{"content": ' + (message['content'] | tojson) }}
        {{- ', "call_id": "' + message['tool_call_id'] + '"}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    """A small checkpoint with Mistral's ``[TOOL_CALLS]`` as a special token and a
    Mistral-style template, served with ``--tool-call-parser mistral``."""
    directory = tmp_path_factory.mktemp("mistral")
    write(directory / "model", layers=2, hidden=64, seed=5, special_tokens=("[TOOL_CALLS]",))
    (directory / "model" / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    args = ["--model-path", str(directory / "model"), "--served-model-name", MISTRAL]
    srv = ServerProcess(directory / "tmp", [*args, "--tool-call-parser", "mistral"]).wait_ready()
    try:
        with srv.openai_client() as client:
            yield client
    finally:
        srv.stop()


MISTRAL_CALL = (
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "unit": "c"}}]'
)


def test_mistral_call_ids_are_nine_alphanumerics_and_the_next_turn_renders(
    mistral: openai.OpenAI,
) -> None:
    """With ``--tool-call-parser mistral`` a call's id is 9 letters and digits under "auto"
    (the parser reads the array the regex writes), "required" and a named function; the
    next turn (the assistant's calls, then the tool's result) renders with the template,
    which refuses OpenAI's ``call_...`` ids."""
    common: Any = dict(model=MISTRAL, messages=MESSAGES, tools=TOOLS, max_tokens=MAX_TOKENS)
    auto = mistral.chat.completions.create(
        **common, temperature=0, extra_body={"guided_regex": re.escape(MISTRAL_CALL)}
    ).choices[0]
    assert auto.finish_reason == "tool_calls" and auto.message.content is None, auto
    named: Any = {"type": "function", "function": {"name": "get_time"}}
    forced = [
        mistral.chat.completions.create(
            **common, tool_choice=choice, temperature=1.0, seed=1, logit_bias=STEADY
        ).choices[0]
        for choice in ("required", named)
    ]
    for choice in (auto, *forced):
        [call] = choice.message.tool_calls or []
        assert re.fullmatch("[A-Za-z0-9]{9}", call.id), call

    def next_turn(call_id: str) -> list[Any]:
        [call] = auto.message.tool_calls or []
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call.model_dump(), "id": call_id}],
        }
        result = {"role": "tool", "tool_call_id": call_id, "content": "sunny"}
        return [*MESSAGES, assistant, result]

    [call] = auto.message.tool_calls or []
    answer = mistral.chat.completions.create(
        model=MISTRAL, messages=next_turn(call.id), tools=TOOLS, max_tokens=4
    )
    assert answer.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="alphanumeric strings with length 9"):
        mistral.chat.completions.create(
            model=MISTRAL, messages=next_turn("call_" + "0" * 24), tools=TOOLS, max_tokens=4
        )
