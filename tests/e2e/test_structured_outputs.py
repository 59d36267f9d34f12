"""Structured outputs against a real server and the built-in random model, through the real
clients: the official openai client's ``parse`` and ``stream`` with a Pydantic model,
instructor (JSON_SCHEMA mode: ``response_format``), langchain-openai's
``with_structured_output(method="json_schema")``, OpenAI's ``json_object``, vLLM's
``guided_*`` and ``structured_outputs`` and SGLang's ``regex``/``ebnf`` (``extra_body``), on
chat and completions; invalid specs get the engine's reason in a 400 naming the field; the
metrics count what ran (docs/api.md, "Structured outputs").

The model's weights are random, so only the constraint makes its answers parse. Two things
make every answer finish within ``max_tokens``, whatever the sampler draws: every string and
list of the schemas is bounded (``max_length``), and whitespace-only tokens are biased away
(``tests.grammar_bias.STEADY``), since a random model fills every gap between JSON tokens
with as much whitespace as the grammar allows. Nothing else is hidden: pushed toward control
characters and the bytes of encoded surrogates, every answer is still strict JSON.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Any

import httpx
import instructor
import openai
import pytest
from langchain_openai import ChatOpenAI
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from pipeline.tokenizer_loader import load_tokenizer
from tests.grammar_bias import STEADY, STRAY_TOKENS, WHITESPACE_TOKENS
from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
MAX_TOKENS = 400
TOKENIZER = load_tokenizer(None)
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a pet as JSON."}]
PATTERN = r"\d{3}-[a-z]{4}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= ("red" | "green" | "blue") " " [0-9] [0-9]?'
GRAMMAR_AS_REGEX = r"(red|green|blue) [0-9][0-9]?"


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Tag(BaseModel):
    label: str = Field(max_length=12)
    weight: int = Field(ge=0, le=100)


class Pet(BaseModel):
    """A pet: nested objects, a list, an enum and an optional field, each bounded."""

    name: str = Field(max_length=16)
    color: Color
    tags: list[Tag] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=10)


def test_the_bias_names_the_tokenizers_whitespace_tokens() -> None:
    # The bias is what bounds the answers' length; it must hit the tokenizer's whitespace.
    texts = {TOKENIZER.tokenizer.decode([i]) for i in WHITESPACE_TOKENS}
    assert {" ", "\n", "\t", "\r"} <= texts and len(STEADY) == len(texts)
    strays = "".join(TOKENIZER.tokenizer.decode([i]) for i in STRAY_TOKENS)
    assert {chr(c) for c in range(0x20)} - set(" \t\n\r") <= set(strays)


def _parse(client: openai.OpenAI) -> Pet:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        logit_bias=STEADY,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Pet), choice.message
    return choice.message.parsed


def test_openai_parse_gives_a_valid_pydantic_object_for_every_one_of_50_sampled_answers(
    oai: openai.OpenAI,
) -> None:
    with ThreadPoolExecutor(10) as pool:
        pets = list(pool.map(lambda _: _parse(oai), range(50)))
    assert len(pets) == 50 and all(isinstance(p, Pet) for p in pets)
    # Sampled at temperature 1: the answers differ, so the schema, not one lucky string, held.
    assert len({p.model_dump_json() for p in pets}) > 40


def test_openai_stream_ends_in_a_valid_pydantic_object(oai: openai.OpenAI) -> None:
    for _ in range(3):
        with oai.chat.completions.stream(
            model=MODEL,
            messages=MESSAGES,
            response_format=Pet,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            logit_bias=STEADY,
        ) as stream:
            deltas = [event.delta for event in stream if event.type == "content.delta"]
            final = stream.get_final_completion()
        assert len(deltas) > 1  # really streamed, token by token
        choice = final.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Pet)
        assert "".join(deltas) == choice.message.content


def test_instructor_json_schema_mode_returns_a_validated_object(oai: openai.OpenAI) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.JSON_SCHEMA)
    for _ in range(3):
        pet = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_model=Pet,
            max_retries=0,  # one attempt: a retry would hide an invalid answer
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            logit_bias=STEADY,
        )
        assert isinstance(pet, Pet)


def test_langchain_with_structured_output_json_schema_returns_a_validated_object(
    server: ServerProcess,
) -> None:
    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key="unused",
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        logit_bias={int(k): v for k, v in STEADY.items()},
        max_retries=0,
        use_responses_api=False,
    )
    structured = llm.with_structured_output(Pet, method="json_schema")
    for _ in range(3):
        assert isinstance(structured.invoke("Describe a pet as JSON."), Pet)


# json_object allows any object, with keys and strings of any length: the bias also makes
# the random model close its strings and objects early ('"' and '}'; the grammar decides
# where they are allowed), so every answer ends within max_tokens.
CLOSING = {**STEADY, str(TOKENIZER.encode('"')[0]): 12, str(TOKENIZER.encode("}")[0]): 12}


def test_json_object_answers_are_json_objects_on_chat_and_completions(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_object"},
        n=12,
        max_tokens=MAX_TOKENS,
        logit_bias=CLOSING,
    )
    completions = oai.completions.create(
        model=MODEL,
        prompt="A JSON object:",
        n=6,
        max_tokens=MAX_TOKENS,
        logit_bias=CLOSING,
        extra_body={"response_format": {"type": "json_object"}},
    )
    answers = [c.message.content or "" for c in chat.choices] + [
        c.text for c in completions.choices
    ]
    assert len(answers) == 18
    for answer in answers:
        assert isinstance(json.loads(answer), dict), answer
    assert all(c.finish_reason == "stop" for c in [*chat.choices, *completions.choices])


# Pushed toward every token holding a control character or the byte 0xED (an encoded
# surrogate's lead byte), a random model writes one wherever the grammar lets it: before the
# strings were made strict, nearly every bounded string held a raw one (not JSON).
STRAY = {**STEADY, **{str(i): 8 for i in STRAY_TOKENS}}
WORDS = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "minLength": 1, "maxLength": 12},
            "minItems": 2,
            "maxItems": 4,
        },
        "note": {"type": "string", "maxLength": 20},
    },
    "required": ["words", "note"],
}


def test_every_answer_is_strict_json_even_pushed_toward_control_characters(
    oai: openai.OpenAI,
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=16,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        logit_bias=STRAY,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WORDS}},
    )
    for choice in chat.choices:
        content = choice.message.content or ""
        assert choice.finish_reason == "stop", content
        value = json.loads(content)  # strict: a raw control character in a string raises
        assert 2 <= len(value["words"]) <= 4 and len(value["note"]) <= 20, content
        assert all(1 <= len(word) <= 12 for word in value["words"]), content
        assert "\ufffd" not in content, content  # no encoded surrogate (nor broken UTF-8)


def _outside_strings(text: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)


def test_vllm_disable_any_whitespace_makes_compact_json_with_no_bias_at_all(
    oai: openai.OpenAI,
) -> None:
    """Compact JSON leaves the model no whitespace to spend, so no bias is needed: each
    answer ends, and between its tokens is only the space of ", " and ": " (as vLLM's
    xgrammar writes it)."""
    chat = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=8,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        extra_body={
            "structured_outputs": {"json": Pet.model_json_schema(), "disable_any_whitespace": True}
        },
    )
    for choice in chat.choices:
        content = choice.message.content or ""
        assert choice.finish_reason == "stop", content
        Pet.model_validate_json(content)
        outside = _outside_strings(content).replace(", ", ",").replace(": ", ":")
        assert not re.search(r"\s", outside), content


@pytest.mark.parametrize(
    "extra_body",
    [{"guided_regex": PATTERN}, {"structured_outputs": {"regex": PATTERN}}, {"regex": PATTERN}],
    ids=["guided_regex", "structured_outputs.regex", "sglang regex"],
)
def test_every_choice_of_a_regex_request_fullmatches_the_pattern(
    oai: openai.OpenAI, extra_body: dict[str, Any]
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=8, max_tokens=32, extra_body=extra_body
    )
    completions = oai.completions.create(
        model=MODEL, prompt=["A code:", "Another:"], n=4, max_tokens=32, extra_body=extra_body
    )
    answers = [c.message.content or "" for c in chat.choices] + [
        c.text for c in completions.choices
    ]
    assert len(answers) == 16
    assert all(re.fullmatch(PATTERN, a) for a in answers), answers
    assert len(set(answers)) > 8


@pytest.mark.parametrize(
    "extra_body",
    [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}],
    ids=["guided_choice", "structured_outputs.choice"],
)
def test_every_choice_answer_is_one_of_the_choices(
    oai: openai.OpenAI, extra_body: dict[str, Any]
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=12, max_tokens=16, extra_body=extra_body
    )
    completions = oai.completions.create(
        model=MODEL, prompt="Pick:", n=6, max_tokens=16, extra_body=extra_body
    )
    answers = [c.message.content for c in chat.choices] + [c.text for c in completions.choices]
    assert set(answers) <= set(CHOICES) and len(answers) == 18


@pytest.mark.parametrize(
    "extra_body",
    [{"guided_grammar": GRAMMAR}, {"structured_outputs": {"grammar": GRAMMAR}}, {"ebnf": GRAMMAR}],
    ids=["guided_grammar", "structured_outputs.grammar", "sglang ebnf"],
)
def test_every_grammar_answer_is_in_the_grammars_language(
    oai: openai.OpenAI, extra_body: dict[str, Any]
) -> None:
    chat = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=8, max_tokens=16, extra_body=extra_body
    )
    answers = [c.message.content or "" for c in chat.choices]
    assert all(re.fullmatch(GRAMMAR_AS_REGEX, a) for a in answers), answers


def test_completions_follow_a_response_format_json_schema(oai: openai.OpenAI) -> None:
    schema = Pet.model_json_schema()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "Pet", "schema": schema, "strict": True},
    }
    completion = oai.completions.create(
        model=MODEL,
        prompt="A pet:",
        n=6,
        max_tokens=MAX_TOKENS,
        logit_bias=STEADY,
        extra_body={"response_format": response_format},
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        Pet.model_validate_json(choice.text)
    streamed = oai.completions.create(
        model=MODEL,
        prompt="A pet:",
        max_tokens=MAX_TOKENS,
        logit_bias=STEADY,
        stream=True,
        extra_body={"guided_json": schema},
    )
    Pet.model_validate_json("".join(chunk.choices[0].text for chunk in streamed if chunk.choices))


DEEP: dict[str, Any] = {"type": "integer"}
for _ in range(600):  # the 600 nested arrays: 18 s of compile on one thread
    DEEP = {"type": "array", "items": DEEP}

INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "chat",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            }
        },
        "response_format.json_schema.schema",
        "nonsense",
    ),
    ("chat", {"guided_json": {"$ref": "#/$defs/Missing"}}, "guided_json", "Missing"),
    ("chat", {"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    (
        "completions",
        {"structured_outputs": {"regex": "a{3,1}"}},
        "structured_outputs.regex",
        "bound",
    ),
    ("chat", {"guided_grammar": "root ::= missing_rule"}, "guided_grammar", "missing_rule"),
    ("completions", {"ebnf": 'start ::= "a"'}, "ebnf", "root"),
    # Keywords the engine would compile and ignore: refused at the API, with their place.
    (
        "chat",
        {"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "guided_json",
        "uniqueItems at #/uniqueItems",
    ),
    (
        "completions",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"properties": {"n": {"not": {}}}}},
            }
        },
        "response_format.json_schema.schema",
        "not at #/properties/n/not",
    ),
    ("chat", {"guided_json": DEEP}, "guided_json", "the schema nests deeper than 64 levels"),
    # Languages with no answer at all: refused when they compile.
    ("chat", {"guided_grammar": "root ::= root"}, "guided_grammar", "matches nothing"),
    (
        "completions",
        {"structured_outputs": {"regex": "[^\\s\\S]"}},
        "structured_outputs.regex",
        "matches nothing",
    ),
]


@pytest.mark.parametrize(
    ("route", "extra", "param", "reason"), INVALID, ids=[i[2] for i in INVALID]
)
def test_an_invalid_spec_is_a_400_with_the_field_and_the_engines_reason(
    http: httpx.Client, route: str, extra: dict[str, Any], param: str, reason: str
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 8}
    base |= {"messages": MESSAGES} if route == "chat" else {"prompt": "hi"}
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    for stream in (False, True):
        response = http.post(path, json={**base, **extra, "stream": stream, "n": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (
            error["param"] == param
            and error["message"].startswith(f"{param}: ")
            and reason in error["message"]
        ), error
    served = http.post(path, json={**base, "guided_choice": CHOICES})
    assert served.status_code == 200, served.text


def test_tool_parameters_the_engine_cannot_enforce_are_a_400_naming_the_tool(
    oai: openai.OpenAI,
) -> None:
    """Under a named tool_choice and under "required" alike, the refusal names the tool whose
    parameters are at fault, with the keyword's place in them."""
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    parameters = {"type": "object", "properties": {"tags": tags}, "required": ["tags"]}
    tools: list[Any] = [
        {"type": "function", "function": {"name": "other"}},
        {"type": "function", "function": {"name": "tag", "parameters": parameters}},
    ]
    named: Any = {"type": "function", "function": {"name": "tag"}}
    for choice in (named, "required"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=16, tools=tools, tool_choice=choice
            )
        error = caught.value.body
        assert isinstance(error, dict) and error["param"] == "tools[1].function.parameters", error
        assert "uniqueItems at #/properties/tags/uniqueItems" in error["message"], error
    # Under "auto" the parameters are only shown to the model, so nothing is refused.
    served = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, tools=tools)
    assert served.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_two_constraints_are_refused_naming_the_second(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "Pet", "schema": Pet.model_json_schema()},
        },
        "guided_regex": PATTERN,
    }
    error = http.post("/v1/chat/completions", json=body).json()["error"]
    assert (
        error["param"] == "guided_regex"
        and "response_format.json_schema.schema already gives one" in error["message"]
    )


def _scrape(http: httpx.Client) -> dict[tuple[str, str], float]:
    """(sample name, kind label) -> value of the structured-output series."""
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if "constrained_requests" in sample.name or "grammar_compile_wait" in sample.name:
                out[(sample.name, sample.labels.get("kind", sample.labels.get("le", "")))] = (
                    sample.value
                )
    return out


def test_metrics_count_each_finished_constrained_request_by_kind(
    oai: openai.OpenAI, http: httpx.Client
) -> None:
    before = _scrape(http)
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, max_tokens=32, extra_body={"guided_regex": PATTERN}
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, extra_body={"guided_choice": CHOICES}
    )
    oai.completions.create(
        model=MODEL, prompt="x", n=2, max_tokens=16, extra_body={"ebnf": GRAMMAR}
    )
    _parse(oai)
    oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        logit_bias=CLOSING,
        response_format={"type": "json_object"},
    )
    oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4
    )  # unconstrained: not counted
    after = _scrape(http)

    def delta(name: str, label: str) -> float:
        return after[(name, label)] - before.get((name, label), 0.0)

    total = "tokenpipe:constrained_requests_total"
    assert {
        kind: delta(total, kind)
        for kind in ("regex", "choice", "grammar", "json_schema", "json_object")
    } == {
        "regex": 3,
        "choice": 1,
        "grammar": 2,
        "json_schema": 1,
        "json_object": 1,
    }
    assert delta("tokenpipe:grammar_compile_wait_seconds_count", "") == 8
    assert delta("tokenpipe:grammar_compile_wait_seconds_bucket", "+Inf") == 8
