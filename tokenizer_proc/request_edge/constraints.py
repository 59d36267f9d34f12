"""Structured outputs in every dialect a client sends, made into the one
``pipeline.io_struct.Constraint`` the scheduler compiles (docs/api.md, "Structured outputs"):
OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``structured_outputs``
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and older ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar``, and SGLang's ``json_schema`` (a
string), ``regex`` and ``ebnf``.

Each function here reads one field and returns its ``Constraint`` or None (absent, or asking
for nothing, as ``{"type": "text"}``); malformed input is a ``RequestValidationError`` naming
the field, and so is a JSON Schema the engine would not enforce (``schema_support``). Whether
a schema, pattern or grammar compiles is the engine's answer, a 400 from the scheduler naming
``Constraint.param``. ``one_constraint`` refuses a request that asks for two.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from pipeline.io_struct import Constraint
from tokenizer_proc.request_edge.known_fields import Refusal, neutral, refuse
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.schema_support import check_schema

JsonSchema = str | dict[str, Any]  # an object, or its JSON text (vLLM and SGLang take both)


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's ``response_format.json_schema``. ``strict`` is taken but changes nothing: the
    output always follows the schema, which is what ``strict: true`` asks."""

    name: str
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``structured_outputs`` (its ``StructuredOutputsParams``): one of the five
    constraints, plus options. ``disable_any_whitespace`` makes a JSON answer compact."""

    json: JsonSchema | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: Any = None
    whitespace_pattern: Any = None
    # There is one backend and it never falls back, so either value is what happens.
    disable_fallback: bool | None = None


# structured_outputs' options that the wire's Constraint cannot carry: accepted at their
# neutral values only.
_OPTION_REFUSALS: tuple[Refusal, ...] = (
    neutral("structural_tag"),
    neutral("disable_additional_properties", False),
    neutral("whitespace_pattern"),
)


def response_format_constraint(value: ResponseFormat | None) -> Constraint | None:
    """OpenAI's ``response_format``, on chat and completions; ``{"type": "text"}`` asks for
    nothing."""
    if value is None or value.type == "text":
        if value is not None and value.json_schema is not None:
            raise RequestValidationError(
                "response_format.json_schema is only allowed with type json_schema",
                "response_format.json_schema",
            )
        return None
    if value.type == "json_object":
        if value.json_schema is not None:
            raise RequestValidationError(
                "response_format.json_schema is only allowed with type json_schema",
                "response_format.json_schema",
            )
        return Constraint("json_object", "", "response_format")
    if value.json_schema is None:
        raise RequestValidationError(
            'response_format of type json_schema needs json_schema: {"name": ..., "schema": {...}}',
            "response_format.json_schema",
        )
    if value.json_schema.schema is None:
        raise RequestValidationError(
            "response_format.json_schema.schema is required: the JSON Schema the answer must "
            "follow",
            "response_format.json_schema.schema",
        )
    return json_schema_constraint(value.json_schema.schema, "response_format.json_schema.schema")


def structured_outputs_constraint(value: StructuredOutputs | None) -> Constraint | None:
    """vLLM's ``structured_outputs``: exactly one of its constraint keys (``json_object``
    counts when true), as vLLM requires."""
    if value is None:
        return None
    where = "structured_outputs."
    refuse(value, _OPTION_REFUSALS, where)
    found = (
        json_schema_constraint(value.json, where + "json"),
        regex_constraint(value.regex, where + "regex"),
        choice_constraint(value.choice, where + "choice"),
        grammar_constraint(value.grammar, where + "grammar"),
        Constraint("json_object", "", where + "json_object") if value.json_object else None,
    )
    constraint = one_constraint(*found)
    if constraint is None:
        raise RequestValidationError(
            "structured_outputs must set one of json, regex, choice, grammar or json_object (true)",
            "structured_outputs",
        )
    if value.disable_any_whitespace:
        return msgspec.structs.replace(constraint, any_whitespace=False)
    return constraint


def json_schema_constraint(value: JsonSchema | None, param: str) -> Constraint | None:
    """A JSON Schema given as an object or as its JSON text (``guided_json``, SGLang's
    ``json_schema``, ``structured_outputs.json``). Its spec is its JSON text with the client's
    key order kept (the order its properties are generated in), compact, so a schema sent as
    an object or as a string shares one compiled grammar in the scheduler's cache."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = msgspec.json.decode(value)
        except msgspec.DecodeError as exc:
            raise RequestValidationError(f"{param} is not valid JSON: {exc}", param) from exc
        if not isinstance(value, dict):
            raise RequestValidationError(
                f"{param} must be a JSON Schema object, not {type(value).__name__}", param
            )
    check_schema(value, param)
    return Constraint("json_schema", msgspec.json.encode(value).decode(), param)


def regex_constraint(value: str | None, param: str) -> Constraint | None:
    if value is None:
        return None
    if not value:
        raise RequestValidationError(f"{param} must not be empty", param)
    return Constraint("regex", value, param)


def grammar_constraint(value: str | None, param: str) -> Constraint | None:
    """An EBNF grammar as xgrammar reads it (GBNF: a ``root`` rule, ``::=``)."""
    if value is None:
        return None
    if not value.strip():
        raise RequestValidationError(f"{param} must not be empty", param)
    return Constraint("grammar", value, param)


def choice_constraint(value: list[str] | None, param: str) -> Constraint | None:
    """The answer is exactly one of the strings."""
    if value is None:
        return None
    if not value:
        raise RequestValidationError(f"{param} must hold at least one choice", param)
    return Constraint("choice", msgspec.json.encode(value).decode(), param)


def one_constraint(*found: Constraint | None) -> Constraint | None:
    """The request's constraint: the first of ``found`` that is not None. A second is refused
    naming its field, since outputs cannot follow two grammars at once."""
    given = [c for c in found if c is not None]
    if len(given) > 1:
        first, second = given[0], given[1]
        raise RequestValidationError(
            f"{second.param}: a request takes one structured-output constraint, and {first.param} "
            "already gives one",
            second.param,
        )
    return given[0] if given else None
