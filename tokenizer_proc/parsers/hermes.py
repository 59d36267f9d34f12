"""Tool calls in the Hermes format (Qwen 2.5 and 3, Hermes): content, then blocks of
``<tool_call>`` + a JSON object ``{"name": ..., "arguments": {...}}`` + ``</tool_call>``,
whitespace around the JSON as the model likes. Several blocks are parallel calls; what is a
call and what is content is ``HermesToolParser``'s rule.
"""

from __future__ import annotations

import enum
from typing import ClassVar
from collections.abc import Callable

from tokenizer_proc.parsers.json_call_stream import CallObject, DeltaSink, Scan
from tokenizer_proc.parsers.markers import WHITESPACE, opening_of_calls, split_at_marker
from tokenizer_proc.parsers.tool_calls import ToolParseDelta, new_call_id

__all__ = ["HermesToolParser"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class _At(enum.Enum):
    BETWEEN = 0  # before the first block or after one: whitespace may be dropped
    CONTENT = 1
    CALL = 2  # inside a block's JSON object
    CLOSE = 3  # after the object: whitespace and </tool_call>


class HermesToolParser:
    """One answer's Hermes tool calls.

    The rule for each block (``CallObject`` decides the object's part):

    - A block is a call from the moment its ``"name"`` string is complete, names a known tool
      and everything before it is valid JSON; until then its text is held back.
    - A block that breaks before that (not JSON, not an object, an unknown name, no name, or
      the answer ends) is content: its ``<tool_call>`` is content, and the text after it is
      read again as content, so a good block inside it still counts.
    - A block's end is its object's ``}``, found by JSON structure (``</tool_call>`` inside a
      string is not the end). Whitespace and ``</tool_call>`` after it are dropped; anything
      else there is content, read on from just after the ``}``. A closing tag missing at the
      end of the answer is forgiven.
    - A call that breaks after its header keeps its header and the arguments sent (see
      ``CallObject``); the text from where it broke is content, after whitespace and a
      ``</tool_call>`` there are dropped as for a whole call (a model that forgets the
      object's last ``}`` still makes a clean call).
    - Whitespace between calls, before the first and after the last is dropped; text with
      anything else is content as written. So an answer that makes no call is all content,
      exactly as written."""

    __slots__ = ("_at", "_block", "_call", "_gap", "_held", "_sink", "_tool_names")

    MARKERS: ClassVar[tuple[str, ...]] = (OPEN_TAG, CLOSE_TAG)  # the texts the parser looks for

    def __init__(
        self, tool_names: frozenset[str], call_ids: Callable[[], str] = new_call_id
    ) -> None:
        self._tool_names = tool_names
        self._sink = DeltaSink(call_ids)
        self._at = _At.BETWEEN
        self._held = ""  # text not yet decided, read again with the next
        self._gap = ""  # whitespace before a block that is not yet a call
        self._call = CallObject(tool_names, self._sink)
        self._block = ""  # the block's text after <tool_call> while it is not yet a call

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
                opened = opening_of_calls(text, OPEN_TAG, final, after_calls=bool(self._sink.calls))
                if opened is None:
                    self._held = text  # only whitespace, or the start of a tag, so far
                    return
                gap, text = opened
                if gap is not None:
                    self._gap = gap  # dropped if the block makes a call
                self._at = _At.CONTENT
            elif at is _At.CONTENT:
                content, after, held = split_at_marker(text, OPEN_TAG, final)
                self._sink.content(content)
                if after is None:
                    self._held = held
                    return
                self._call = CallObject(self._tool_names, self._sink)
                self._block = ""
                self._at = _At.CALL
                text = after
            elif at is _At.CALL:
                call = self._call
                taken, scan = call.push(text)
                if not call.started:
                    self._block += text[:taken]
                text = text[taken:]
                if scan is Scan.MORE and not final:
                    return
                if not call.started:  # no call: the tag is content, the rest is read again
                    self._sink.content(self._gap + OPEN_TAG)
                    self._gap = ""
                    text = self._block + text
                    self._at = _At.CONTENT
                    continue
                call.end()
                self._gap = ""
                self._at = _At.CLOSE
            else:
                body = text.lstrip(WHITESPACE)
                if body.startswith(CLOSE_TAG) or (final and not body):
                    text = body[len(CLOSE_TAG) :]
                    self._at = _At.BETWEEN
                elif not final and CLOSE_TAG.startswith(body):
                    self._held = text
                    return
                else:
                    self._at = _At.CONTENT  # not this call's: content, whitespace and all
