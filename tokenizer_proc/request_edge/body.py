"""Request bodies decoded into typed structs. Decoding with msgspec is the validation: a wrong
type, an unknown key or a value out of range fails with a ``RequestValidationError`` whose
message names the field (``... - at `$.sampling_params.max_new_tokens```) and whose ``param``
is that field's path."""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

from tokenizer_proc.request_edge.errors import RequestValidationError

_T = TypeVar("_T")


def decode_body(body: bytes, type_: type[_T]) -> _T:
    """Decodes a JSON body into ``type_``; every failure is a RequestValidationError."""
    if not body:
        raise RequestValidationError("request body is empty; expected a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(f"request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        obj = msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(str(exc), _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deep nesting inside a free-form (Any) field
        raise RequestValidationError("request body is nested too deeply") from exc
    if _LONG_DIGITS.search(body) is not None:
        where = _int_out_of_range(obj)
        if where is not None:
            message = f"Integer out of range: must fit a signed 64-bit integer - at `{where}`"
            raise RequestValidationError(message, _param_of(message))
    return obj


def convert_body(obj: object, type_: type[_T]) -> _T:
    """``decode_body`` for a body already decoded to Python objects (one item of a /generate
    batch): the same type checks, and the same messages."""
    try:
        converted = msgspec.convert(obj, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(str(exc), _param_of(str(exc))) from exc
    where = _int_out_of_range(converted)
    if where is not None:
        message = f"Integer out of range: must fit a signed 64-bit integer - at `{where}`"
        raise RequestValidationError(message, _param_of(message))
    return converted


# msgspec decodes a JSON integer of any size into an `int` field, but no wire field can carry
# one beyond 64 bits (msgpack) and no field means anything there: refuse it as the client's
# error here rather than fail with a 500 when the request is encoded for the scheduler. Only an
# integer literal of 19 or more digits can be out of range, so other bodies skip the walk.
_LONG_DIGITS = re.compile(rb"\d{19}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int_out_of_range(obj: object) -> str | None:
    """The path (``$.sampling_params.top_k``) of an int outside int64, or None."""
    stack: list[tuple[object, str]] = [(obj, "$")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                return path
        elif isinstance(value, msgspec.Struct):
            stack.extend(
                (getattr(value, name), f"{path}.{name}") for name in value.__struct_fields__
            )
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, dict):
            stack.extend((item, f"{path}.{key}") for key, item in value.items())
    return None


def _param_of(message: str) -> str | None:
    """``... - at `$.sampling_params.top_p``` -> ``sampling_params.top_p``; an unknown key
    names itself: ``Object contains unknown field `foo` - at `$.x``` -> ``x.foo``; a value of
    an object names the object: ``- at `$.logit_bias[...]``` -> ``logit_bias``."""
    marker = "- at `$."
    at = message.rfind(marker)
    where = message[at + len(marker) :].rstrip("`").removesuffix("[...]") if at >= 0 else None
    unknown = "unknown field `"
    if message.startswith("Object contains " + unknown):
        name = message[len("Object contains " + unknown) :].split("`", 1)[0]
        return f"{where}.{name}" if where else name
    return where
