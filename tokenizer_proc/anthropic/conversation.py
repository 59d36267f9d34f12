"""The messages of a ``POST /v1/messages`` body (Anthropic's content blocks) and the chat
messages they become (``ChatTurns``), which the chat template renders as it renders any chat.

- ``system`` (a string or text blocks) and a ``system`` turn inside ``messages`` (Claude
  Code's mid-conversation system messages) are system messages.
- A user turn's ``tool_result`` blocks are ``tool`` messages (one each, in order, before the
  turn's text); an ``is_error`` result's text is led by ``Error: ``, since a chat template
  has no other way to show it.
- An assistant turn's ``tool_use`` blocks are its ``tool_calls``, its ``thinking`` its
  ``reasoning_content`` (redacted thinking shows nothing). Text blocks join with newlines.
- Consecutive user (or assistant) turns are one, as Anthropic combines them. Images and
  documents are refused: the chat route reads text only.
"""

from __future__ import annotations

import json
from typing import Any, Literal, NoReturn

import msgspec

from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = ["ChatTurns", "InputMessage", "TextBlock", "without_billing_header"]

BILLING_HEADER = "x-anthropic-billing-header:"

CacheControl = dict[str, Any] | None  # the prefix cache is automatic: accepted, ignored


class TextBlock(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", forbid_unknown_fields=True):
    source: Any
    cache_control: CacheControl = None


class DocumentBlock(msgspec.Struct, tag_field="type", tag="document", forbid_unknown_fields=True):
    source: Any
    title: str | None = None
    context: str | None = None
    citations: Any = None
    cache_control: CacheControl = None


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", forbid_unknown_fields=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    caller: dict[str, Any] | None = None  # who called it: only direct calls are made here
    toolset_name: str | None = None


ResultBlock = TextBlock | ImageBlock | DocumentBlock


class ToolResultBlock(
    msgspec.Struct, tag_field="type", tag="tool_result", forbid_unknown_fields=True
):
    tool_use_id: str
    content: str | list[ResultBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: str | None = None


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", forbid_unknown_fields=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(
    msgspec.Struct, tag_field="type", tag="redacted_thinking", forbid_unknown_fields=True
):
    data: str


Block = (
    TextBlock
    | ImageBlock
    | DocumentBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingBlock
    | RedactedThinkingBlock
)


class InputMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class ChatTurns:
    """The chat messages of a conversation, built turn by turn (``system``, then ``add``
    for each message in order). ``kept_thinking``: how many of the latest assistant turns
    keep their thinking (``context_management``'s ``clear_thinking``; None: all)."""

    def __init__(self, kept_thinking: int | None) -> None:
        self.messages: list[dict[str, Any]] = []
        self._kept_thinking = kept_thinking
        self._thinking_at: list[int] = []  # chat index of each assistant turn with thinking

    def system(self, content: str | list[TextBlock]) -> None:
        text = content if isinstance(content, str) else _joined(content)
        self.messages.append({"role": "system", "content": text})

    def add(self, message: InputMessage, where: str) -> None:
        if isinstance(message.content, str):
            self._append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            self._assistant(message.content, where)
        elif message.role == "user":
            self._user(message.content, where)
        else:
            self.system(_only_text(message.content, f"{where}.content"))
        self._clear_thinking()

    def _user(self, blocks: list[Block], where: str) -> None:
        texts: list[TextBlock] = []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if isinstance(block, ToolResultBlock):
                self.messages.append(_tool_message(block, at))
            elif isinstance(block, TextBlock):
                texts.append(block)
            else:
                _refuse(block, at, "user")
        if texts:
            self._append({"role": "user", "content": _joined(texts)})

    def _assistant(self, blocks: list[Block], where: str) -> None:
        texts: list[TextBlock] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            if isinstance(block, TextBlock):
                texts.append(block)
            elif isinstance(block, ThinkingBlock):
                thinking.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                arguments = json.dumps(block.input, ensure_ascii=False)
                function = {"name": block.name, "arguments": arguments}
                calls.append({"id": block.id, "type": "function", "function": function})
            elif not isinstance(block, RedactedThinkingBlock):
                _refuse(block, f"{where}.content[{j}]", "assistant")
        message: dict[str, Any] = {"role": "assistant", "content": _joined(texts)}
        if calls:
            message["tool_calls"] = calls
        if thinking:
            message["reasoning_content"] = "\n".join(thinking)
        self._append(message)

    def _append(self, message: dict[str, Any]) -> None:
        """Adds a user or assistant message, merged into the one before it when that has the
        same role and no calls yet (calls end an assistant's turn in every template)."""
        last = self.messages[-1] if self.messages else None
        if (
            last is None
            or last["role"] != message["role"]
            or message["role"] not in ("user", "assistant")
            or "tool_calls" in last
        ):
            if "reasoning_content" in message:
                self._thinking_at.append(len(self.messages))
            self.messages.append(message)
            return
        last["content"] = "\n".join(t for t in (last["content"], message["content"]) if t)
        if "tool_calls" in message:
            last["tool_calls"] = message["tool_calls"]
        if "reasoning_content" in message:
            if "reasoning_content" not in last:
                self._thinking_at.append(len(self.messages) - 1)
            joined = (last.get("reasoning_content"), message["reasoning_content"])
            last["reasoning_content"] = "\n".join(t for t in joined if t)

    def _clear_thinking(self) -> None:
        kept = self._kept_thinking
        if kept is None:
            return
        while len(self._thinking_at) > kept:
            del self.messages[self._thinking_at.pop(0)]["reasoning_content"]


def _tool_message(block: ToolResultBlock, where: str) -> dict[str, Any]:
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _joined(_only_text(content, f"{where}.content"))
    if block.is_error:
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}


def _only_text(blocks: list[Block] | list[ResultBlock], where: str) -> list[TextBlock]:
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            _refuse(block, f"{where}[{j}]", "here")
        texts.append(block)
    return texts


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _refuse(block: msgspec.Struct, where: str, role: str) -> NoReturn:
    kind = type(block).__struct_config__.tag
    if kind in ("image", "document"):
        message = f"{where}: {kind} blocks are not supported by this server; only text"
    else:
        message = f"{where}: {kind} blocks are not allowed in a {role} turn"
    raise RequestValidationError(message, f"{where}.type")


def without_billing_header(system: str | list[TextBlock]) -> str | list[TextBlock]:
    """``system`` without Claude Code's billing header: its first system block is metadata for
    Anthropic's API, with a hash that changes on every request, and at the head of the prompt
    it would make every request miss the prefix cache. It says nothing to the model."""
    if isinstance(system, str):
        head, _, rest = system.partition("\n")
        return rest if head.startswith(BILLING_HEADER) else system
    return [block for block in system if not block.text.startswith(BILLING_HEADER)]
