"""What a tool-call parser says about an answer, and the contract every format keeps
(``ToolParser``; ``tests/unit/test_tool_parsers.py`` holds each format to it).

A parser is made per request and fed the text delta of each output row; each ``feed`` and
the final ``finish`` return a ``ToolParseDelta``: the content text that is certain now, and
tool call deltas in the shape of OpenAI's streamed ``tool_calls``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "FirstCallOnly",
    "ToolCall",
    "ToolCallDelta",
    "ToolParseDelta",
    "ToolParser",
    "assemble",
    "new_call_id",
    "parse_whole",
]


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int  # position of the call in this answer, 0-based
    id: str | None  # only on the first delta of a call
    name: str | None  # only on the first delta of a call
    arguments: str  # a piece of the arguments' JSON text ("" allowed)


@dataclass(frozen=True, slots=True)
class ToolParseDelta:
    content: str
    tool_calls: tuple[ToolCallDelta, ...]


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser(Protocol):
    """One answer's parser: ``feed`` each text delta in order, then ``finish`` once. The
    contract, for every format:

    - Streamed equals whole: however the text is split into deltas, the content pieces and the
      call deltas, put together by :func:`assemble`, are what one ``feed`` of the whole text
      and ``finish`` give. Every decision a parser makes depends on the text only, never on
      where it was split.
    - The first delta of a call carries its index, id and name, and is sent as soon as the
      name string is complete; later deltas of that index carry argument text only.
    - ``arguments`` pieces are the model's own JSON text of the arguments object as it
      arrives, so they add up to that text; a call without an arguments object gets ``"{}"``.
    - Malformed output comes back as content, never as an exception (each format's parser
      states its rule)."""

    def feed(self, text: str) -> ToolParseDelta: ...

    def finish(self) -> ToolParseDelta:
        """The end of the answer: what was held back in case it began a call is settled."""
        ...


class FirstCallOnly:
    """``parallel_tool_calls: false`` on a parser of free text (``tool_choice`` "auto"): the
    answer's first call, as ``parser`` reads it. The calls after it are dropped with their
    text, and the content is what ``parser`` makes of the answer, as in vLLM (which keeps
    index 0 of the calls read). The contract above holds, as ``parser`` keeps it."""

    __slots__ = ("_parser",)

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> ToolParseDelta:
        return _first_call(self._parser.feed(text))

    def finish(self) -> ToolParseDelta:
        return _first_call(self._parser.finish())


def _first_call(delta: ToolParseDelta) -> ToolParseDelta:
    if all(call.index == 0 for call in delta.tool_calls):
        return delta
    return ToolParseDelta(delta.content, tuple(c for c in delta.tool_calls if c.index == 0))


def new_call_id() -> str:
    """``call_`` and 24 random hex digits, the shape of OpenAI's tool call ids."""
    return "call_" + secrets.token_hex(12)


def assemble(deltas: Iterable[ToolParseDelta]) -> tuple[str, list[ToolCall]]:
    """The content and the calls that a sequence of deltas adds up to, calls in index order.

    Raises ValueError when a call's first delta lacks its id or name, or a later one repeats
    them: the deltas then break the contract above.
    """
    content: list[str] = []
    heads: dict[int, tuple[str, str]] = {}
    arguments: dict[int, list[str]] = {}
    for delta in deltas:
        content.append(delta.content)
        for call in delta.tool_calls:
            if call.index not in heads:
                if call.id is None or call.name is None:
                    raise ValueError(
                        f"the first delta of tool call {call.index} has no id or no name: {call!r}"
                    )
                heads[call.index] = (call.id, call.name)
                arguments[call.index] = []
            elif call.id is not None or call.name is not None:
                raise ValueError(
                    f"a later delta of tool call {call.index} repeats its id or name: {call!r}"
                )
            arguments[call.index].append(call.arguments)
    calls = [
        ToolCall(id=heads[i][0], name=heads[i][1], arguments="".join(arguments[i]))
        for i in sorted(heads)
    ]
    return "".join(content), calls


def parse_whole(parser: ToolParser, text: str) -> tuple[str, list[ToolCall]]:
    """A whole answer at once (a non-streaming request): one ``feed``, then ``finish``."""
    return assemble([parser.feed(text), parser.finish()])
