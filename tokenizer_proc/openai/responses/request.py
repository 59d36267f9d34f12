"""A ``POST /v1/responses`` body (``ResponsesRequest``) and what it becomes: the chat request
the pipeline runs (``to_chat``), with the conversation's items as chat messages
(``conversation_messages``).

OpenAI's fields, with vLLM's extra fields (``seed``, ``top_k``, ``min_p``,
``repetition_penalty``, ``logit_bias``, ``skip_special_tokens``, ``structured_outputs``).
Everything a chat request does (the template, tools, ``tool_choice``, structured outputs, the
reasoning parser) is the chat route's own code: a Responses request is read into a
``ChatCompletionRequest``, and an error found there names the Responses field
(``responses_names``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import Meta

from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.known_fields import Refusal, declare, neutral, refuse
from tokenizer_proc.openai.schema import ChatCompletionRequest

__all__ = [
    "ResponsesBody",
    "ResponsesRequest",
    "conversation_messages",
    "normalized_items",
    "responses_names",
]

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
    # vLLM's extra sampling fields
    seed: int | None = None
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
        if self.tools is not None:
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
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
    ``response_format``, ...)."""
    return RequestValidationError(
        _renamed(str(exc)), _renamed(exc.param) if exc.param is not None else None
    )


def _param_in(message: str) -> str | None:
    start = message.find("`$.")
    if start < 0:
        return None
    end = message.find("`", start + 1)
    return message[start + 3 : end] if end > 0 else None


# --- items --------------------------------------------------------------------------------------

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def normalized_items(
    value: str | list[dict[str, Any]] | None, where: str = "input"
) -> list[dict[str, Any]]:
    """The request's input as items in their full form (a string is one user message; a
    message item's ``type`` is filled in). Raises RequestValidationError naming the item at
    fault: an unknown type, a missing field, content of a kind this server cannot read."""
    if value is None:
        return []
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    items = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind not in ITEM_TYPES:
            raise RequestValidationError(
                f"{at}: items of type {kind!r} are not supported by this server; expected one of "
                f"{', '.join(ITEM_TYPES)}",
                f"{at}.type",
            )
        items.append(_READERS[kind](item, at))
    return items


def _message_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise RequestValidationError(
            f"{at}.role must be user, system, developer or assistant, got {role!r}", f"{at}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append({"type": kind, "text": part["text"]})
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                parts.append({"type": "refusal", "refusal": part["refusal"]})
            else:
                message = (
                    f"{at}.content[{j}]: content parts of type {kind!r} are not supported by this "
                    "server; only input_text, output_text and refusal"
                )
                raise RequestValidationError(message, f"{at}.content[{j}].type")
    else:
        raise RequestValidationError(
            f"{at}.content must be a string or a list of content parts", f"{at}.content"
        )
    return {"type": "message", "role": role, "content": parts}


def _string_field(item: dict[str, Any], name: str, at: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise RequestValidationError(
            f"{at}.{name} is required and must be a string", f"{at}.{name}"
        )
    return value


def _function_call_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    arguments = _string_field(item, "arguments", at)
    try:
        json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            f"{at}.arguments is not valid JSON: {exc}", f"{at}.arguments"
        ) from exc
    return {
        "type": "function_call",
        "call_id": _string_field(item, "call_id", at),
        "name": _string_field(item, "name", at),
        "arguments": arguments,
    }


def _function_call_output_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    output = item.get("output")
    if isinstance(output, list):
        texts = [
            part.get("text")
            for part in output
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
        ]
        if len(texts) != len(output) or not all(isinstance(t, str) for t in texts):
            raise RequestValidationError(
                f"{at}.output: only text parts are supported by this server", f"{at}.output"
            )
        output = "".join(t for t in texts if isinstance(t, str))
    if not isinstance(output, str):
        raise RequestValidationError(
            f"{at}.output is required and must be a string or a list of text parts", f"{at}.output"
        )
    return {
        "type": "function_call_output",
        "call_id": _string_field(item, "call_id", at),
        "output": output,
    }


def _reasoning_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    content = item.get("content") or []
    texts = [part.get("text", "") for part in content if isinstance(part, dict)]
    return {
        "type": "reasoning",
        "content": [{"type": "reasoning_text", "text": t} for t in texts if isinstance(t, str)],
    }


_READERS = {
    "message": _message_item,
    "function_call": _function_call_item,
    "function_call_output": _function_call_output_item,
    "reasoning": _reasoning_item,
}


def conversation_messages(items: list[dict[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """The chat messages of a conversation's ``items`` (normalized), for the template.
    ``first_new``: the index of the first item of this request's ``input`` (the earlier ones
    come from the stored conversation), to name an item at fault as ``input[i]``.

    Items become messages as OpenAI's conversation state says: a message item is a message
    (``developer`` is ``system``), ``function_call`` items are the assistant's ``tool_calls``
    (consecutive ones, and the assistant text before them, make one assistant turn), a
    ``function_call_output`` is a ``tool`` message answering its ``call_id``, which an earlier
    ``function_call`` of the conversation must have made. Reasoning items are accepted and
    left out of the prompt (as the reasoning templates leave earlier turns' reasoning out)."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "message":
            texts = [p["text"] if p["type"] != "refusal" else p["refusal"] for p in item["content"]]
            messages.append(
                {
                    "role": "system" if item["role"] == "developer" else item["role"],
                    "content": "\n".join(texts),
                }
            )
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item["call_id"])
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                at = f"input[{i - first_new}].call_id" if i >= first_new else "previous_response_id"
                raise RequestValidationError(
                    f"{at}: no function_call of this conversation has call_id {item['call_id']!r}",
                    at,
                )
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        # reasoning items: left out of the prompt (see the module docstring)
    return messages
