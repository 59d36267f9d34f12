"""SSE events from pre-built bytes: the parts of an event that stay the same from one event
of a stream to the next are encoded once, and each event encodes only what changes.

``sse(payload)`` encodes a whole event. ``EventTemplate`` is the same event with holes: the
payload is encoded once with a marker string in each hole and cut at the markers, and
``fill`` puts each value's JSON between the constant parts. The bytes are exactly what
``sse`` gives for the payload with the values in place (``tests/unit/test_sse_events.py``), since
msgspec encodes a value the same wherever it sits in a document."""

from __future__ import annotations

import msgspec

_json = msgspec.json.Encoder()
_encode = _json.encode

# Characters that JSON leaves as they are but that str.splitlines() ends a line at (NEL,
# LINE SEPARATOR, PARAGRAPH SEPARATOR, in UTF-8). SSE ends lines at CR and LF only, yet
# common clients read the stream with splitlines (httpx's aiter_lines, requests'
# iter_lines) and would cut an event whose text holds one; escaped, the JSON is the same.
_LINE_BREAKERS = (
    (b"\xc2\x85", b"\\u0085"),
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
)


def json_bytes(value: object) -> bytes:
    """``value`` as JSON that is one line for every line reader."""
    data = _encode(value)
    # Two byte scans when (as nearly always) neither lead byte occurs.
    if b"\xc2" in data or b"\xe2" in data:
        for raw, escaped in _LINE_BREAKERS:
            data = data.replace(raw, escaped)
    return data


def sse(payload: object) -> bytes:
    return b"data: " + json_bytes(payload) + b"\n\n"


class Hole:
    """Marks where a value goes in a template's payload. Each hole of a template must be a
    different Hole; they are filled in the order they occur in the encoded payload, which
    for msgspec is the order of the payload's keys."""

    __slots__ = ("marker",)

    def __init__(self) -> None:
        # NUL never reaches JSON unescaped, so the encoded marker cannot occur by chance
        # in the constant parts unless a string there holds this very text. The id keeps
        # the holes of one payload (all alive together) apart.
        self.marker = f"\x00tokenpipe-hole-{id(self)}\x00"


def _holes_in(value: object, found: list[Hole]) -> object:
    """``value`` with each Hole replaced by its marker string; ``found`` collects them."""
    if isinstance(value, Hole):
        found.append(value)
        return value.marker
    if isinstance(value, dict):
        return {k: _holes_in(v, found) for k, v in value.items()}
    if isinstance(value, list):
        return [_holes_in(v, found) for v in value]
    return value


class TemplateError(ValueError):
    """The payload's constant parts hold a hole's marker text: use ``sse`` for it."""


class EventTemplate:
    """An SSE event whose holes are filled per event; see the module docstring."""

    __slots__ = ("_parts", "_first", "_last")

    def __init__(self, payload: object) -> None:
        holes: list[Hole] = []
        encoded = sse(_holes_in(payload, holes))
        parts = [encoded]
        for hole in holes:
            head, sep, tail = parts.pop().partition(_encode(hole.marker))
            if (
                not sep
                or _encode(hole.marker) in tail
                or any(_encode(h.marker) in head for h in holes)
            ):
                raise TemplateError("a hole's marker occurs in the template's constant parts")
            parts += [head, tail]
        self._parts = tuple(parts)
        self._first = parts[0]
        self._last = parts[-1]

    def fill(self, *values: object) -> bytes:
        parts = self._parts
        if len(values) == 1:
            return self._first + json_bytes(values[0]) + self._last
        out = [parts[0]]
        for value, part in zip(values, parts[1:]):
            # A plain int's JSON is its digits (a bool, an int too, is not: hence ``type``).
            out.append(b"%d" % value if type(value) is int else json_bytes(value))
            out.append(part)
        return b"".join(out)
