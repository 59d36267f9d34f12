"""A response's output items, built from the answer's deltas as the chat splitter reads them
(``OutputItems``), the events a stream sends for them, and the response object around them
(``response_object``).

The same builder serves both paths: a stream adds each row's delta and sends the events it
returns; a whole answer adds the one delta of its text and keeps only the items. Items take
their place in the order they open: reasoning (closed when the answer moves on), the
assistant message (``output_text``), each function call. A whole answer's one delta opens
them in that order; a stream whose model writes text after a call has its message after the
call, as it was streamed. An answer with no text and no call still has its (empty) message.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from pipeline.io_struct import RequestOutputStats
from tokenizer_proc.openai.chat_parsing import ChatDelta

__all__ = ["OutputItems", "new_item_id", "response_object", "response_usage"]


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


Event = dict[str, Any]


class OutputItems:
    """One answer's output items (see the module docstring). ``add`` and ``close`` return
    the stream events they make, without ``sequence_number`` (the stream numbers them)."""

    def __init__(self, new_id: Callable[[str], str] = new_item_id) -> None:
        self.items: list[dict[str, Any]] = []
        self._new_id = new_id
        self._reasoning: int | None = None  # output index of the open reasoning item
        self._message: int | None = None
        self._calls: dict[int, int] = {}  # call index -> output index
        self._text: dict[int, str] = {}  # output index -> text so far (reasoning or message)

    def add(self, delta: ChatDelta) -> list[Event]:
        events: list[Event] = []
        if delta.reasoning:
            if self._reasoning is None:
                events += self._open_reasoning()
            events.append(
                self._text_delta("response.reasoning_text.delta", self._reasoning, delta.reasoning)
            )
        if (delta.content or delta.tool_calls) and self._reasoning is not None:
            events += self._close_reasoning("completed")
        if delta.content:
            if self._message is None:
                events += self._open_message()
            event = self._text_delta("response.output_text.delta", self._message, delta.content)
            event["logprobs"] = []
            events.append(event)
        for call in delta.tool_calls:
            index = self._calls.get(call.index)
            if index is None:
                assert call.id is not None and call.name is not None, (
                    "a call's first delta names it"
                )
                index = self._calls[call.index] = len(self.items)
                item = {
                    "id": self._new_id("fc"),
                    "type": "function_call",
                    "status": "in_progress",
                    "arguments": "",
                    "call_id": call.id,
                    "name": call.name,
                }
                self.items.append(item)
                events.append(
                    {
                        "type": "response.output_item.added",
                        "output_index": index,
                        "item": dict(item),
                    }
                )
            if call.arguments:
                self.items[index]["arguments"] += call.arguments
                events.append(
                    {
                        "type": "response.function_call_arguments.delta",
                        "item_id": self.items[index]["id"],
                        "output_index": index,
                        "delta": call.arguments,
                    }
                )
        return events

    def close(self, status: str) -> list[Event]:
        """The end of the answer: every open item done, with ``status`` ("completed" or
        "incomplete")."""
        events: list[Event] = []
        if self._reasoning is not None:
            events += self._close_reasoning(status)
        if self._message is None and not self._calls:
            events += self._open_message()
        if self._message is not None:
            index = self._message
            item, text = self.items[index], self._text[index]
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"], item["status"] = [part], status
            events.append(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                    "logprobs": [],
                }
            )
            events.append(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": dict(part),
                }
            )
            events.append(
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}
            )
        for index in self._calls.values():
            item = self.items[index]
            item["status"] = status
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                    "name": item["name"],
                }
            )
            events.append(
                {"type": "response.output_item.done", "output_index": index, "item": dict(item)}
            )
        events.sort(key=lambda e: e["output_index"])  # (stable: each item's events stay in order)
        return events

    def _open_reasoning(self) -> list[Event]:
        index = self._reasoning = len(self.items)
        item = {
            "id": self._new_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
        self.items.append(item)
        self._text[index] = ""
        return [
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)},
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": {"type": "reasoning_text", "text": ""},
            },
        ]

    def _close_reasoning(self, status: str) -> list[Event]:
        index = self._reasoning
        assert index is not None
        self._reasoning = None
        item, text = self.items[index], self._text[index]
        part = {"type": "reasoning_text", "text": text}
        item["content"], item["status"] = [part], status
        return [
            {
                "type": "response.reasoning_text.done",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "text": text,
            },
            {
                "type": "response.content_part.done",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": dict(part),
            },
            {"type": "response.output_item.done", "output_index": index, "item": dict(item)},
        ]

    def _open_message(self) -> list[Event]:
        index = self._message = len(self.items)
        item = {
            "id": self._new_id("msg"),
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        self.items.append(item)
        self._text[index] = ""
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)},
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            },
        ]

    def _text_delta(self, kind: str, index: int | None, text: str) -> Event:
        assert index is not None
        self._text[index] += text
        return {
            "type": kind,
            "item_id": self.items[index]["id"],
            "output_index": index,
            "content_index": 0,
            "delta": text,
        }


def response_usage(
    stats: RequestOutputStats, completion_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    """OpenAI's Responses usage, from the request's stats as chat's usage is."""
    prompt = stats.prompt_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": min(prompt, stats.cached_tokens),
            "cache_write_tokens": 0,
        },
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt + completion_tokens,
    }


def response_object(
    head: dict[str, Any],
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete_reason: str | None = None,
) -> dict[str, Any]:
    """The response: ``head`` (its id, times and what the request asked, ``ResponseHead``)
    with its ``status``, ``output`` and ``usage``."""
    done = status in ("completed", "incomplete", "cancelled")
    return {
        **head,
        "status": status,
        "completed_at": int(time.time()) if done else None,
        "incomplete_details": {"reason": incomplete_reason}
        if incomplete_reason is not None
        else None,
        "output": output,
        "usage": usage,
    }
