"""A ``POST /v1/responses`` body (``ResponsesRequest``) and what it becomes: the chat request
the pipeline runs (``to_chat``), with the conversation's items as chat messages
(``tokenizer_proc.openai.responses.input_items``).

OpenAI's fields, with vLLM's extra fields (``seed``, ``top_k``, ``min_p``,
``repetition_penalty``, ``logit_bias``, ``skip_special_tokens``, ``structured_outputs``).
Everything a chat request does (the template, tools, ``tool_choice``, structured outputs, the
reasoning parser) is the chat route's own code: a Responses request is read into a
``ChatCompletionRequest``, and an error found there names the Responses field
(``responses_names``).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.known_fields import Refusal, declare, neutral, refuse
from tokenizer_proc.request_edge.peer_wording import PeerWordedError
from tokenizer_proc.openai.sampling_request import Seed
from tokenizer_proc.openai.schema import ChatCompletionRequest

__all__ = ["ResponsesBody", "ResponsesRequest", "responses_names"]

PositiveInt = Annotated[int, Meta(ge=1)]
MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata
MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 512


class TextConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = (
        None  # a hint: every answer is the model's own length
    )


class ReasoningConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Hints about the provider's own caching, tiers and abuse tracking: nothing to do here.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # vLLM's tenancy fields, passed to the chat request
    cache_salt: str | None = None
    priority: int | None = None
    # vLLM's extra sampling fields
    seed: Seed | None = None  # int64, as chat's
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict[str, Any] | None = (
        None  # vLLM's (regex, choice, grammar, ...) beside text.format
    )

    _REFUSED: ClassVar[tuple[Refusal, ...]] = (
        (
            "background",
            lambda v: v not in (None, False),
            "background responses are not supported by this server (send false)",
        ),
        (
            "conversation",
            lambda v: v is not None,
            "conversation objects are not supported by this server: use previous_response_id",
        ),
        (
            "prompt",
            lambda v: v is not None,
            "prompt templates are not supported by this server: send input",
        ),
        neutral("top_logprobs", 0),
        neutral("max_tool_calls"),
        neutral("prompt_cache_options"),
        neutral("context_management"),
        neutral("moderation"),
    )

    @property
    def stores(self) -> bool:
        return self.store is not False  # OpenAI's default: stored

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    def refuse_unsupported(self) -> None:
        refuse(self, self._REFUSED)
        if self.input is None and self.previous_response_id is None:
            raise RequestValidationError(
                "input is required (or previous_response_id, to go on from a stored response)",
                "input",
            )
        if self.stream_options is not None and not self.stream:
            raise RequestValidationError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.truncation == "auto":
            raise RequestValidationError(
                'truncation "auto" is not supported by this server: a prompt too long for the '
                'context is refused ("disabled")',
                "truncation",
            )
        for i, name in enumerate(self.include or ()):
            raise RequestValidationError(
                f"include[{i}]: {name!r} is not supported by this server (send an empty list)",
                f"include[{i}]",
            )
        for i, tool in enumerate(self.tools or ()):
            kind = tool.get("type")
            if kind != "function":
                raise RequestValidationError(
                    f"tools[{i}]: {kind!r} tools are not supported by this server; only 'function'",
                    f"tools[{i}].type",
                )
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS or any(
            len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()
        ):
            message = (
                f"metadata takes at most {MAX_METADATA_KEYS} keys of at most {MAX_METADATA_KEY} "
                f"characters, values of at most {MAX_METADATA_VALUE}"
            )
            raise RequestValidationError(message, "metadata")

    def to_chat(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this runs as, with ``messages`` (the instructions first, then the
        conversation's). Raises RequestValidationError naming the Responses field."""
        if self.instructions:
            messages = [{"role": "system", "content": self.instructions}, *messages]
        chat: dict[str, Any] = {"messages": messages, "stream": self.streaming}
        for name in _PASSED_TO_CHAT:
            value = getattr(self, name)
            if value is not None:
                chat[name] = value
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.tools:  # [] is vLLM's default: no tools
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None and (self.tools or self.tool_choice not in _NO_TOOLS):
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        text_format = self.text.format if self.text is not None else None
        if text_format is not None:
            response_format = _chat_response_format(text_format)
            if response_format is not None:
                chat["response_format"] = response_format
        if self.reasoning is not None and self.reasoning.effort is not None:
            # Templates that take an effort (gpt-oss's, for one) read this variable, as in vLLM.
            chat["chat_template_kwargs"] = {"reasoning_effort": self.reasoning.effort}
        try:
            return msgspec.convert(chat, ChatCompletionRequest)
        except msgspec.ValidationError as exc:
            message = _renamed(str(exc))
            raise RequestValidationError(message, _param_in(message)) from exc


# The fields a chat request takes as they are.
_PASSED_TO_CHAT: tuple[str, ...] = (
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
)
_PASSED_TO_CHAT += ("logit_bias", "skip_special_tokens", "structured_outputs", "user")
_PASSED_TO_CHAT += ("cache_salt", "priority")
# The tool choices that ask nothing of a request without tools: "auto" is the Responses API's
# default (OpenAI's and vLLM's; Codex sends it with no tools), "none" its opposite. Only chat
# refuses a tool_choice without tools, as OpenAI's and vLLM's chat routes do.
_NO_TOOLS = ("auto", "none")

ResponsesBody = declare(ResponsesRequest, ResponsesRequest._REFUSED)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A Responses function tool (flat: ``name``, ``parameters``, ...) as a chat tool."""
    function = {k: v for k, v in tool.items() if k != "type"}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestValidationError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}; '
        "other tool choices are not supported by this server",
        "tool_choice",
    )


def _chat_response_format(text_format: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``; None for plain text."""
    kind = text_format.get("type")
    if kind == "text" and set(text_format) == {"type"}:
        return None
    if kind == "json_object" and set(text_format) == {"type"}:
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: v for k, v in text_format.items() if k != "type"}
        if "name" not in spec or "schema" not in spec:
            raise RequestValidationError(
                "text.format of type json_schema needs name and schema", "text.format"
            )
        return {"type": "json_schema", "json_schema": spec}
    raise RequestValidationError(
        f"text.format must be of type text, json_object or json_schema, got {kind!r}",
        "text.format.type",
    )


_CHAT_NAMES = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    (".function.", "."),
)


def _renamed(text: str) -> str:
    for chat_name, ours in _CHAT_NAMES:
        text = text.replace(chat_name, ours)
    return text


def responses_names(exc: RequestValidationError) -> RequestValidationError:
    """A chat-side refusal with the Responses field names (``input`` for ``messages``,
    ``tools[i].name`` for ``tools[i].function.name``, ``text.format`` for
    ``response_format``, ...), in its message's detail only where it is worded in the peers'
    phrases (``peer_wording``)."""
    param = _renamed(exc.param) if exc.param is not None else None
    if isinstance(exc, PeerWordedError):  # the peers' phrases stay as the peers word them
        return exc.reworded(exc.lead, _renamed, param)
    return RequestValidationError(_renamed(str(exc)), param)


def _param_in(message: str) -> str | None:
    start = message.find("`$.")
    if start < 0:
        return None
    end = message.find("`", start + 1)
    return message[start + 3 : end] if end > 0 else None
