"""The one JSON schema of ``tool_choice: "required"``: an array of calls, each a known name and
arguments valid against that tool's ``parameters`` (``calls_schema``).

A tool's references are written against its own ``parameters`` as the root (pydantic's
``#/$defs/Model``, a recursive ``#``), and in the combined schema that root is the array:
each tool's ``$defs`` (and older ``definitions``) move to the combined root, renamed where two
tools use one name, and its references are rewritten to match (``_Hoist``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["calls_schema"]

_DEFS = ("$defs", "definitions")  # where schemas keep named subschemas (2019-09+, draft 7)
_DATA = frozenset({"const", "enum", "default", "examples"})  # JSON values, not schemas
# Keywords whose value maps names (a property's, a subschema's) to schemas: a name is no keyword.
_NAMED = frozenset({"properties", "patternProperties", "dependentSchemas", *_DEFS})


def calls_schema(parameters: Mapping[str, dict[str, Any]], one: bool) -> dict[str, Any]:
    """An array of one or more calls (at most one with ``one``); ``parameters``: each tool's
    name and arguments schema, in the request's order."""
    defs: dict[str, Any] = {}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": _Hoist(name, defs).root(schema)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in parameters.items()
    ]
    array: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if one:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


class _Hoist:
    """One tool's ``parameters`` made to stand anywhere in the combined schema: its named
    subschemas go into the combined ``defs`` (each under a name no other tool took), and a
    reference to one is rewritten to its new place. A reference to anything else of the
    tool's own (``#``: the arguments object itself, as a recursive schema writes it, or a
    path inside it) makes the arguments one more entry of ``defs``, named for the tool, and
    is rewritten to point there. A reference to another document or to an anchor is left as
    it is."""

    def __init__(self, tool: str, defs: dict[str, Any]) -> None:
        self._tool = tool
        self._defs = defs
        self._renamed: dict[tuple[str, str], str] = {}  # (where, name) -> name in defs
        self._itself = ""  # the arguments' name in defs, once a reference needs it

    def root(self, schema: dict[str, Any]) -> dict[str, Any]:
        """The schema to stand as the call's ``arguments``."""
        named = [
            (where, name, sub)
            for where in _DEFS
            if isinstance(schema.get(where), dict)
            for name, sub in schema[where].items()
        ]
        for where, name, _ in named:
            self._renamed[(where, name)] = self._claim(name)
        body = {k: v for k, v in schema.items() if not (k in _DEFS and isinstance(v, dict))}
        if any(self._is_own(ref) for ref in _refs([body, *(sub for _, _, sub in named)])):
            self._itself = self._claim(self._tool)
        for where, name, sub in named:
            self._defs[self._renamed[(where, name)]] = _with_refs(sub, self._ref)
        if not self._itself:
            return _with_refs(body, self._ref)
        self._defs[self._itself] = _with_refs(body, self._ref)
        return {"$ref": f"#/$defs/{_escaped(self._itself)}"}

    def _claim(self, name: str) -> str:
        """``name``, or ``name_tool`` (then a count) where another tool took it already."""
        taken = self._defs
        free = name if name not in taken else f"{name}_{self._tool}"
        count = 2
        while free in taken:
            free, count = f"{name}_{self._tool}_{count}", count + 1
        taken[free] = None  # held until its schema is written
        return free

    def _is_own(self, ref: str) -> bool:
        """A reference to the arguments object or a path inside it (not a moved subschema)."""
        return _is_pointer(ref) and self._moved(ref) is None

    def _moved(self, ref: str) -> tuple[str, list[str]] | None:
        """A reference into the tool's named subschemas: their name in defs and the rest of
        the path; None for any other."""
        tokens = ref[1:].split("/")[1:]  # "#/$defs/A/b" -> ["$defs", "A", "b"]
        if len(tokens) < 2:
            return None
        renamed = self._renamed.get((tokens[0], _unescaped(tokens[1])))
        return None if renamed is None else (renamed, tokens[2:])

    def _ref(self, ref: str) -> str:
        if not _is_pointer(ref):
            return ref
        moved = self._moved(ref)
        if moved is not None:
            name, rest = moved
            return "/".join(["#", "$defs", _escaped(name), *rest])
        return f"#/$defs/{_escaped(self._itself)}{ref[1:]}"


def _is_pointer(ref: str) -> bool:
    """A JSON pointer into this document (``#``, ``#/...``); not another document's, nor an
    anchor's name (``#node``), which no move changes."""
    return ref == "#" or ref.startswith("#/")


def _refs(schema: Any) -> list[str]:
    found: list[str] = []

    def keep(ref: str) -> str:
        found.append(ref)
        return ref

    _with_refs(schema, keep)
    return found


def _with_refs(schema: Any, rewrite: Callable[[str], str]) -> Any:
    """``schema`` with each ``$ref`` string rewritten (JSON values, as ``const``'s, kept)."""
    if isinstance(schema, list):
        return [_with_refs(item, rewrite) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DATA:
            out[key] = value
        elif key == "$ref" and isinstance(value, str):
            out[key] = rewrite(value)
        elif key in _NAMED and isinstance(value, dict):  # names, each of a schema
            out[key] = {name: _with_refs(sub, rewrite) for name, sub in value.items()}
        else:
            out[key] = _with_refs(value, rewrite)
    return out


def _escaped(name: str) -> str:
    """A JSON pointer token (RFC 6901)."""
    return name.replace("~", "~0").replace("/", "~1")


def _unescaped(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")
