"""The JSON Schemas the engine can enforce, checked where a schema enters the API (docs/api.md,
"Structured outputs"): a keyword that xgrammar 0.2.9 compiles and then ignores, so that an
answer could break it, is a 400 naming the request's field, the keyword and where it sits in
the schema (a JSON pointer), as vLLM refuses what xgrammar cannot enforce; so is a schema
nested deeper than ``MAX_SCHEMA_DEPTH`` (its compile time grows steeply with depth), before
the scheduler compiles anything. Whatever passes here the engine judges when it compiles.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = ["MAX_SCHEMA_DEPTH", "check_schema"]

MAX_SCHEMA_DEPTH = 64  # schemas within schemas; real ones nest a few levels, 64 compile at once

# Where a schema holds schemas: one, a list of them, or a map of names to them. Data
# (const, enum, default, examples) is never read as a schema.
_ONE = (
    "additionalProperties",
    "unevaluatedProperties",
    "propertyNames",
    "items",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
)
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")

# Keywords the engine compiles and then ignores, and why an answer could break them.
_IGNORED = {
    "not": "the engine cannot exclude what a schema matches",
    "contains": "the engine cannot require one of an array's items to match a schema",
    "if": "the engine does not apply conditional schemas (if/then/else)",
    "then": "the engine does not apply conditional schemas (if/then/else)",
    "else": "the engine does not apply conditional schemas (if/then/else)",
    "dependentRequired": "the engine does not apply dependencies between properties",
    "dependentSchemas": "the engine does not apply dependencies between properties",
    "dependencies": "the engine does not apply dependencies between properties",
    "$dynamicRef": "the engine does not resolve dynamic references",
    "$recursiveRef": "the engine does not resolve dynamic references",
}
# The engine applies one of these alone, and ignores an assertion beside it.
_COMBINATORS = ("$ref", "allOf", "anyOf", "oneOf")
_ASSERTIONS = frozenset(
    {
        *_ONE,
        *_LISTS,
        *_MAPS,
        *_IGNORED,
        "type",
        "enum",
        "const",
        "required",
        "minProperties",
        "maxProperties",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
    }
) - {"$defs", "definitions"}
_RANGE = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_MAX_MULTIPLE = 1024  # the largest divisor xgrammar 0.2.9 enforces on an unbounded integer
_LOOKAROUND = ("(?=", "(?!", "(?<=", "(?<!")


def check_schema(schema: dict[str, Any], param: str) -> None:
    """Raises a RequestValidationError naming ``param`` when ``schema`` nests too deep or
    uses a keyword the engine would not enforce (the module docstring)."""
    for path, sub, depth in _schemas(schema, "#", 1):
        if depth > MAX_SCHEMA_DEPTH:
            raise RequestValidationError(
                f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (at {path})",
                param,
            )
        problem = _problem(sub, path)
        if problem is not None:
            raise RequestValidationError(f"{param}: {problem}", param)


def _schemas(
    schema: dict[str, Any], path: str, depth: int
) -> Iterator[tuple[str, dict[str, Any], int]]:
    """Every schema in ``schema``, itself first, with its JSON pointer and its depth (the
    walk stops below ``MAX_SCHEMA_DEPTH``, so it never recurses far)."""
    yield path, schema, depth
    if depth > MAX_SCHEMA_DEPTH:
        return
    for key, value in schema.items():
        here = f"{path}/{_escaped(key)}"
        if key in _ONE and isinstance(value, dict):
            yield from _schemas(value, here, depth + 1)
        if key in _LISTS and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    yield from _schemas(item, f"{here}/{i}", depth + 1)
        if key in _MAPS and isinstance(value, dict):
            for name, item in value.items():
                if isinstance(item, dict):
                    yield from _schemas(item, f"{here}/{_escaped(name)}", depth + 1)


def _problem(schema: dict[str, Any], path: str) -> str | None:
    """Why the engine would not enforce ``schema`` (at ``path``) itself, or None."""
    for key, why in _IGNORED.items():
        if key in schema:
            return f"{key} at {path}/{_escaped(key)}: {why}"
    if schema.get("uniqueItems", False) is not False:
        return (
            f"uniqueItems at {path}/uniqueItems: the engine cannot keep an array's items distinct"
        )
    return (
        _multiple_problem(schema, path)
        or _combinator_problem(schema, path)
        or _string_problem(schema, path)
        or _required_problem(schema, path)
    )


def _multiple_problem(schema: dict[str, Any], path: str) -> str | None:
    if "multipleOf" not in schema:
        return None
    value = schema["multipleOf"]
    enforced = (
        schema.get("type") == "integer"
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and value == int(value)
        and 1 <= value <= _MAX_MULTIPLE
        and not any(key in schema for key in _RANGE)
    )
    if enforced:
        return None
    return (
        f"multipleOf at {path}/multipleOf: the engine enforces it only on an integer without "
        f"minimum or maximum, by a whole number up to {_MAX_MULTIPLE}"
    )


def _combinator_problem(schema: dict[str, Any], path: str) -> str | None:
    given = [key for key in _COMBINATORS if key in schema]
    if not given:
        return None
    first = given[0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key) == []:
            return f"{key} at {path}/{key}: an empty {key} matches nothing"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return (
            f"allOf at {path}/allOf: the engine does not combine several schemas (it would "
            "apply none of them): merge them into one"
        )
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return (
            f"$ref at {path}/$ref: {ref!r} is outside the schema; only references within it "
            "('#...') are resolved"
        )
    beside = [key for key in schema if key in _ASSERTIONS and key != first]
    if beside:
        return (
            f"{beside[0]} at {path}/{_escaped(beside[0])}: the engine applies {first} alone "
            f"and would ignore {beside[0]} beside it (move it into the schema {first} gives)"
        )
    return None


def _string_problem(schema: dict[str, Any], path: str) -> str | None:
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _has_lookaround(pattern):
        return (
            f"pattern at {path}/pattern: lookaround ((?=, (?!, (?<=, (?<!) is not enforced by "
            "the engine"
        )
    shaped = "pattern" if "pattern" in schema else "format" if "format" in schema else None
    length = next((key for key in ("minLength", "maxLength") if key in schema), None)
    if shaped is not None and length is not None:
        return (
            f"{length} at {path}/{length}: the engine enforces {shaped} alone and would ignore "
            f"{length} beside it (write the length into a pattern)"
        )
    return None


def _required_problem(schema: dict[str, Any], path: str) -> str | None:
    required = schema.get("required")
    if not isinstance(required, list) or "patternProperties" in schema:
        return None
    listed = schema.get("properties")
    listed = listed if isinstance(listed, dict) else {}
    missing = [name for name in required if isinstance(name, str) and name not in listed]
    if not missing:
        return None
    return (
        f"required at {path}/required: {missing[0]!r} is not in properties, and the engine "
        "writes only the properties a schema lists"
    )


def _has_lookaround(pattern: str) -> bool:
    """Whether ``pattern`` has a lookahead or lookbehind group (escapes and character
    classes read as such)."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1
            i += pattern.startswith("^", i)
            i += pattern.startswith("]", i)  # a "]" first in a class is a character
            continue
        elif pattern.startswith(_LOOKAROUND, i):
            return True
        i += 1
    return False


def _escaped(name: str) -> str:
    """A name as a JSON pointer writes it (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")
