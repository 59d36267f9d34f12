"""A chat answer split into reasoning, content and tool calls, row by row, the same way
streamed or whole (docs/api.md, "Tools and reasoning").

Each choice gets one ``ChatSplitter``. A non-streaming choice is one ``feed`` of its whole
text and ``finish``; a stream feeds each row's text. The parsers' decisions depend on the text
only, so a stream's deltas add up to the whole answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizer_proc.openai.shapes import chat_message
from tokenizer_proc.openai.tools import ToolPlan
from tokenizer_proc.parsers.forced_calls import NamedCallParser, RequiredCallsParser
from tokenizer_proc.parsers.reasoning import (
    DEFAULT_THINK,
    ReasoningParser,
    count_reasoning_tokens,
    make_reasoning_parser,
    reasoning_enabled,
)
from tokenizer_proc.parsers.tool_calls import FirstCallOnly, ToolCallDelta, ToolParser
from tokenizer_proc.parsers.tool_parsers import format_call_ids, make_tool_parser, tool_markers

__all__ = ["ChatDelta", "ChatParsing", "ChatSplitter", "delta_fields", "message_fields"]


@dataclass(frozen=True, slots=True)
class ChatDelta:
    reasoning: str
    content: str
    tool_calls: tuple[ToolCallDelta, ...]

    def __add__(self, other: ChatDelta) -> ChatDelta:
        return ChatDelta(
            self.reasoning + other.reasoning,
            self.content + other.content,
            self.tool_calls + other.tool_calls,
        )

    @property
    def empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class ChatSplitter:
    """One choice's answer: ``feed`` each row's text in order, then ``finish`` once. It
    keeps what the whole message needs: the calls made (``calls``: id, name, arguments) and
    the reasoning text's place in the answer (``reasoning_span``).

    The reasoning parser (``--reasoning-parser``) sees the answer's text first and keeps what
    lies inside ``<think>...</think>``; the tool parser sees only the content it leaves (a call
    inside reasoning is not a call): ``--tool-call-parser`` under ``tool_choice`` "auto", the
    array of calls under "required", the arguments of the named function otherwise."""

    __slots__ = ("_reasoning", "_tools", "calls", "content", "ids", "reasoning", "text")

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools
        self.reasoning = ""
        self.content = ""
        self.calls: list[list[str]] = []  # [id, name, arguments so far] per call, by index
        # The whole answer as fed, for the reasoning count (a stream's ReqState keeps only
        # what is still to send); kept only when there is reasoning to count.
        self.text = ""
        self.ids: list[int] = []

    def feed(self, text: str, ids: Sequence[int] = ()) -> ChatDelta:
        """A row's text and its token ids (the ids only count reasoning tokens)."""
        if self._reasoning is None:
            return self._kept("", text, final=False)
        self.text += text
        self.ids.extend(ids)
        split = self._reasoning.feed(text)
        return self._kept(split.reasoning, split.content, final=False)

    def finish(self) -> ChatDelta:
        if self._reasoning is None:
            return self._kept("", "", final=True)
        split = self._reasoning.finish()
        return self._kept(split.reasoning, split.content, final=True)

    @property
    def reasoning_span(self) -> tuple[int, int] | None:
        """Where the reasoning text lies in the answer's text (characters); after ``finish``."""
        return self._reasoning.span if self._reasoning is not None else None

    def _kept(self, reasoning: str, content: str, final: bool) -> ChatDelta:
        calls: tuple[ToolCallDelta, ...] = ()
        if self._tools is not None:
            parsed = self._tools.feed(content)
            content, calls = parsed.content, parsed.tool_calls
            if final:
                rest = self._tools.finish()
                content, calls = content + rest.content, calls + rest.tool_calls
        for call in calls:
            if call.index == len(self.calls):
                assert call.id is not None and call.name is not None, (
                    "a call's first delta names it"
                )
                self.calls.append([call.id, call.name, ""])
            self.calls[call.index][2] += call.arguments
        self.reasoning += reasoning
        self.content += content
        return ChatDelta(reasoning, content, calls)


@dataclass(frozen=True, slots=True)
class ChatParsing:
    """How a chat request's answers are read: its ``ToolPlan`` (None: it gave no tools), the
    server's tool-call format, and the reasoning dialect (None: no reasoning parser)."""

    plan: ToolPlan | None
    tool_parser: str
    reasoning: str | None
    enable_thinking: bool = True

    @property
    def active(self) -> bool:
        """Whether anything is read out of the text: otherwise it is all content, as before."""
        return self.reads_calls or self.reasoning is not None

    @property
    def thinks(self) -> bool:
        """Whether answers are read for reasoning: a reasoning parser is on, and the request
        did not switch thinking off."""
        return self.reasoning is not None and reasoning_enabled(
            self.reasoning, self.enable_thinking
        )

    @property
    def reads_calls(self) -> bool:
        return self.plan is not None and self.plan.mode != "none"

    def splitter(self) -> ChatSplitter:
        reasoning = (
            make_reasoning_parser(self.reasoning, enable_thinking=self.enable_thinking)
            if self.reasoning is not None
            else None
        )
        return ChatSplitter(reasoning, self._tool_parser())

    def _tool_parser(self) -> ToolParser | None:
        """The plan's parser; every mode's call ids in the server's format's shape."""
        plan = self.plan
        if plan is None or plan.mode == "none":
            return None
        call_ids = format_call_ids(self.tool_parser)
        if plan.mode == "auto":
            parser = make_tool_parser(self.tool_parser, plan.names, call_ids)
            return parser if plan.parallel else FirstCallOnly(parser)
        if plan.mode == "required":
            return RequiredCallsParser(plan.names, call_ids)
        assert plan.named is not None, "a named plan names its function"
        return NamedCallParser(plan.named, call_ids)

    def markers(self) -> tuple[str, ...]:
        """The texts the parsers look for in the answer: the think tags, and under "auto" the
        tool format's tags or marker. ("required" and named answers are bare JSON.)"""
        think = (DEFAULT_THINK.start, DEFAULT_THINK.end) if self.reasoning is not None else ()
        calls = (
            tool_markers(self.tool_parser)
            if self.plan is not None and self.plan.mode == "auto"
            else ()
        )
        return think + calls

    def keeps_special_tokens(self, special_texts: Callable[[str], bool]) -> bool:
        """Whether the answer's special tokens must stay in its text: a marker that is one
        special token of the tokenizer (Mistral's ``[TOOL_CALLS]``, Llama 3's
        ``<|python_tag|>``) would otherwise be dropped before the parser sees it.
        ``special_texts(text)``: whether ``text`` is a special token."""
        return any(special_texts(marker) for marker in self.markers())

    def finish_reason(self, reason: str | None, splitter: ChatSplitter) -> str | None:
        """OpenAI's: ``tool_calls`` when an answer that ended by itself made calls (a named
        function's answer is a call the client asked for: ``stop``, as OpenAI says)."""
        if (
            reason == "stop"
            and splitter.calls
            and self.plan is not None
            and self.plan.mode in ("auto", "required")
        ):
            return "tool_calls"
        return reason

    def reasoning_tokens(self, splitter: ChatSplitter, token_bytes: Callable[[int], bytes]) -> int:
        """The finished answer's reasoning tokens, counted once, when the choice is finished,
        from its output ids: a token whose bytes overlap the reasoning text
        (``count_reasoning_tokens``), never by tokenizing the text again."""
        span = splitter.reasoning_span
        if span is None:
            return 0
        return count_reasoning_tokens([token_bytes(t) for t in splitter.ids], splitter.text, span)


def message_fields(splitter: ChatSplitter, role: str = "assistant") -> dict[str, Any]:
    """A whole choice's ``message`` (``chat_message``'s keys): ``content`` is null when the
    answer is only calls; ``reasoning_content`` and vLLM's newer ``reasoning``, null when
    there is none."""
    calls = [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        for call_id, name, arguments in splitter.calls
    ]
    return chat_message(
        role,
        splitter.content or (None if calls else ""),
        reasoning=splitter.reasoning or None,
        tool_calls=calls or None,
    )


def delta_fields(delta: ChatDelta) -> dict[str, Any]:
    """A stream chunk's ``delta``: ``reasoning_content`` always (SGLang's, null when this chunk
    has none), then each part that has something; a call's first delta with its id, type and
    name, its later ones with argument text only (OpenAI's shape)."""
    out: dict[str, Any] = {"reasoning_content": delta.reasoning or None}
    if delta.reasoning:
        out["reasoning"] = delta.reasoning
    if delta.content:
        out["content"] = delta.content
    if delta.tool_calls:
        calls = []
        for call in delta.tool_calls:
            if call.id is not None:
                calls.append(
                    {
                        "index": call.index,
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
            else:
                calls.append({"index": call.index, "function": {"arguments": call.arguments}})
        out["tool_calls"] = calls
    return out
