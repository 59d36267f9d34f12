"""The answers of ``tool_choice`` "required" and a named function, whose shape the grammar
fixed (``tokenizer_proc/openai/tools.py``), read as tool calls with the same contract as the
formats of ``tool_calls.py``: streamed equals whole, the first delta of a call carries its
id and name, and the arguments are the model's own JSON text.

- "required": the answer is a JSON array of ``{"name", "arguments"}`` objects, which is the
  array Mistral's format writes after its marker, so ``RequiredCallsParser`` is that parser
  started inside the array (the marker is not in the answer, nor in what it gives back).
- A named function: the whole answer is the arguments object of one call.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenizer_proc.parsers.mistral import MistralToolParser
from tokenizer_proc.parsers.tool_calls import ToolCallDelta, ToolParseDelta, new_call_id

__all__ = ["NamedCallParser", "RequiredCallsParser"]

_NOTHING = ToolParseDelta("", ())


class RequiredCallsParser:
    """A JSON array of calls (``tool_choice: "required"``). An answer cut before its first
    call is complete (``max_tokens``) is content, exactly as the model wrote it."""

    __slots__ = ("_array",)

    def __init__(
        self, tool_names: frozenset[str], call_ids: Callable[[], str] = new_call_id
    ) -> None:
        self._array = MistralToolParser(tool_names, call_ids, in_array=True)

    def feed(self, text: str) -> ToolParseDelta:
        return self._array.feed(text)

    def finish(self) -> ToolParseDelta:
        return self._array.finish()


class NamedCallParser:
    """One call of ``name`` whose arguments are the whole answer (a named ``tool_choice``).
    The call's header goes with the first text, or at the finish of an empty answer."""

    __slots__ = ("_call_ids", "_name", "_opened")

    def __init__(self, name: str, call_ids: Callable[[], str] = new_call_id) -> None:
        self._name = name
        self._call_ids = call_ids
        self._opened = False

    def feed(self, text: str) -> ToolParseDelta:
        if not text:
            return _NOTHING
        if self._opened:
            return ToolParseDelta("", (ToolCallDelta(0, None, None, text),))
        self._opened = True
        return ToolParseDelta("", (ToolCallDelta(0, self._call_ids(), self._name, text),))

    def finish(self) -> ToolParseDelta:
        if self._opened:
            return _NOTHING
        self._opened = True
        return ToolParseDelta("", (ToolCallDelta(0, self._call_ids(), self._name, ""),))
