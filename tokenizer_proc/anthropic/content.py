"""A message's content blocks, built from the answer's deltas as the chat splitter reads
them (``ContentBlocks``), the stream events that build them, and what the message says of
its end (``stop_reason_of``) and of its tokens (``message_usage``).

One builder serves both paths: a stream adds each row's delta and sends the events it
returns; a whole answer adds the one delta of its text and keeps only the blocks. One block is
open at a time, as Anthropic streams them: a delta of another kind (thinking, text, a tool
call) closes it and opens the next. A whole answer's one delta opens them in that order; a
stream whose model writes text after a call has that text in a block after the call.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import partial_json_parser

from pipeline.io_struct import FinishLength, FinishReason, FinishStop, RequestOutputStats
from tokenizer_proc.openai.chat_parsing import ChatDelta

__all__ = ["ContentBlocks", "message_usage", "stop_reason_of"]

Event = dict[str, Any]
BlockKind = Literal["thinking", "text", "tool_use"]
_DELTAS: dict[BlockKind, tuple[str, str]] = {
    "thinking": ("thinking_delta", "thinking"),
    "text": ("text_delta", "text"),
}


class ContentBlocks:
    """One answer's content blocks (see the module docstring). ``add`` and ``close`` return
    the ``content_block_*`` events they make."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self._open: BlockKind | None = None
        self._calls: dict[int, int] = {}  # call index -> its tool_use block's index
        self._arguments: dict[int, str] = {}  # block index -> a tool_use's JSON text so far

    def add(self, delta: ChatDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            events += self._append("thinking", delta.reasoning)
        if delta.content:
            events += self._append("text", delta.content)
        for call in delta.tool_calls:
            if call.index not in self._calls:
                assert call.id is not None and call.name is not None, (
                    "a call's first delta names it"
                )
                block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
                events += self._start("tool_use", block)
                self._calls[call.index] = len(self.blocks) - 1
                self._arguments[len(self.blocks) - 1] = ""
            if call.arguments:
                index = self._calls[call.index]
                self._arguments[index] += call.arguments
                delta_event = {"type": "input_json_delta", "partial_json": call.arguments}
                events.append({"type": "content_block_delta", "index": index, "delta": delta_event})
        return events

    def close(self) -> list[Event]:
        """The end of the answer: the open block's stop, and each tool_use's ``input`` parsed
        from its JSON text."""
        events = self._stop()
        for index, arguments in self._arguments.items():
            self.blocks[index]["input"] = tool_input(arguments)
        return events

    def _append(self, kind: BlockKind, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open != kind:
            events += self._start(kind, _empty_block(kind))
        index = len(self.blocks) - 1
        delta_type, key = _DELTAS[kind]
        self.blocks[index][key] += text
        delta = {"type": delta_type, key: text}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        return events

    def _start(self, kind: BlockKind, block: dict[str, Any]) -> list[Event]:
        events = self._stop()
        self._open = kind
        self.blocks.append(block)
        start = {"type": "content_block_start", "index": len(self.blocks) - 1}
        start["content_block"] = dict(block)
        return [*events, start]

    def _stop(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _empty_block(kind: BlockKind) -> dict[str, Any]:
    if kind == "thinking":
        # No signature: nothing here signs thinking, and a client sends it back as it came.
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object: its JSON, or, for an object a length
    finish cut short, what of it was written (closed as the stream's parser closes it)."""
    if not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        try:
            value = partial_json_parser.loads(arguments)
        except (ValueError, partial_json_parser.MalformedJSON):
            return {}
    return value if isinstance(value, dict) else {}


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


def stop_reason_of(reason: FinishReason, called: bool) -> tuple[StopReason, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` for a finished answer (not an abort):
    a length finish is ``max_tokens``; an answer that ended by itself after calling tools is
    ``tool_use`` (a forced tool's too, as Anthropic says); a stop string, which only
    ``stop_sequences`` set here, is ``stop_sequence``; EOS is ``end_turn``."""
    if isinstance(reason, FinishLength):
        return "max_tokens", None
    assert isinstance(reason, FinishStop), "an abort is answered as an error"
    if called:
        return "tool_use", None
    if isinstance(reason.matched, str):
        return "stop_sequence", reason.matched
    return "end_turn", None


def message_usage(stats: RequestOutputStats, output_tokens: int) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens computed, and
    ``cache_read_input_tokens`` those the prefix cache served (their sum is the prompt, as
    Anthropic counts a cached prompt); nothing is written to a cache on request."""
    cached = min(stats.prompt_tokens, stats.cached_tokens)
    return {
        "input_tokens": stats.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }
