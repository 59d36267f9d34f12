"""One client body split into the two bodies of a PD pair: the prefill half's (never
streamed) and the decode half's (as the client asked), both with the same bootstrap room."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

_ROOM_BITS = 63  # the room is an int64 on the wire and must not be negative
_encode = msgspec.json.Encoder().encode
# Every way a body can name the pairing, SGLang's host/port form included.
_BOOTSTRAP_FIELDS = frozenset({"bootstrap_room", "bootstrap_endpoint", "bootstrap_host", "bootstrap_port"})


class BadBody(ValueError):
    """A body the router cannot split; the client gets a 400 with this message."""


@dataclass(frozen=True, slots=True)
class PairBodies:
    prefill: bytes
    decode: bytes
    rid: str | None  # /generate: the decode half's rid, so the router can abort it by rid


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadBody(f"the request body must be a JSON object, but it is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise BadBody(f"the request body must be a JSON object, not a JSON {_kind(obj)}")
    return obj


def pair_bodies(obj: dict[str, Any], bootstrap_endpoint: str, *, native: bool) -> PairBodies:
    """``native``: a ``/generate`` body, which gets a ``rid`` when the client gave none."""
    # The router owns the pairing: a room the client chose could collide with another's.
    decode = {key: value for key, value in obj.items() if key not in _BOOTSTRAP_FIELDS}
    decode.update(bootstrap_room=secrets.randbits(_ROOM_BITS), bootstrap_endpoint=bootstrap_endpoint)
    rid = None
    if native:
        if decode.get("rid") is None:
            decode["rid"] = f"pd-{uuid.uuid4().hex}"
        # A rid of the wrong type gets the servers' 400; there is nothing to abort then.
        rid = decode["rid"] if isinstance(decode["rid"], str) else None
    prefill = dict(decode, stream=False)
    prefill.pop("stream_options", None)  # the servers refuse stream_options without stream: true
    return PairBodies(prefill=_encode(prefill), decode=_encode(decode), rid=rid)


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
