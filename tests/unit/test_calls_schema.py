"""The combined schema of ``tool_choice: "required"`` (tokenizer_proc/openai/calls_schema.py)
keeps what each tool's references mean: its ``$defs`` move to the combined root (renamed
where two tools share a name) and a reference to the tool's own root (``#``) stays on the
tool's arguments, not on the array of calls. Checked by expanding every reference a few
levels deep, in the combined schema and in the tool's own, and comparing the two."""

from __future__ import annotations

import json
from typing import Any

import openai
import xgrammar
from pydantic import BaseModel

from tokenizer_proc.openai.calls_schema import calls_schema


class Address(BaseModel):
    city: str


class Person(BaseModel):
    name: str
    home: Address
    work: Address | None


class Node(BaseModel):
    value: int
    children: list[Node]


def _shipment() -> type[BaseModel]:
    """A model whose ``$defs`` also has an ``Address``, another than ``Person``'s."""

    class Address(BaseModel):
        zip: int

    class Shipment(BaseModel):
        to: Address

    return Shipment


# A recursive schema written against its own root, as zod-to-json-schema writes one.
TREE = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "const": "$ref"},
        "kids": {"type": "array", "items": {"$ref": "#"}},
        "again": {"$ref": "#/properties/label"},
    },
    "required": ["label", "kids"],
    "additionalProperties": False,
}


def _parameters() -> dict[str, dict[str, Any]]:
    tools = [openai.pydantic_function_tool(m) for m in (Person, Node, _shipment())]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    parameters["Tree"] = TREE
    # The same tree with the older keyword, and a name that another tool's $defs use.
    parameters["Node_defs"] = {
        "definitions": {"Node": {"type": "array", "items": {"$ref": "#/definitions/Node"}}},
        "type": "object",
        "properties": {"n": {"$ref": "#/definitions/Node"}},
    }
    return parameters


def _pointer(root: Any, ref: str) -> Any:
    target = root
    for token in ref[1:].split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        target = target[int(token)] if isinstance(target, list) else target[token]
    return target


def _expanded(schema: Any, root: Any, depth: int) -> Any:
    """``schema`` with each reference replaced by what it points at, ``depth`` levels deep;
    named subschemas left out (they are where references point, not what they mean)."""
    if isinstance(schema, list):
        return [_expanded(item, root, depth) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if isinstance(schema.get("$ref"), str):
        return _expanded(_pointer(root, schema["$ref"]), root, depth - 1) if depth else "..."
    return {
        key: _expanded(value, root, depth)
        for key, value in schema.items()
        if key not in ("$defs", "definitions")
    }


def _arguments(combined: dict[str, Any], index: int) -> Any:
    return combined["items"]["anyOf"][index]["properties"]["arguments"]


def _resolved(combined: dict[str, Any], schema: Any) -> Any:
    """The schema a call's arguments stand for (the tool's entry of ``$defs`` where its
    arguments are a reference to it)."""
    return _pointer(combined, schema["$ref"]) if set(schema) == {"$ref"} else schema


def test_each_tool_means_in_the_combined_schema_what_it_means_alone() -> None:
    parameters = _parameters()
    combined = calls_schema(parameters, one=False)
    for index, schema in enumerate(parameters.values()):
        alone = _expanded(schema, schema, depth=4)
        arguments = _resolved(combined, _arguments(combined, index))
        assert _expanded(arguments, combined, depth=4) == alone
    xgrammar.Grammar.from_json_schema(json.dumps(combined))  # the engine reads every reference


def test_names_two_tools_share_are_kept_apart_and_a_root_reference_is_the_tools_own() -> None:
    combined = calls_schema(_parameters(), one=True)
    defs = combined["$defs"]
    assert defs["Address"]["properties"] == {"city": {"title": "City", "type": "string"}}
    assert defs["Address_Shipment"]["properties"] == {"zip": {"title": "Zip", "type": "integer"}}
    assert _arguments(combined, 2)["properties"]["to"] == {"$ref": "#/$defs/Address_Shipment"}
    # Tree's "#" is Tree's arguments (moved to $defs for a name to point at), never the array.
    assert _arguments(combined, 3) == {"$ref": "#/$defs/Tree"}
    assert defs["Tree"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/Tree"}
    assert defs["Tree"]["properties"]["again"] == {"$ref": "#/$defs/Tree/properties/label"}
    assert defs["Tree"]["properties"]["label"]["const"] == "$ref"  # a value, not a reference
    assert defs["Node_Node_defs"]["items"] == {"$ref": "#/$defs/Node_Node_defs"}
    assert combined["maxItems"] == 1


def test_tools_without_references_are_as_before() -> None:
    weather = {"type": "object", "properties": {"city": {"type": "string"}}}
    assert calls_schema({"get_weather": weather}, one=False) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "properties": {"name": {"const": "get_weather"}, "arguments": weather},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        },
    }


def test_references_to_other_documents_and_anchors_are_left_as_they_are() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"$ref": "other.json#/x"}, "b": {"$ref": "#node"}},
    }
    combined = calls_schema({"f": schema}, one=False)
    assert combined["items"]["properties"]["arguments"] == schema and "$defs" not in combined
