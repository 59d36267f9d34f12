"""The JSON Schemas the engine can enforce (tokenizer_proc/request_edge/schema_support.py): a
keyword xgrammar compiles and then ignores is a 400 naming the field, the keyword and its
place in the schema, as is a schema nested deeper than the limit; what real clients send
(pydantic's schemas, tool parameters) passes. Each refused case is shown to be one the engine
really ignores: it accepts a value the keyword forbids."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any, Literal

import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field
from xgrammar.testing import _is_grammar_accept_string

from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.schema_support import MAX_SCHEMA_DEPTH, check_schema

INTS: dict[str, Any] = {"type": "array", "items": {"type": "integer"}}

# (schema, where the refusal points, a value the keyword forbids that the engine accepts)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("uniqueItems", {**INTS, "uniqueItems": True}, "uniqueItems at #/uniqueItems", "[1, 1]"),
    ("not", {"type": "integer", "not": {"const": 3}}, "not at #/not", "3"),
    ("contains", {**INTS, "contains": {"const": 3}}, "contains at #/contains", "[1]"),
    (
        "multipleOf with a range",
        {"type": "integer", "multipleOf": 3, "minimum": 0},
        "multipleOf at #/multipleOf",
        "4",
    ),
    ("multipleOf of a number", {"type": "number", "multipleOf": 0.5}, "multipleOf", "0.3"),
    ("multipleOf past 1024", {"type": "integer", "multipleOf": 1025}, "multipleOf", "4"),
    (
        "if/then/else",
        {"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20}},
        "if at #/if",
        "30",
    ),
    (
        "dependentRequired",
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentRequired": {"a": ["b"]},
        },
        "dependentRequired at #/dependentRequired",
        '{"a": 1}',
    ),
    (
        "incompatible allOf",
        {"allOf": [{"type": "string"}, {"type": "integer"}]},
        "allOf at #/allOf",
        "1",
    ),
    (
        "an assertion beside anyOf",
        {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": -5}]},
        "type at #/type: the engine applies anyOf alone",
        '"text"',
    ),
    (
        "an assertion beside $ref",
        {"$defs": {"A": {"type": "integer"}}, "$ref": "#/$defs/A", "minimum": 5},
        "minimum at #/minimum",
        "3",
    ),
    (
        "lookahead in a pattern",
        {"type": "string", "pattern": "^(?!a)[a-z]+$"},
        "pattern at #/pattern",
        '"abc"',
    ),
    (
        "maxLength beside a pattern",
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        "maxLength at #/maxLength",
        '"abcdef"',
    ),
    (
        "required but not listed",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
        "required at #/required: 'b'",
        '{"a": 1}',
    ),
    ("a reference to another document", {"$ref": "https://x.test/s.json"}, "$ref at #/$ref", "1"),
]
# An empty anyOf/oneOf is refused too: the engine compiles it to a grammar that matches
# nothing, which the scheduler would refuse only once the spec reached it.
EMPTY: list[tuple[str, dict[str, Any]]] = [("anyOf", {"anyOf": []}), ("oneOf", {"oneOf": []})]


def refusal(schema: dict[str, Any], param: str = "guided_json") -> RequestValidationError:
    with pytest.raises(RequestValidationError) as caught:
        check_schema(schema, param)
    return caught.value


@pytest.mark.parametrize(
    ("schema", "where", "forbidden"),
    [(s, w, f) for _, s, w, f in REFUSED],
    ids=[name for name, *_ in REFUSED],
)
def test_a_keyword_the_engine_ignores_is_refused_naming_the_field_and_its_place(
    schema: dict[str, Any], where: str, forbidden: str
) -> None:
    error = refusal(schema, "response_format.json_schema.schema")
    assert error.param == "response_format.json_schema.schema"
    assert str(error).startswith(f"response_format.json_schema.schema: {where}"), str(error)
    # Why it is refused: the engine compiles the schema and takes what the keyword forbids.
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, forbidden)


@pytest.mark.parametrize(("keyword", "schema"), EMPTY, ids=[k for k, _ in EMPTY])
def test_an_empty_anyof_or_oneof_is_refused(keyword: str, schema: dict[str, Any]) -> None:
    assert str(refusal(schema)) == (
        f"guided_json: {keyword} at #/{keyword}: an empty {keyword} matches nothing"
    )


def test_the_place_is_a_json_pointer_deep_in_properties_items_and_defs() -> None:
    schema = {
        "type": "object",
        "properties": {"a/b": {"type": "array", "items": {"$ref": "#/$defs/T~1"}}},
        "$defs": {"T~1": {"type": "object", "properties": {"n": {"not": {}}}}},
    }
    assert str(refusal(schema, "tools[2].function.parameters")) == (
        "tools[2].function.parameters: not at #/$defs/T~01/properties/n/not: the engine "
        "cannot exclude what a schema matches"
    )


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_nested_deeper_than_the_limit_is_refused_before_compiling() -> None:
    check_schema(_nested(MAX_SCHEMA_DEPTH), "guided_json")
    error = refusal(_nested(MAX_SCHEMA_DEPTH + 1))
    assert str(error).startswith(
        f"guided_json: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at #/items/items"
    )
    refusal(_nested(600))  # the issue's 600 nested arrays: refused at once


class Color(StrEnum):
    RED = "red"
    BLUE = "blue"


class Address(BaseModel):
    street: str = Field(max_length=40)
    zip: str = Field(pattern=r"^\d{5}$")


class Person(BaseModel):
    """What pydantic writes: $defs and $ref, anyOf for Optional, enums, Literal, bounds."""

    name: str = Field(min_length=1, description="the name")
    age: int = Field(ge=0, le=150)
    step: int = Field(multiple_of=5)
    color: Color
    kind: Literal["a", "b"]
    home: Address | None = None
    others: list[Address] = Field(default_factory=list, max_length=3)
    friends: list[Person] = Field(default_factory=list)


ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("pydantic", Person.model_json_schema()),
    ("integer multipleOf", {"type": "integer", "multipleOf": 1024}),
    ("uniqueItems false", {**INTS, "uniqueItems": False}),
    ("one allOf with annotations", {"allOf": [{"type": "integer"}], "description": "d"}),
    ("$ref with annotations", {"$defs": {"A": {}}, "$ref": "#/$defs/A", "title": "t"}),
    ("escaped and classed parentheses", {"type": "string", "pattern": r"^\(?=[(?=]\(?!$"}),
    ("recursion", {"type": "object", "properties": {"next": {"$ref": "#"}}}),
]


@pytest.mark.parametrize("schema", [s for _, s in ACCEPTED], ids=[n for n, _ in ACCEPTED])
def test_schemas_the_engine_enforces_pass(schema: dict[str, Any]) -> None:
    check_schema(schema, "guided_json")
