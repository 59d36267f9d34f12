"""Every field of every Responses input item is checked as a body field is (docs/api.md, "The
Responses API"): each item type, and each kind of content part, with each field given a
value of every wrong JSON type (and each enumerated field a wrong string), and with each
required field left out, is a 400 whose JSON error names the field (``input[i].field``,
``input[i].content[0].text``): never a 500. On the shared server; the cases are generated
from the table of fields below, and none of them generates a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.server_harness import ServerProcess

MODEL = "tokenpipe-tiny"
JSON_VALUES: dict[str, Any] = {
    "null": None,
    "boolean": True,
    "integer": 7,
    "number": 1.5,
    "string": "x",
    "array": [],
    "object": {},
}
STR, LIST = frozenset({"string"}), frozenset({"array"})


@dataclass(frozen=True)
class Field:
    """A field's accepted JSON types (null is "left out" for an optional field), whether it
    is required, and a string its enumeration refuses (None: any string is a value)."""

    kinds: frozenset[str]
    required: bool = False
    bad_string: str | None = None


@dataclass(frozen=True)
class Shape:
    """A valid object and its fields; ``parts``: a list field's valid first element and its
    shape."""

    valid: dict[str, Any]
    fields: dict[str, Field]
    parts: dict[str, Shape] = field(default_factory=dict)


def _part(kind: str, text_field: str = "text", **more: Field) -> Shape:
    return Shape(
        {"type": kind, text_field: "hi"},
        {"type": Field(STR, True, "x"), text_field: Field(STR, True), **more},
    )


INPUT_TEXT = _part("input_text")
OUTPUT_TEXT = _part("output_text", annotations=Field(LIST), logprobs=Field(LIST))
STATUS = Field(STR, bad_string="x")
CALL = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"}


def _message(role: str, part: Shape) -> Shape:
    return Shape(
        {"type": "message", "role": role, "content": [part.valid]},
        {
            "type": Field(STR, bad_string="x"),  # a message may leave it out
            "role": Field(STR, True, "x"),
            "content": Field(STR | LIST, True),
            "id": Field(STR),
            "status": STATUS,
        },
        {"content": part},
    )


# (the items before the one checked, the one checked)
ITEMS: dict[str, tuple[list[dict[str, Any]], Shape]] = {
    "user-message": ([], _message("user", INPUT_TEXT)),
    "assistant-message": ([], _message("assistant", OUTPUT_TEXT)),
    "refusal-part": ([], _message("assistant", _part("refusal", "refusal"))),
    "function_call": (
        [],
        Shape(
            CALL,
            {
                "type": Field(STR, True, "x"),
                "call_id": Field(STR, True),
                "name": Field(STR, True),
                "arguments": Field(STR, True),
                "id": Field(STR),
                "status": STATUS,
            },
        ),
    ),
    "function_call_output": (
        [CALL],
        Shape(
            {"type": "function_call_output", "call_id": "c1", "output": [INPUT_TEXT.valid]},
            {
                "type": Field(STR, True, "x"),
                "call_id": Field(STR, True),
                "output": Field(STR | LIST, True),
                "id": Field(STR),
                "status": STATUS,
            },
            {"output": INPUT_TEXT},
        ),
    ),
    "reasoning": (
        [{"role": "user", "content": "hi"}],  # a conversation of reasoning alone has no turn
        Shape(
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "hi"}],
                "content": [{"type": "reasoning_text", "text": "hi"}],
            },
            {
                "type": Field(STR, True, "x"),
                "id": Field(STR),
                "summary": Field(LIST),
                "content": Field(LIST),
                "encrypted_content": Field(frozenset()),  # none can be read here
                "status": STATUS,
            },
            {"summary": _part("summary_text"), "content": _part("reasoning_text")},
        ),
    ),
}


def bad_cases(shape: Shape, where: str) -> list[tuple[dict[str, Any], str]]:
    """(the object with one field wrong, the field's name) for every wrong JSON type of
    every field, every enumeration's wrong string, and every required field left out; the
    same for the first element of each list of parts."""
    cases = []
    for name, spec in shape.fields.items():
        at = f"{where}.{name}"
        if spec.required:
            cases.append(({k: v for k, v in shape.valid.items() if k != name}, at))
        for kind, value in JSON_VALUES.items():
            if kind not in spec.kinds and (spec.required or value is not None):
                cases.append(({**shape.valid, name: value}, at))
        if spec.bad_string is not None:
            cases.append(({**shape.valid, name: spec.bad_string}, at))
    for name, part in shape.parts.items():
        for bad_part, at in bad_cases(part, f"{where}.{name}[0]"):
            cases.append(({**shape.valid, name: [bad_part]}, at))
    return cases


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Any:
    with server.client() as client:
        yield client


def _post(http: httpx.Client, items: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": MODEL, "input": items, "max_output_tokens": 1, "store": False}
    return http.post("/v1/responses", json=body)


@pytest.mark.parametrize("kind", list(ITEMS))
def test_every_wrong_field_of_an_input_item_is_a_400_naming_it(
    http: httpx.Client, kind: str
) -> None:
    before, shape = ITEMS[kind]
    # The valid item is valid: every refusal below is the one field's doing.
    assert _post(http, [*before, shape.valid]).status_code == 200
    wrong = []
    cases = bad_cases(shape, f"input[{len(before)}]")
    for item, param in cases:
        response = _post(http, [*before, item])
        error = response.json().get("error") if response.status_code == 400 else None
        if error is None or error.get("param") != param or param not in error.get("message", ""):
            wrong.append(f"{item} -> {response.status_code} {response.text[:300]} (want {param})")
    assert not wrong, f"{len(wrong)} of {len(cases)} cases:\n" + "\n".join(wrong)
