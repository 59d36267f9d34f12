"""The parts the tool-call formats share: one call's JSON object scanned as its text arrives
(``CallObject``), where a JSON value ends (``JsonScanner``), what one ``feed`` says
(``DeltaSink``), and the text tests around the call markers.

Why a scanner of our own: a call's arguments are sent as the model's own text, so the parser
must know where, in the raw text, the arguments value and the call's object end (a
``</tool_call>`` inside a JSON string is not the end of a block), and neither ``json`` nor
``partial_json_parser`` says that of text still arriving. ``JsonScanner`` tracks only the
lexical structure; values are still read by ``json``. State carries over between pieces, so
where the text was split never changes a decision.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import replace

# It ships no type information; "unused-ignore" keeps this line right once the project's mypy
# config names it among the untyped modules.
import partial_json_parser

from tokenizer_proc.parsers.markers import WHITESPACE
from tokenizer_proc.parsers.tool_calls import ToolCallDelta, ToolParseDelta

__all__ = ["CallObject", "DeltaSink", "JsonScanner", "Scan"]

ARGUMENT_KEYS = frozenset({"arguments", "parameters"})
"""The keys of the arguments object: ``parameters`` is Llama 3's, ``arguments`` everyone's."""

# Inside a string, the characters that end a run of plain text: the closing quote, an escape,
# and the control characters JSON forbids there.
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
# Outside strings, a run of characters that change no structure: whitespace, separators, and
# the characters of numbers, true, false and null.
_PLAIN_RUN = re.compile(r"[ \t\n\r,:0-9.eE+\-truefalsn]*")
_SCALAR_START = frozenset("-0123456789tfn")
_SCALAR_CHARS = frozenset("-+.0123456789eEtruefalsn")
_CLOSER = {"}": "{", "]": "["}


class Scan(enum.Enum):
    """How a scan of a piece of text ended."""

    MORE = "more"  # all of it was taken; the value or object goes on
    DONE = "done"  # it ended within the piece
    BROKEN = "broken"  # it cannot be JSON: the character where the scan stopped is the culprit


class JsonScanner:
    """Finds where one JSON value ends, in text that arrives in pieces.

    Knows strings, escapes and the stack of open brackets, and which characters may stand
    outside strings; it does not check the grammar between them (``{"a" 1}`` passes), which
    ``json.loads`` of the finished value does where it matters. A number or literal at the
    top level ends at the first character that cannot continue it, which is not taken.
    """

    __slots__ = ("_escape", "_in_string", "_scalar", "_stack", "_started")

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False
        self._scalar = False
        self._started = False

    def scan(self, text: str, start: int) -> tuple[int, Scan]:
        """Takes ``text[start:]``; returns where it stopped: after the value's end (DONE),
        at a character that cannot be there (BROKEN), or at the end of the text (MORE)."""
        i, n = start, len(text)
        while i < n:
            if self._in_string:
                if self._escape:  # the escaped character; json.loads judges the escape
                    self._escape = False
                    i += 1
                    continue
                found = _STRING_STOP.search(text, i)
                if found is None:
                    return n, Scan.MORE
                i = found.start()
                char = text[i]
                if char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
                    if not self._stack:
                        return i + 1, Scan.DONE
                else:
                    return i, Scan.BROKEN  # a raw control character: JSON wants it escaped
                i += 1
                continue
            char = text[i]
            if self._scalar:
                if char not in _SCALAR_CHARS:
                    return i, Scan.DONE
                i += 1
                continue
            if not self._started:
                self._started = True
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._stack.append(char)
                elif char in _SCALAR_START:
                    self._scalar = True
                else:
                    return i, Scan.BROKEN
                i += 1
                continue
            if char in "{[":
                self._stack.append(char)
            elif char in "}]":
                if self._stack.pop() != _CLOSER[char]:
                    return i, Scan.BROKEN
                if not self._stack:
                    return i + 1, Scan.DONE
            elif char == '"':
                self._in_string = True
            else:
                run = _PLAIN_RUN.match(text, i)
                end = run.end() if run else i
                if end == i:
                    return i, Scan.BROKEN
                i = end
                continue
            i += 1
        return n, Scan.MORE


class DeltaSink:
    """What one ``feed`` says, gathered while the text is scanned, and the answer's call
    numbering. ``take`` hands it over and starts the next feed's.

    Consecutive pieces of the same call are merged, so a call whose header and arguments are
    found in one feed is one delta.
    """

    __slots__ = ("_call_ids", "_calls", "_content", "_deltas")

    def __init__(self, call_ids: Callable[[], str]) -> None:
        self._call_ids = call_ids
        self._calls = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    @property
    def calls(self) -> int:
        """How many calls the answer has made so far."""
        return self._calls

    def content(self, text: str) -> None:
        if text:
            self._content.append(text)

    def start_call(self, name: str) -> int:
        """The header of the next call; returns its index."""
        index = self._calls
        self._calls += 1
        self._deltas.append(
            ToolCallDelta(index=index, id=self._call_ids(), name=name, arguments="")
        )
        return index

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self._deltas and self._deltas[-1].index == index:
            last = self._deltas[-1]
            self._deltas[-1] = replace(last, arguments=last.arguments + text)
        else:
            self._deltas.append(ToolCallDelta(index=index, id=None, name=None, arguments=text))

    def take(self) -> ToolParseDelta:
        delta = ToolParseDelta(content="".join(self._content), tool_calls=tuple(self._deltas))
        self._content = []
        self._deltas = []
        return delta


class _At(enum.Enum):
    """Where ``CallObject`` is in the call's object."""

    OPEN = 0  # before its "{"
    FIRST_KEY = 1  # after "{": a key or "}"
    KEY = 2  # after ",": a key
    IN_KEY = 3
    COLON = 4
    VALUE = 5  # after ":", before the value
    IN_VALUE = 6
    AFTER_VALUE = 7  # "," or "}"


class _Role(enum.Enum):
    NAME = 0
    ARGUMENTS = 1
    OTHER = 2


class CallObject:
    """One call's JSON object, ``{"name": ..., "arguments": {...}}``, scanned as it arrives,
    sending to the sink what becomes certain.

    The rule that decides whether the object is a call: it becomes one when its ``"name"``
    string is complete, is a name of ``tool_names`` (any name when that is empty), and the
    text before it is valid JSON so far (each member read by ``json.loads``). The header
    (index, id, name) is sent at that moment, then the arguments text so far. Before then,
    a break (text that cannot be JSON, a value that does not load, a name that is not a
    known string, the object closing without a name) means no call: ``push`` says BROKEN with
    ``started`` False and the format gives the text back as content.

    Once started it stays a call. Its arguments are the text of the first ``arguments`` (or
    ``parameters``) member whose value is an object, sent as it arrives and not re-read; any
    other value there counts as missing. After the header only the lexical structure is
    checked, to find the end: if the object breaks or never closes, the arguments are what
    was sent, closed by ``partial_json_parser``'s completion where appending it makes a JSON
    object (``{"a": [1`` gets ``]}``), and ``"{}"`` if none was sent (see ``end``).

    Cost: one pass over each call's text (strings and runs of plain characters are skipped
    with one regex step each), plus one ``json.loads`` of each value that decides whether a
    call exists (its name, and members written before it).
    """

    __slots__ = (
        "_arguments",
        "_at",
        "_held_arguments",
        "_index",
        "_key",
        "_role",
        "_seen_arguments",
        "_sink",
        "_text",
        "_tool_names",
        "_value",
        "_value_done",
    )

    def __init__(self, tool_names: frozenset[str], sink: DeltaSink) -> None:
        self._tool_names = tool_names
        self._sink = sink
        self._at = _At.OPEN
        self._index: int | None = None  # set when the header is sent
        self._key = ""
        self._role = _Role.OTHER
        self._value = JsonScanner()
        self._text: list[str] = []  # the current key's or value's text, while it decides anything
        self._seen_arguments = False
        self._arguments: list[str] = []  # all of the arguments text scanned
        self._held_arguments: list[str] = []  # scanned before the header: sent with it
        self._value_done = False  # whether the arguments value ended

    @property
    def started(self) -> bool:
        """Whether the header was sent: from then on this is a call, whatever follows."""
        return self._index is not None

    def push(self, text: str) -> tuple[int, Scan]:
        """Takes ``text`` from its start; returns how much was taken and why it stopped:
        MORE (all taken, the object goes on), DONE (its "}" was the last character taken),
        BROKEN (see the class docstring; ``text[taken]`` is where it broke, or the value
        just taken failed to load)."""
        i, n = 0, len(text)
        while i < n:
            at = self._at
            if at is _At.IN_KEY or at is _At.IN_VALUE:
                end, scan = self._value.scan(text, i)
                self._take(text[i:end])
                i = end
                if scan is Scan.BROKEN:
                    return i, Scan.BROKEN
                if scan is Scan.DONE and not self._value_ended():
                    return i, Scan.BROKEN
                continue
            char = text[i]
            if char in WHITESPACE:
                i += 1
                continue
            if at is _At.OPEN and char == "{":
                self._at = _At.FIRST_KEY
            elif (at is _At.FIRST_KEY or at is _At.KEY) and char == '"':
                self._begin(_At.IN_KEY, _Role.OTHER)
                continue  # the scanner takes the quote
            elif at is _At.COLON and char == ":":
                self._at = _At.VALUE
            elif at is _At.VALUE:
                self._begin(_At.IN_VALUE, self._role_of(char))
                continue
            elif at is _At.AFTER_VALUE and char == ",":
                self._at = _At.KEY
            elif (at is _At.FIRST_KEY or at is _At.AFTER_VALUE) and char == "}":
                return i + 1, (Scan.DONE if self.started else Scan.BROKEN)  # no name, no call
            else:
                return i, Scan.BROKEN
            i += 1
        return n, Scan.MORE

    def end(self) -> None:
        """Sends the last of the arguments: called once, after DONE, after a BROKEN of a
        started call, or at the end of the answer while it is open."""
        if self._index is None:
            return
        if not self._arguments:
            self._sink.arguments(self._index, "{}")
        elif not self._value_done:
            self._sink.arguments(self._index, _closing("".join(self._arguments)))

    def _role_of(self, first: str) -> _Role:
        if self._key == "name" and self._index is None:
            return _Role.NAME
        if self._key in ARGUMENT_KEYS and not self._seen_arguments and first == "{":
            self._seen_arguments = True
            return _Role.ARGUMENTS
        return _Role.OTHER

    def _begin(self, at: _At, role: _Role) -> None:
        self._at = at
        self._role = role
        self._value = JsonScanner()
        self._text = []

    def _take(self, piece: str) -> None:
        if self._role is _Role.ARGUMENTS:
            self._arguments.append(piece)
            if self._index is None:
                self._held_arguments.append(piece)
            else:
                self._sink.arguments(self._index, piece)
        elif self._at is _At.IN_KEY or self._index is None:
            self._text.append(piece)  # keys name the members; values before the header decide

    def _value_ended(self) -> bool:
        """A key or value was just scanned to its end; False when that breaks the call."""
        if self._at is _At.IN_KEY:
            self._at = _At.COLON
            key = _loads("".join(self._text))
            if not isinstance(key, str):
                if self._index is None:
                    return False
                key = ""  # after the header a member that does not read is skipped
            self._key = key
            return True
        self._at = _At.AFTER_VALUE
        if self._role is _Role.ARGUMENTS:
            self._value_done = True
            return self._index is not None or _loads("".join(self._arguments)) is not _UNREADABLE
        if self._index is not None:
            return True
        value = _loads("".join(self._text))
        if self._role is _Role.OTHER:
            return value is not _UNREADABLE
        if (
            not isinstance(value, str)
            or not value
            or (self._tool_names and value not in self._tool_names)
        ):
            return False
        self._index = self._sink.start_call(value)
        self._sink.arguments(self._index, "".join(self._held_arguments))
        self._held_arguments = []
        return True


_UNREADABLE = object()


def _loads(text: str) -> object:
    """The value of a finished JSON text, or ``_UNREADABLE``; never raises, as a model's text
    may be anything (RecursionError: nesting deeper than ``json`` goes)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _UNREADABLE


def _closing(arguments: str) -> str:
    """What to append to an arguments text that stopped short so it reads as a JSON object;
    "" when nothing can (the text already sent cannot be taken back, and
    ``partial_json_parser`` sometimes completes a shorter text than it was given)."""
    try:
        _head, tail = partial_json_parser.fix_fast(arguments)
    # It raises its own ValueErrors, and AssertionError or IndexError on some malformed text.
    except (ValueError, AssertionError, IndexError, RecursionError):
        return ""
    return tail if isinstance(tail, str) and isinstance(_loads(arguments + tail), dict) else ""
