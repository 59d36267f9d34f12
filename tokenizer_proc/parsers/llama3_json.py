"""Tool calls in Llama 3.1/3.2's JSON format: the answer is, after optional whitespace and an
optional ``<|python_tag|>``, a JSON object ``{"name": ..., "parameters": {...}}``
(``"arguments"`` is taken too), and further calls follow it after a ``;``. What is a call and
what is content is ``Llama3JsonToolParser``'s rule.
"""

from __future__ import annotations

import enum
from typing import ClassVar
from collections.abc import Callable

from tokenizer_proc.parsers.json_call_stream import CallObject, DeltaSink, Scan
from tokenizer_proc.parsers.markers import WHITESPACE
from tokenizer_proc.parsers.tool_calls import ToolParseDelta, new_call_id

__all__ = ["Llama3JsonToolParser"]

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class _At(enum.Enum):
    START = 0  # whitespace, then "{" or the tag
    OBJECT = 1  # after the tag or a ";": whitespace, then "{"
    CALL = 2
    AFTER_CALL = 3  # whitespace, then ";" or the end
    CONTENT = 4  # the rest of the answer is content


class Llama3JsonToolParser:
    """One answer's Llama 3 JSON tool calls.

    The rule (``CallObject`` decides each object's part):

    - An answer that does not begin, after whitespace, with ``{`` or ``<|python_tag|>`` is all
      content. So is one where the tag is followed by anything but an object.
    - An object is a call from the moment its ``"name"`` string is complete, names a known tool
      and everything before it is valid JSON; until then it is held back. If it breaks before
      that (``{"result": 1}``, an unknown name, the answer ends), everything from where this
      attempt began (the answer's start, or the end of the previous call) is content, and so
      is the rest of the answer.
    - After a call: whitespace, then ``;`` and the next object. Anything else is content, from
      just after the call's ``}`` to the end of the answer; whitespace alone at the end is
      dropped.
    - A call that breaks after its header keeps its header and the arguments sent (see
      ``CallObject``); the rest of the answer, from where it broke, is content."""

    __slots__ = ("_at", "_attempt", "_call", "_held", "_sink", "_tool_names")

    MARKERS: ClassVar[tuple[str, ...]] = (PYTHON_TAG,)  # the texts the parser looks for

    def __init__(
        self, tool_names: frozenset[str], call_ids: Callable[[], str] = new_call_id
    ) -> None:
        self._tool_names = tool_names
        self._sink = DeltaSink(call_ids)
        self._at = _At.START
        self._held = ""  # text not yet decided, read again with the next
        self._call = CallObject(tool_names, self._sink)
        self._attempt = ""  # the text of this attempt at a call, given back if it fails

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
            if at is _At.CONTENT:
                self._sink.content(self._attempt + text)
                self._attempt = ""
                return
            if at is _At.CALL:
                call = self._call
                taken, scan = call.push(text)
                if not call.started:
                    self._attempt += text[:taken]
                text = text[taken:]
                if scan is Scan.MORE and not final:
                    return
                if call.started:
                    call.end()
                    self._attempt = ""
                self._at = _At.AFTER_CALL if scan is Scan.DONE else _At.CONTENT
                continue
            body = text.lstrip(WHITESPACE)
            if not body and not final:
                self._held = text
                return
            if at is _At.AFTER_CALL:
                if body.startswith(SEPARATOR):
                    self._attempt = text[: len(text) - len(body) + 1]
                    text = body[1:]
                    self._at = _At.OBJECT
                elif not body:
                    return  # whitespace after the last call
                else:
                    self._at = _At.CONTENT
            elif body.startswith("{"):
                self._attempt += text[: len(text) - len(body)]
                text = body
                self._call = CallObject(self._tool_names, self._sink)
                self._at = _At.CALL
            elif at is _At.START and body.startswith(PYTHON_TAG):
                self._attempt = text[: len(text) - len(body) + len(PYTHON_TAG)]
                text = body[len(PYTHON_TAG) :]
                self._at = _At.OBJECT
            elif at is _At.START and not final and PYTHON_TAG.startswith(body):
                self._held = text
                return
            else:
                self._at = _At.CONTENT
