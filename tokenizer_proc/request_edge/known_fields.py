"""Request fields tokenpipe knows but does not implement (docs/design.md section 12).

Clients and routers send the fields of their own schemas: SGLang's router re-serializes every
body with its defaults (``"return_hidden_states": false``...), vLLM's clients send its extra
sampling parameters. A field tokenpipe does not implement is accepted at a neutral value (null,
or a value that asks for nothing) and refused with a 400 naming it otherwise (ignored, it would
give wrong output); a field in none of the schemas is ``decode_body``'s to ignore and name.

Each request type keeps its refusals in one table of ``Refusal`` entries. ``neutral`` makes
the common entry (a field that is fine at these values and nothing else); ``declare`` adds the
table's fields that the request type does not declare itself, typed ``Any`` with a null
default, so decoding accepts them and the table alone decides.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import msgspec

from tokenizer_proc.request_edge.errors import RequestValidationError

# (field, does this value ask for something unsupported?, what to say)
Refusal = tuple[str, Callable[[object], bool], str]

S = TypeVar("S", bound=msgspec.Struct)


def is_neutral(value: object, neutrals: Sequence[object]) -> bool:
    """Null, or equal to one of ``neutrals``: booleans only to booleans (``0`` is not
    ``false``), numbers by value (``1`` is ``1.0``)."""
    return value is None or any(_same(value, n) for n in neutrals)


def _same(value: object, neutral: object) -> bool:
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    if isinstance(neutral, (int, float)):
        return isinstance(value, (int, float)) and value == neutral
    return bool(value == neutral)


@dataclass(frozen=True, slots=True)
class AsksUnlessNeutral:
    """The check of a ``neutral`` entry: a value asks for something unless it is null or
    one of ``values``."""

    values: tuple[object, ...]

    def __call__(self, value: object) -> bool:
        return not is_neutral(value, self.values)


def neutral(field: str, *values: object) -> Refusal:
    """``field`` is accepted when null or one of ``values``, and refused otherwise with a
    message that says what would be accepted."""
    shown = ", ".join(json.dumps(v) for v in values)
    accepted = f"send {shown} or null, or leave it out" if values else "send null or leave it out"
    return (
        field,
        AsksUnlessNeutral(values),
        f"{field} is not supported by this server ({accepted})",
    )


def refuse(obj: object, refusals: Sequence[Refusal], where: str = "") -> None:
    """Raises RequestValidationError for the first field of ``obj`` that asks for something
    this server does not have. ``where`` is the path of ``obj`` in the body (a nested
    struct's), and prefixes the message and the param."""
    for name, asks, message in refusals:
        if asks(getattr(obj, name)):
            raise RequestValidationError(where + message, where + name)


def declare(base: type[S], refusals: Sequence[Refusal]) -> type[S]:
    """``base`` with a field (``Any``, default null) for each refused name it lacks. The new
    type keeps the base's name, methods and strictness about unknown fields."""
    own = set(base.__struct_fields__)
    extra = [(name, Any, None) for name, _, _ in refusals if name not in own]
    # defstruct is typed to return a Struct type; with bases=(base,) it is a subclass of base.
    return cast(
        type[S],
        msgspec.defstruct(
            base.__name__,
            extra,
            bases=(base,),
            module=base.__module__,
            forbid_unknown_fields=True,
            kw_only=True,
        ),
    )
