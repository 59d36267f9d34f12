"""Request bodies decoded into typed structs. Decoding with msgspec is the validation: a wrong
type or a value out of range fails with a ``RequestValidationError`` whose message names the
field (``... - at `$.sampling_params.max_new_tokens```) and whose ``param`` is that field's path.

A field no schema knows is the caller's choice (docs/api.md, "Unknown fields"): given a list
(``ignored``), the decode drops every such field and notes its path there (``foo``,
``sampling_params.bar``, ``messages[0].baz``); without one, the first is a 400. A valid body
is decoded once, straight from its bytes, either way: only a body that names an unknown field
is decoded again."""

from __future__ import annotations

import functools
import json
import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.peer_wording import decode_message

_T = TypeVar("_T")


def decode_body(body: bytes, type_: type[_T], ignored: list[str] | None = None) -> _T:
    """Decodes a JSON body into ``type_``; every failure is a RequestValidationError. With
    ``ignored``, unknown fields are dropped and their paths appended to it."""
    if not body:
        raise RequestValidationError("request body is empty; expected a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(f"request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        obj = _decode(body, type_, ignored)
    except msgspec.ValidationError as exc:
        message = decode_message(str(exc), type_)  # the peers' words, if theirs
        raise RequestValidationError(message, _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deep nesting inside a free-form (Any) field
        raise RequestValidationError("request body is nested too deeply") from exc
    if _LONG_DIGIT_RUN in body.translate(_DIGITS_AS_ZERO):
        _refuse_int_out_of_range(obj)
    return obj


def convert_body(obj: object, type_: type[_T], ignored: list[str] | None = None) -> _T:
    """``decode_body`` for a body already decoded to Python objects (one item of a /generate
    batch): the same type checks, the same messages and the same ``ignored``. The unknown
    fields it drops are removed from ``obj``."""
    try:
        converted = _convert(obj, type_, ignored)
    except msgspec.ValidationError as exc:
        message = decode_message(str(exc), type_)  # the peers' words, if theirs
        raise RequestValidationError(message, _param_of(str(exc))) from exc
    _refuse_int_out_of_range(converted)
    return converted


def _decode(body: bytes, type_: type[_T], ignored: list[str] | None) -> _T:
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        if ignored is None or not _names_unknown_field(exc):
            raise
    return _convert_known(msgspec.json.decode(body), type_, ignored)


def _convert(obj: object, type_: type[_T], ignored: list[str] | None) -> _T:
    try:
        return msgspec.convert(obj, type=type_)
    except msgspec.ValidationError as exc:
        if ignored is None or not _names_unknown_field(exc):
            raise
    return _convert_known(obj, type_, ignored)


def _convert_known(obj: object, type_: type[_T], ignored: list[str]) -> _T:
    """``obj`` (decoded JSON) without its unknown fields, converted: one pass of the schema
    over it, linear in the body however many unknown fields it has. Whatever else is wrong
    then fails as it would have."""
    # Type objects are hashable; mypy's Hashable takes none (python/mypy#11470).
    _drop_unknown(obj, _schema(type_), "", ignored)  # type: ignore[arg-type]
    return msgspec.convert(obj, type=type_)


def _names_unknown_field(exc: msgspec.ValidationError) -> bool:
    return str(exc).startswith("Object contains unknown field `")


@functools.cache
def _schema(type_: type[Any]) -> mi.Type:
    """``type_`` as msgspec describes it: built once per body type (a few milliseconds), by
    the first body that names an unknown field."""
    return mi.type_info(type_)


def _drop_unknown(value: object, type_: mi.Type, path: str, dropped: list[str]) -> None:
    """Removes from ``value`` (decoded JSON) each key that the struct it decodes into does not
    know and refuses (``forbid_unknown_fields``), appending each key's path to ``dropped``.
    A value that does not fit ``type_`` is left for the decode to refuse."""
    type_ = _bare(type_)
    members = tuple(map(_bare, type_.types)) if isinstance(type_, mi.UnionType) else (type_,)
    if isinstance(value, dict):
        struct = _struct_for(value, members)
        if struct is not None:
            _drop_from_struct(value, struct, path, dropped)
            return
        for member in members:
            if isinstance(member, mi.DictType):
                for key, item in value.items():
                    _drop_unknown(item, member.value_type, field_path(path, key), dropped)
    elif isinstance(value, list):
        for member in members:
            if isinstance(member, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
                for i, item in enumerate(value):
                    _drop_unknown(item, member.item_type, f"{path}[{i}]", dropped)
            elif isinstance(member, mi.TupleType):
                for i, (item, item_type) in enumerate(zip(value, member.item_types)):
                    _drop_unknown(item, item_type, f"{path}[{i}]", dropped)


def _bare(type_: mi.Type) -> mi.Type:
    """``type_`` without the JSON Schema metadata some fields carry."""
    return type_.type if isinstance(type_, mi.Metadata) else type_


def _struct_for(value: dict[Any, Any], members: tuple[mi.Type, ...]) -> mi.StructType | None:
    """The struct a JSON object decodes into: the one struct of a union, or of a tagged union
    the one whose tag it carries (msgspec allows no other kind of union of objects)."""
    structs = [m for m in members if isinstance(m, mi.StructType)]
    if len(structs) == 1:
        return structs[0]
    for struct in structs:
        if struct.tag_field is not None and value.get(struct.tag_field) == struct.tag:
            return struct
    return None


def _drop_from_struct(
    value: dict[Any, Any], struct: mi.StructType, path: str, dropped: list[str]
) -> None:
    fields = {field.encode_name: field.type for field in struct.fields}
    for key in list(value):
        field_type = fields.get(key)
        if field_type is not None:
            _drop_unknown(value[key], field_type, field_path(path, key), dropped)
        elif struct.forbid_unknown_fields and key != struct.tag_field:
            del value[key]
            dropped.append(field_path(path, key))


_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def field_path(path: str, key: str) -> str:
    """``path.key``; a key that is not a plain name is written as a JSON string in brackets
    (ASCII, commas escaped too), so that a list of paths is safe in a header and in a log."""
    if _PLAIN_KEY.fullmatch(key):
        return f"{path}.{key}" if path else key
    quoted = json.dumps(key).replace(",", "\\u002c")
    return f"{path}[{quoted}]"


# msgspec decodes a JSON integer of any size into an `int` field, but no wire field can carry
# one beyond 64 bits (msgpack) and no field means anything there: refuse it as the client's
# error here rather than fail with a 500 when the request is encoded for the scheduler. Only an
# integer literal of 19 or more digits can be out of range, so other bodies skip the walk. The
# body is searched for a run of 19 digits with every digit made a 0: bytes.translate and a
# substring search, an order of magnitude faster than a regex scan (on every body).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGIT_RUN = b"0" * 19
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _refuse_int_out_of_range(obj: object) -> None:
    where = _int_out_of_range(obj)
    if where is not None:
        message = f"Integer out of range: must fit a signed 64-bit integer - at `{where}`"
        raise RequestValidationError(message, _param_of(message))


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
