"""Renders chat messages to a prompt string with the model's Jinja2 chat template: the model
directory's (``LoadedTokenizer.chat_template``: tokenizer_config.json's ``chat_template`` or
chat_template.jinja), else ``DEFAULT_CHAT_TEMPLATE``.

Rendering follows Hugging Face ``transformers`` so that a model's own template renders the same
here as in ``apply_chat_template`` (``ChatTemplate`` lists what that takes), in a sandboxed
environment: a template is data from a model directory, it must not reach Python internals.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from collections.abc import Mapping
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR, LoadedTokenizer

logger = logging.getLogger("tokenpipe.chat_template")

# The shipped tokenizer's own (``pipeline/assets/chat_template.jinja``): ChatML, with tools in the
# Hermes / Qwen 2.5 style (a tools block in the system turn, earlier calls as ``<tool_call>``
# blocks, results as ``tool`` turns):
#     <|im_start|>{role}\n{content}<|im_end|>\n   (one per message)
#     <|im_start|>assistant\n                      (the generation prompt)
DEFAULT_CHAT_TEMPLATE = (DEFAULT_TOKENIZER_DIR / "chat_template.jinja").read_text(encoding="utf-8")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the template refused them (``raise_exception``) or
    failed on them. A client error."""


class FinalMessageError(ChatTemplateError):
    """``continue_final_message``: the last message cannot be left open (it has no text, or
    the template does not show it as it is)."""


# transformers' marker, so that a template renders the open message exactly as there.
_CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateUnavailable(RuntimeError):
    """The model's template itself does not compile: a server problem, not the client's."""


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks in
    some HF templates; for rendering it is just its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


# A template's own arguments, whatever it passes: json.dumps judges them.
def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """One compiled template, built once per server. A template that does not compile is
    logged at start-up and makes every chat request a 500 naming the problem, rather than
    stopping a server whose other endpoints work.

    As in transformers: ``trim_blocks``/``lstrip_blocks``, the ``raise_exception`` and
    ``strftime_now`` globals, a ``tojson`` that does not HTML-escape, the ``{% generation %}``
    tag rendered as its body, ``tools`` as the request's tool definitions (``{"type":
    "function", "function": {...}}`` each, as ``apply_chat_template(tools=...)`` passes them;
    none without), ``documents`` as none, a request's ``chat_template_kwargs`` (such as
    ``enable_thinking``) as variables, and the tokenizer's special tokens (``bos_token``,
    ``eos_token``, ...: ``LoadedTokenizer.special_tokens``) as variables, which Llama-style
    templates open with."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source if source is not None else DEFAULT_CHAT_TEMPLATE
        self.is_default = source is None
        self._special_tokens = dict(special_tokens or {})
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template: jinja2.Template | None = None
        self._compile_error: str | None = None
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateError as exc:
            self._compile_error = f"the model's chat template does not compile: {exc}"
            logger.warning("%s; /v1/chat/completions will answer 500", self._compile_error)

    @classmethod
    def for_tokenizer(cls, tokenizer: LoadedTokenizer) -> ChatTemplate:
        return cls(tokenizer.chat_template, tokenizer.special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """``messages`` are plain dicts (``role``, ``content`` as a string, optional ``name``,
        ``tool_calls``, ``tool_call_id``, an assistant's ``reasoning_content`` and
        ``reasoning``); ``tools`` the request's tool definitions (None:
        none); ``kwargs`` its ``chat_template_kwargs``, extra variables that cannot replace
        the ones above (as in vLLM); ``continue_final_message``: the last message is left
        open (``_left_open``). Raises ChatTemplateError for messages the template refuses
        or fails on."""
        if self._template is None:
            raise ChatTemplateUnavailable(self._compile_error)
        final = ""
        if continue_final_message:
            if add_generation_prompt:
                raise FinalMessageError(
                    "continue_final_message and add_generation_prompt are not compatible"
                )
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise FinalMessageError(
                    "continue_final_message is set but the final message has no "
                    '"content" to continue'
                )
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_MARKER}]
        # As apply_chat_template: none, not undefined, so that `tools is not none` is false.
        fixed = {
            "messages": messages,
            "tools": tools or None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            rendered = self._template.render({**self._special_tokens, **(kwargs or {}), **fixed})
        except ChatTemplateError:
            raise
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            IndexError,
            AttributeError,
        ) as exc:
            # A template indexing a missing key or adding str to None fails on these messages.
            raise ChatTemplateError(
                f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"
            ) from exc
        return _left_open(rendered, final) if continue_final_message else rendered


def _left_open(rendered: str, final: str) -> str:
    """``continue_final_message`` (vLLM's request field, transformers' argument) leaves the
    last message open so that the model continues it, as ``apply_chat_template`` does: the
    message's text gets a marker at its end, the conversation renders as usual, and the
    prompt is cut where the marker stands. A template that trimmed the marker's trailing space
    trimmed the text's too: what stands before the marker is then right-stripped, as
    transformers does. A template that drops or rewrites the message's text is a
    ``FinalMessageError``."""
    marker = _CONTINUE_MARKER.strip()
    if final.strip() not in rendered or marker not in rendered:
        raise FinalMessageError(
            "continue_final_message is set but the final message does not appear in the chat "
            "after applying the chat template! This can happen if the chat template deletes "
            "portions of the final message. Please verify the chat template and final message in "
            "your chat to ensure they are compatible."
        )
    at = rendered.rindex(marker)
    if rendered.startswith(_CONTINUE_MARKER, at):
        return rendered[:at]
    return rendered[:at].rstrip()
