"""Every structured-output dialect of the OpenAI routes (OpenAI's ``response_format``, vLLM's
``structured_outputs`` and ``guided_*``, SGLang's ``json_schema``/``regex``/``ebnf``) decodes
to the one ``Constraint`` the scheduler compiles, malformed input is a 400 naming the field,
and a server that cannot serve a constraint says why before anything is submitted
(``tokenizer_proc.request_edge.constraints``, ``RequestChecks.validate_constraint``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import CONSTRAINT_KINDS, Constraint
from pipeline.tokenizer_loader import load_tokenizer
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.openai.schema import ChatCompletionBody, CompletionBody
from tokenizer_proc.request_checks import RequestChecks

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi"}
# Property order is the order the answer writes them in, so it must survive the mapping.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "string", "maxLength": 8}},
    "required": ["zeta", "alpha"],
}
SCHEMA_TEXT = (
    '{"type":"object","properties":{"zeta":{"type":"integer"},'
    '"alpha":{"type":"string","maxLength":8}},"required":["zeta","alpha"]}'
)
GRAMMAR = 'root ::= "yes" | "no"'


def constraint_of(extra: dict[str, Any], base: dict[str, Any] = CHAT) -> Constraint | None:
    body_type = ChatCompletionBody if "messages" in base else CompletionBody
    body = decode_body(json.dumps({**base, **extra}).encode(), body_type)
    body.refuse_unsupported()
    return body.constraint()


def refusal_of(extra: dict[str, Any], base: dict[str, Any] = CHAT) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as caught:
        constraint_of(extra, base)
    return caught.value


MAPPED: list[tuple[str, dict[str, Any], Constraint]] = [
    (
        "openai json_object",
        {"response_format": {"type": "json_object"}},
        Constraint("json_object", "", "response_format"),
    ),
    (
        "openai json_schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "Pet",
                    "schema": SCHEMA,
                    "strict": True,
                    "description": "a pet",
                },
            }
        },
        Constraint("json_schema", SCHEMA_TEXT, "response_format.json_schema.schema"),
    ),
    (
        "vllm json object",
        {"structured_outputs": {"json": SCHEMA}},
        Constraint("json_schema", SCHEMA_TEXT, "structured_outputs.json"),
    ),
    (
        "vllm json text",
        {"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}},
        Constraint("json_schema", SCHEMA_TEXT, "structured_outputs.json"),
    ),
    (
        "vllm regex",
        {"structured_outputs": {"regex": r"\d{3}"}},
        Constraint("regex", r"\d{3}", "structured_outputs.regex"),
    ),
    (
        "vllm choice",
        {"structured_outputs": {"choice": ["a", "b c"]}},
        Constraint("choice", '["a","b c"]', "structured_outputs.choice"),
    ),
    (
        "vllm grammar",
        {"structured_outputs": {"grammar": GRAMMAR}},
        Constraint("grammar", GRAMMAR, "structured_outputs.grammar"),
    ),
    (
        "vllm json_object",
        {"structured_outputs": {"json_object": True}},
        Constraint("json_object", "", "structured_outputs.json_object"),
    ),
    (
        "vllm options at their neutral values",
        {
            "structured_outputs": {
                "regex": "a+",
                "disable_any_whitespace": False,
                "whitespace_pattern": None,
                "disable_fallback": True,
            }
        },
        Constraint("regex", "a+", "structured_outputs.regex"),
    ),
    (
        "vllm compact json",
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        Constraint("json_schema", SCHEMA_TEXT, "structured_outputs.json", any_whitespace=False),
    ),
    (
        "guided_json object",
        {"guided_json": SCHEMA},
        Constraint("json_schema", SCHEMA_TEXT, "guided_json"),
    ),
    (
        "guided_json text",
        {"guided_json": json.dumps(SCHEMA)},
        Constraint("json_schema", SCHEMA_TEXT, "guided_json"),
    ),
    (
        "guided_regex",
        {"guided_regex": r"\d{3}-[a-z]{4}"},
        Constraint("regex", r"\d{3}-[a-z]{4}", "guided_regex"),
    ),
    (
        "guided_choice",
        {"guided_choice": ["yes", "no"]},
        Constraint("choice", '["yes","no"]', "guided_choice"),
    ),
    (
        "guided_grammar",
        {"guided_grammar": GRAMMAR},
        Constraint("grammar", GRAMMAR, "guided_grammar"),
    ),
    (
        "guided_json with the backend named",
        {"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"},
        Constraint("json_schema", SCHEMA_TEXT, "guided_json"),
    ),
    (
        "sglang json_schema",
        {"json_schema": json.dumps(SCHEMA)},
        Constraint("json_schema", SCHEMA_TEXT, "json_schema"),
    ),
    ("sglang regex", {"regex": "[ab]+"}, Constraint("regex", "[ab]+", "regex")),
    ("sglang ebnf", {"ebnf": GRAMMAR}, Constraint("grammar", GRAMMAR, "ebnf")),
]


@pytest.mark.parametrize("base", [CHAT, COMPLETION], ids=["chat", "completions"])
@pytest.mark.parametrize(
    ("extra", "expected"), [(e, c) for _, e, c in MAPPED], ids=[name for name, _, _ in MAPPED]
)
def test_each_dialect_maps_to_one_constraint_on_both_routes(
    base: dict[str, Any], extra: dict[str, Any], expected: Constraint
) -> None:
    assert constraint_of(extra, base) == expected
    assert expected.kind in CONSTRAINT_KINDS


@pytest.mark.parametrize("base", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_no_constraint_and_the_text_format_ask_for_nothing(base: dict[str, Any]) -> None:
    assert constraint_of({}, base) is None
    assert constraint_of({"response_format": {"type": "text"}}, base) is None
    every_field_null = dict.fromkeys(
        (
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "json_schema",
            "regex",
            "ebnf",
        )
    )
    assert constraint_of(every_field_null, base) is None
    assert (
        constraint_of({"guided_decoding_backend": "auto", "guided_whitespace_pattern": None}, base)
        is None
    )


def test_a_schema_sent_as_an_object_or_as_text_is_one_spec() -> None:
    # One spec: the scheduler caches compiled grammars by (kind, spec).
    specs = {
        c.spec
        for c in (
            constraint_of({"guided_json": SCHEMA}),
            constraint_of({"guided_json": json.dumps(SCHEMA, indent=4)}),
            constraint_of({"json_schema": json.dumps(SCHEMA)}),
            constraint_of(
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "x", "schema": SCHEMA},
                    }
                }
            ),
        )
        if c is not None
    }
    assert specs == {SCHEMA_TEXT}
    assert list(json.loads(SCHEMA_TEXT)["properties"]) == ["zeta", "alpha"]


REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    (
        "json_schema without its object",
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema",
        "needs json_schema",
    ),
    (
        "json_schema without a schema",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format.json_schema.schema",
        "is required",
    ),
    (
        "json_schema without a name",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        "response_format.json_schema",
        "name",
    ),
    (
        "a schema that is not an object",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
        "response_format.json_schema.schema",
        "Expected `object",
    ),
    (
        "json_schema given with json_object",
        {
            "response_format": {
                "type": "json_object",
                "json_schema": {"name": "x", "schema": SCHEMA},
            }
        },
        "response_format.json_schema",
        "only allowed with type json_schema",
    ),
    ("an unknown format type", {"response_format": {"type": "xml"}}, "response_format.type", "xml"),
    (
        "an unknown json_schema key",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {}, "bogus": 1},
            }
        },
        "response_format.json_schema.bogus",
        "unknown field",
    ),
    ("guided_json not JSON", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    (
        "guided_json JSON but no object",
        {"guided_json": "[1, 2]"},
        "guided_json",
        "must be a JSON Schema object",
    ),
    ("guided_json a number", {"guided_json": 3}, "guided_json", "Expected"),
    ("guided_regex empty", {"guided_regex": ""}, "guided_regex", "must not be empty"),
    ("guided_choice empty", {"guided_choice": []}, "guided_choice", "at least one choice"),
    (
        "guided_choice not strings",
        {"guided_choice": ["a", 1]},
        "guided_choice[1]",
        "Expected `str`",
    ),
    ("guided_grammar blank", {"guided_grammar": "  "}, "guided_grammar", "must not be empty"),
    (
        "structured_outputs empty",
        {"structured_outputs": {}},
        "structured_outputs",
        "must set one of",
    ),
    (
        "structured_outputs json_object false only",
        {"structured_outputs": {"json_object": False}},
        "structured_outputs",
        "must set one of",
    ),
    (
        "structured_outputs unknown key",
        {"structured_outputs": {"regex": "a", "pattern": "b"}},
        "structured_outputs.pattern",
        "unknown field",
    ),
    (
        "structured_outputs option it cannot honour",
        {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
        "structured_outputs.disable_additional_properties",
        "not supported",
    ),
    (
        "a schema keyword the engine would ignore",
        {"guided_json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "guided_json",
        "uniqueItems at #/uniqueItems",
    ),
    (
        "structured_outputs structural_tag",
        {"structured_outputs": {"structural_tag": "{}"}},
        "structured_outputs.structural_tag",
        "not supported",
    ),
    (
        "a backend it does not have",
        {"guided_decoding_backend": "outlines"},
        "guided_decoding_backend",
        "not supported",
    ),
    (
        "a whitespace pattern",
        {"guided_whitespace_pattern": " *"},
        "guided_whitespace_pattern",
        "not supported",
    ),
]


@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [(e, p, n) for _, e, p, n in REFUSED],
    ids=[name for name, *_ in REFUSED],
)
def test_malformed_structured_output_is_a_400_naming_the_field(
    extra: dict[str, Any], param: str, needle: str
) -> None:
    error = refusal_of(extra)
    assert error.param == param and needle in str(error), (error.param, str(error))


TWO: list[tuple[dict[str, Any], str, str]] = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            },
            "guided_regex": "a+",
        },
        "guided_regex",
        "response_format.json_schema.schema",
    ),
    (
        {"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
        "structured_outputs.choice",
        "response_format",
    ),
    (
        {"structured_outputs": {"regex": "a+", "grammar": GRAMMAR}},
        "structured_outputs.grammar",
        "structured_outputs.regex",
    ),
    ({"guided_json": SCHEMA, "guided_choice": ["a"]}, "guided_choice", "guided_json"),
    ({"guided_grammar": GRAMMAR, "regex": "a+"}, "regex", "guided_grammar"),
    ({"regex": "a+", "ebnf": GRAMMAR}, "ebnf", "regex"),
]


@pytest.mark.parametrize(("extra", "second", "first"), TWO, ids=[t[1] for t in TWO])
def test_two_constraints_are_refused_naming_the_second(
    extra: dict[str, Any], second: str, first: str
) -> None:
    error = refusal_of(extra)
    assert error.param == second
    assert (
        str(error) == f"{second}: a request takes one structured-output constraint, "
        f"and {first} already gives one"
    )


def _checks(**config: Any) -> RequestChecks:
    tokenizer = None if config.get("skip_tokenizer_init") else load_tokenizer(None)
    return RequestChecks(ServerConfig(**config), tokenizer, vocab_size=4096, context_length=2048)


def test_a_server_without_a_tokenizer_refuses_a_constraint_naming_the_flag() -> None:
    with pytest.raises(RequestValidationError) as caught:
        _checks(skip_tokenizer_init=True).validate_constraint(
            Constraint("regex", "a+", "guided_regex")
        )
    assert caught.value.param == "guided_regex" and "--skip-tokenizer-init" in str(caught.value)
    _checks(skip_tokenizer_init=True).validate_constraint(None)  # unconstrained requests are served


def test_dllm_mode_refuses_a_constraint_by_its_field() -> None:
    with pytest.raises(RequestValidationError) as caught:
        _checks(mode="dllm").validate_constraint(Constraint("json_object", "", "response_format"))
    assert caught.value.param == "response_format" and "--mode dllm" in str(caught.value)
    _checks(mode="dllm").validate_constraint(None)


def test_a_generate_server_with_a_tokenizer_takes_every_kind() -> None:
    checks = _checks()
    for kind in CONSTRAINT_KINDS:
        checks.validate_constraint(Constraint(kind, "", "x"))
