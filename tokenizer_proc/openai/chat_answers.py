"""A finished chat choice read with its request's ``ChatParsing``: the whole answer's message
(``parse_choice``), and what every choice, streamed or not, reports when it is done
(``finish_parsed``: its finish reason, its reasoning tokens, the tool metrics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenizer_proc.openai.chat_parsing import ChatParsing, ChatSplitter, message_fields
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager

__all__ = ["finish_parsed", "parse_choice", "token_bytes"]


def token_bytes(tm: TokenizerManager, state: ReqState) -> Callable[[int], bytes]:
    """Each output token's bytes in the answer's text: a special token that the text skips
    has none."""
    texts = tm.token_texts
    tokenizer = tm.tokenizer
    assert texts is not None and tokenizer is not None, "chat needs a tokenizer"
    skipped = tokenizer.special_token_ids if state.sampling.skip_special_tokens else frozenset()
    return lambda token: b"" if token in skipped else texts.raw(token)


def finish_parsed(
    tm: TokenizerManager,
    parsing: ChatParsing,
    splitter: ChatSplitter,
    state: ReqState,
    reason: str | None,
) -> tuple[str | None, int]:
    """A finished choice's finish reason (``tool_calls`` when it made calls) and reasoning
    tokens; counts it in the tool metrics when its request gave tools."""
    final = parsing.finish_reason(reason, splitter)
    reasoning_tokens = parsing.reasoning_tokens(splitter, token_bytes(tm, state))
    if parsing.plan is not None and final is not None:
        tm.metrics.requests.on_tool_answer(final, len(splitter.calls))
    return final, reasoning_tokens


def parse_choice(
    tm: TokenizerManager,
    parsing: ChatParsing,
    choice: dict[str, Any],
    state: ReqState,
    role: str = "assistant",
    echo: str = "",
) -> int:
    """A non-streaming choice: its ``message`` and ``finish_reason`` as the parsers read its
    whole text, in ``role``, ``echo`` in front of its content (vLLM's chat echo, which
    leads the parsed content). Returns its reasoning tokens."""
    splitter = parsing.splitter()
    splitter.feed(state.text, state.output_ids)
    splitter.finish()
    message = choice["message"] = message_fields(splitter, role)
    if echo:
        message["content"] = echo + (message["content"] or "")
    choice["finish_reason"], reasoning_tokens = finish_parsed(
        tm, parsing, splitter, state, choice["finish_reason"]
    )
    return reasoning_tokens
