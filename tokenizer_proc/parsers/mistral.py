"""Tool calls in Mistral's older format: content, then ``[TOOL_CALLS]`` and a JSON array of
call objects, ``[{"name": ..., "arguments": {...}}, ...]``. What is a call and what is
content is ``MistralToolParser``'s rule.
"""

from __future__ import annotations

import enum
import secrets
import string
from typing import ClassVar
from collections.abc import Callable

from tokenizer_proc.parsers.json_call_stream import CallObject, DeltaSink, Scan
from tokenizer_proc.parsers.markers import WHITESPACE, opening_of_calls, split_at_marker
from tokenizer_proc.parsers.tool_calls import ToolParseDelta

__all__ = ["MistralToolParser", "mistral_call_id"]

MARKER = "[TOOL_CALLS]"
_ID_CHARACTERS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """9 random letters and digits: Mistral's chat templates refuse any other id when the
    call comes back on the next turn (``raise_exception``), so vLLM makes them so too."""
    return "".join(secrets.choice(_ID_CHARACTERS) for _ in range(9))


class _At(enum.Enum):
    BETWEEN = 0  # at the start or after an array: whitespace may be dropped
    CONTENT = 1
    ARRAY = 2  # after the marker: whitespace, then "["
    ELEMENT = 3  # after "[" or ",": whitespace, then "{"
    CALL = 4
    AFTER_ELEMENT = 5  # whitespace, then "," or "]"


class MistralToolParser:
    """One answer's Mistral tool calls.

    The rule (``CallObject`` decides each object's part):

    - Text before ``[TOOL_CALLS]`` is content.
    - An object is a call from the moment its ``"name"`` string is complete, names a known tool
      and everything before it is valid JSON; until then it is held back.
    - When the array stops parsing (not an array, an element that breaks before it is a call,
      text where a ``,`` or ``]`` belongs) and no call of it was made, its ``[TOOL_CALLS]`` is
      content and the text after it is read again as content. When calls were made, the text
      from the end of the last call is read again as content.
    - A call that breaks after its header keeps its header and the arguments sent (see
      ``CallObject``); the text from where it broke is read again as content.
    - After the array's ``]``, or at the end of the answer where ``]`` is missing, whitespace
      alone is dropped, and other text is content (another ``[TOOL_CALLS]`` starts calls again).
      Whitespace before an array that makes a call is dropped too. So an answer that makes no
      call is all content, exactly as written.

    ``in_array``: the answer starts after a marker it does not write (the array of
    ``tool_choice`` "required"); if that array fails before a call, nothing is given back for
    the marker, so the content is again the text as written."""

    __slots__ = (
        "_at",
        "_attempt",
        "_call",
        "_gap",
        "_held",
        "_made_calls",
        "_marker",
        "_sink",
        "_tool_names",
    )

    MARKERS: ClassVar[tuple[str, ...]] = (MARKER,)  # the texts the parser looks for

    def __init__(
        self,
        tool_names: frozenset[str],
        call_ids: Callable[[], str] = mistral_call_id,
        *,
        in_array: bool = False,
    ) -> None:
        self._tool_names = tool_names
        self._sink = DeltaSink(call_ids)
        self._at = _At.ARRAY if in_array else _At.BETWEEN
        self._marker = "" if in_array else MARKER  # the text that opened the current array
        self._held = ""  # text not yet decided, read again with the next
        self._gap = ""  # whitespace before an array that has not made a call yet
        self._call = CallObject(tool_names, self._sink)
        self._attempt = (
            ""  # the array's text since the marker or the last call, given back if it fails
        )
        self._made_calls = False  # whether this array made a call

    def feed(self, text: str) -> ToolParseDelta:
        self._scan(text, final=False)
        return self._sink.take()

    def finish(self) -> ToolParseDelta:
        self._scan("", final=True)
        return self._sink.take()

    def _scan(self, text: str, final: bool) -> None:
        text = self._held + text
        self._held = ""
        while True:
            at = self._at
            if at is _At.BETWEEN:
                opened = opening_of_calls(text, MARKER, final, after_calls=bool(self._sink.calls))
                if opened is None:
                    self._held = text  # only whitespace, or the start of a marker, so far
                    return
                gap, text = opened
                if gap is not None:
                    self._gap = gap  # dropped if the array makes a call
                self._at = _At.CONTENT
                continue
            if at is _At.CONTENT:
                content, after, held = split_at_marker(text, MARKER, final)
                self._sink.content(content)
                if after is None:
                    self._held = held
                    return
                self._attempt = ""
                self._made_calls = False
                self._marker = MARKER
                self._at = _At.ARRAY
                text = after
                continue
            if at is _At.CALL:
                call = self._call
                taken, scan = call.push(text)
                if not call.started:
                    self._attempt += text[:taken]
                text = text[taken:]
                if scan is Scan.MORE and not final:
                    return
                if not call.started:
                    text = self._give_back(text)
                    continue
                call.end()
                self._attempt = ""
                self._gap = ""
                self._made_calls = True
                if scan is Scan.DONE:
                    self._at = _At.AFTER_ELEMENT
                else:
                    self._at = _At.BETWEEN
                continue
            body = text.lstrip(WHITESPACE)
            if not body and not final:
                self._held = text
                return
            spaces = text[: len(text) - len(body)]
            if at is _At.ARRAY and body.startswith("["):
                self._attempt += spaces + "["
                text = body[1:]
                self._at = _At.ELEMENT
            elif at is _At.ELEMENT and body.startswith("{"):
                self._attempt += spaces
                text = body
                self._call = CallObject(self._tool_names, self._sink)
                self._at = _At.CALL
            elif at is _At.AFTER_ELEMENT and body.startswith(","):
                self._attempt = spaces + ","
                text = body[1:]
                self._at = _At.ELEMENT
            elif at is _At.AFTER_ELEMENT and body.startswith("]"):
                text = body[1:]
                self._at = _At.BETWEEN
            else:
                text = self._give_back(text)

    def _give_back(self, text: str) -> str:
        """The array stopped parsing at ``text``: what to read again as content, from the
        marker (made content here) if no call was made, else from the end of the last call."""
        if self._made_calls:
            self._at = _At.BETWEEN
        else:
            self._sink.content(self._gap + self._marker)
            self._at = _At.CONTENT
        self._gap = ""
        text = self._attempt + text
        self._attempt = ""
        return text
