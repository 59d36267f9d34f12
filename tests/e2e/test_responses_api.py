"""The Responses API (``/v1/responses``) against the shared server and the built-in random
model, through the official client (``responses.create``, ``parse``, ``stream``,
``retrieve``, ``delete``) and the OpenAI Agents SDK's default Responses model (docs/api.md,
"The Responses API").

As in the chat tool tests, a random model writes calls and JSON only where a grammar makes it
(``tool_choice`` "required", ``text.format`` json_schema), with bounded schemas and
``tests.grammar_bias.STEADY`` keeping the answers short; such answers end by themselves
(``completed``), where free text runs to ``max_output_tokens`` (``incomplete``).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated, Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from tests.grammar_bias import STEADY, TOKENIZER
from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
[EOS] = TOKENIZER.eos_token_ids
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


# One call of get_weather, forced: the same request whole and streamed.
WEATHER_CALL: Any = {
    "model": MODEL,
    "input": "Weather in Oslo?",
    "tools": [WEATHER],
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "max_output_tokens": 120,
    "temperature": 1.0,
}


def _weather_call(oai: openai.OpenAI, seed: int) -> Any:
    return oai.responses.create(**WEATHER_CALL, extra_body={"logit_bias": STEADY, "seed": seed})


def test_text_answer_equals_chat_and_is_stored(oai: openai.OpenAI, server: ServerProcess) -> None:
    """A string input is one user message: the answer and its usage are the chat route's for
    the same prompt (greedy); cut by max_output_tokens it is incomplete. Stored by default:
    retrieve gives it back, delete removes it."""
    response = oai.responses.create(
        model=MODEL, input="Tell me a story.", max_output_tokens=12, temperature=0
    )
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me a story."}],
        max_tokens=12,
        temperature=0,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert (
        message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    )
    assert response.output_text == chat.choices[0].message.content
    usage, chat_usage = response.usage, chat.usage
    assert usage is not None and chat_usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        chat_usage.prompt_tokens,
        12,
        chat_usage.total_tokens,
    )
    assert usage.output_tokens_details.reasoning_tokens == 0
    # The chat request came second: its prompt was in the prefix cache, all but the last token.
    assert (
        chat_usage.prompt_tokens_details is not None
        and chat_usage.prompt_tokens_details.cached_tokens == usage.input_tokens - 1
    )

    assert oai.responses.retrieve(response.id).model_dump() == response.model_dump()
    oai.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(response.id)
    not_stored = oai.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{not_stored.id}").status_code == 404


def _tool_calls_counted(server: ServerProcess) -> float:
    """``tokenpipe:tool_calls_total`` now."""
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for sample in family.samples:
            if sample.name == "tokenpipe:tool_calls_total":
                return sample.value
    return 0.0


def test_function_call_round_trip_through_previous_response_id(
    oai: openai.OpenAI, server: ServerProcess
) -> None:
    """tool_choice "required" makes one function_call item whose arguments follow the
    schema (counted in the tool metrics as on chat); its output goes back as a
    function_call_output on previous_response_id, and the next answer sees the whole
    conversation (a longer prompt) and is a message. The same conversation sent whole,
    without the stored response, gives the same prompt."""
    calls_before = _tool_calls_counted(server)
    first = _weather_call(oai, seed=1)
    assert first.status == "completed"
    assert _tool_calls_counted(server) == calls_before + 1
    [call] = first.output
    assert (
        call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    )
    assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    assert re.fullmatch("[A-Z][a-z]{1,8}", arguments["city"]) and 1 <= arguments["days"] <= 7

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    # Tools are not carried over from a stored response (OpenAI's rule): they are sent again.
    second = oai.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[result],
        tools=[WEATHER],
        max_output_tokens=4,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    assert (
        second.usage is not None
        and first.usage is not None
        and second.usage.input_tokens > first.usage.input_tokens
    )
    whole = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        result,
    ]
    again = oai.responses.create(
        model=MODEL, input=whole, tools=[WEATHER], max_output_tokens=4, temperature=0, store=False
    )
    assert again.usage is not None and again.usage.input_tokens == second.usage.input_tokens
    assert again.output_text == second.output_text


def test_parse_with_a_json_schema_text_format(oai: openai.OpenAI) -> None:
    class City(BaseModel):
        name: Annotated[str, Field(pattern="^[A-Z][a-z]{1,8}$")]
        population: Annotated[int, Field(ge=0, le=10_000)]

    parsed = oai.responses.parse(
        model=MODEL,
        input="A city, please.",
        text_format=City,
        max_output_tokens=80,
        temperature=1.0,
        extra_body={"logit_bias": STEADY, "seed": 3},
    )
    assert parsed.status == "completed"
    assert isinstance(parsed.output_parsed, City)
    assert (
        parsed.text is not None
        and parsed.text.format is not None
        and parsed.text.format.type == "json_schema"
    )


def test_a_stream_assembles_the_same_response_as_the_whole(
    oai: openai.OpenAI, server: ServerProcess
) -> None:
    """``responses.stream()``: the events come in OpenAI's order, numbered from 0, and the
    final response equals the non-streamed one for the same seed (ids aside)."""
    whole = _weather_call(oai, seed=5)
    with oai.responses.stream(
        **WEATHER_CALL, extra_body={"logit_bias": STEADY, "seed": 5}
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "response.function_call_arguments.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")

    def shape(response: Any) -> Any:
        return [(i.type, i.name, i.arguments, i.status) for i in response.output], response.status

    assert shape(final) == shape(whole)
    assert deltas == final.output[0].arguments
    assert final.usage is not None and whole.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens,
        whole.usage.output_tokens,
    )
    assert (
        oai.responses.retrieve(final.id).output[0].arguments == final.output[0].arguments
    )  # a stream is stored too

    # Free text streams as output_text deltas, and ends incomplete at max_output_tokens.
    body = {
        "model": MODEL,
        "input": "Tell me a story.",
        "max_output_tokens": 6,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data]
    assert names[-1] == "response.incomplete" and data[-1]["response"]["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    text = "".join(d["delta"] for d in data if d["type"] == "response.output_text.delta")
    assert text == data[-1]["response"]["output"][0]["content"][0]["text"]
    assert (
        text
        == oai.responses.create(
            model=MODEL, input="Tell me a story.", max_output_tokens=6, temperature=0
        ).output_text
    )


@pytest.mark.parametrize("streamed", [False, True], ids=["run", "run_streamed"])
def test_openai_agents_sdk_responses_model_runs_a_tool_then_answers(
    server: ServerProcess, streamed: bool
) -> None:
    """The Agents SDK's default model (the Responses API): the first turn must call, the SDK
    runs the function with arguments that validate and sends the result back, and the next
    turn ends the run with a final answer; streamed, the SDK reads the same from the events."""
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    called: list[tuple[str, int]] = []

    @function_tool
    def get_weather(
        city: Annotated[str, Field(pattern="^[A-Z][a-z]{1,8}$")],
        days: Annotated[int, Field(ge=1, le=7)],
    ) -> str:
        """The weather in a city for the next days."""
        called.append((city, days))
        return f"sunny in {city} for {days} days"

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
    # The SDK fails a run on an incomplete response, and a random model's free text would run
    # to max_tokens: a bias on the EOS ends the second turn at once (in the first, the grammar
    # allows the EOS only once the call is complete).
    bias = {**STEADY, str(EOS): 100}
    settings = ModelSettings(
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=1.0,
        extra_body={"logit_bias": bias, "seed": 2},
    )
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=settings,
        reset_tool_choice=True,
    )

    async def run() -> Any:
        if not streamed:
            return await Runner.run(agent, "Weather in Oslo?", max_turns=4)
        streaming = Runner.run_streamed(agent, "Weather in Oslo?", max_turns=4)
        kinds = [event.type async for event in streaming.stream_events()]
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds, kinds
        return streaming

    result = asyncio.run(run())
    assert len(called) == 1 and isinstance(called[0][0], str) and isinstance(called[0][1], int), (
        called,
        result.new_items,
    )
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert [item.output for item in outputs] == [f"sunny in {called[0][0]} for {called[0][1]} days"]
    assert isinstance(result.final_output, str)


BAD_SCHEMA = {"type": "object", "minProperties": "x"}


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": [{"type": "web_search_call", "id": "x"}]}, 400, "input[0].type"),
        (
            {"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
            400,
            "input[0].call_id",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}
                ]
            },
            400,
            "input[0].content[0].type",
        ),
        ({"input": "hi", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "background": True}, 400, "background"),
        (
            {
                "input": "hi",
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "name": "nope"},
            },
            400,
            "tool_choice",
        ),
        (
            {"input": "hi", "tools": [{**WEATHER, "parameters": {"type": "string"}}]},
            400,
            "tools[0].parameters",
        ),
        (
            {
                "input": "hi",
                "text": {"format": {"type": "json_schema", "name": "x", "schema": BAD_SCHEMA}},
            },
            400,
            "text.format",
        ),
        ({}, 400, "input"),
    ],
    ids=[
        "item-type",
        "call-id",
        "image",
        "previous",
        "hosted-tool",
        "background",
        "named-tool",
        "bad-schema",
        "bad-format",
        "no-input",
    ],
)
def test_bad_input_is_refused_naming_the_field(
    server: ServerProcess, body: dict[str, Any], status: int, param: str
) -> None:
    response = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": MODEL, "max_output_tokens": 4, **body},
        timeout=60,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
    assert httpx.get(f"{server.url}/v1/responses/resp_nope").status_code == 404


def test_an_unknown_field_is_ignored_and_named(server: ServerProcess) -> None:
    """As on every route whose body is a request (docs/api.md, "Unknown fields")."""
    response = httpx.post(
        f"{server.url}/v1/responses",
        json={"model": MODEL, "max_output_tokens": 4, "input": "hi", "unknown_field": 1},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "unknown_field"


def test_an_aborted_stream_ends_cancelled_with_what_it_had(server: ServerProcess) -> None:
    """/abort_request on a streaming response (its rid is the response id and its choice
    index): the stream ends with response.incomplete, the response cancelled, its text what
    the deltas carried; it is stored as such."""
    body = {
        "model": MODEL,
        "input": "Go on forever.",
        "max_output_tokens": 1500,
        "stream": True,
        "logit_bias": {str(EOS): -100},
    }
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as response:
        lines = response.iter_lines()
        data = []
        for line in lines:
            if line.startswith("data: "):
                data.append(json.loads(line[6:]))
                if data[-1]["type"] == "response.output_text.delta":
                    break
        rid = data[0]["response"]["id"] + "-0"
        assert httpx.post(f"{server.url}/abort_request", json={"rid": rid}).status_code == 200
        data += [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    final = data[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "cancelled", (
        final
    )
    [message] = final["response"]["output"]
    assert message["status"] == "incomplete"
    assert message["content"][0]["text"] == "".join(
        d["delta"] for d in data if d["type"] == "response.output_text.delta"
    )
    assert 0 < final["response"]["usage"]["output_tokens"] < 1500
    assert (
        httpx.get(f"{server.url}/v1/responses/{data[0]['response']['id']}").json()["status"]
        == "cancelled"
    )


def test_a_required_call_cut_by_max_output_tokens_is_the_text_the_model_wrote(
    oai: openai.OpenAI,
) -> None:
    """``tool_choice: "required"`` cut before its call is whole: an incomplete response whose
    message is the text the model wrote (the tokens chat's logprobs show for the same prompt,
    greedy), with no ``[TOOL_CALLS]`` it never wrote; streamed as whole."""
    kwargs: Any = {**WEATHER_CALL, "max_output_tokens": 4, "temperature": 0}
    extra = {"logit_bias": STEADY}
    whole = oai.responses.create(**kwargs, extra_body=extra)
    tools: Any = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "parameters")}}]
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": WEATHER_CALL["input"]}],
        tools=tools,
        tool_choice="required",
        max_tokens=4,
        temperature=0,
        logit_bias=STEADY,
        logprobs=True,
    ).choices[0]
    assert chat.finish_reason == "length" and chat.logprobs and chat.logprobs.content
    written = b"".join(bytes(t.bytes or []) for t in chat.logprobs.content).decode()
    assert whole.status == "incomplete" and [item.type for item in whole.output] == ["message"]
    assert whole.output_text == written and written.startswith("["), written
    events = list(oai.responses.create(**kwargs, extra_body=extra, stream=True))
    assert events[-1].type == "response.incomplete"
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == whole.output_text
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text


def test_parallel_tool_calls_false_keeps_the_first_call_under_auto(oai: openai.OpenAI) -> None:
    """A regex makes the model write two Hermes calls under "auto": both are function_call
    items by default, only the first with ``parallel_tool_calls`` false, streamed as whole."""
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
    second = '<tool_call>\n{"name": "get_time", "arguments": {}}\n'
    answer = f"Sure. {first}</tool_call> and {second}</tool_call> done."
    get_time = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    kwargs: Any = dict(
        model=MODEL,
        input="Weather in Oslo?",
        tools=[WEATHER, get_time],
        max_output_tokens=200,
        temperature=0,
    )
    extra = {"structured_outputs": {"regex": re.escape(answer)}}

    def calls(response: Any) -> list[tuple[str, str]]:
        return [(i.name, i.arguments) for i in response.output if i.type == "function_call"]

    both = oai.responses.create(**kwargs, extra_body=extra)
    assert both.status == "completed" and [name for name, _ in calls(both)] == [
        "get_weather",
        "get_time",
    ]
    one = oai.responses.create(**kwargs, parallel_tool_calls=False, extra_body=extra)
    assert calls(one) == calls(both)[:1] and one.output_text == both.output_text
    with oai.responses.stream(**kwargs, parallel_tool_calls=False, extra_body=extra) as stream:
        final = stream.get_final_response()
    assert calls(final) == calls(one) and final.output_text == one.output_text
