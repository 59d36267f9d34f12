"""A ``POST /v1/messages`` body (``MessagesRequest``, Anthropic's fields) and the chat request
it runs as (``to_chat``): the conversation's blocks as chat messages
(``tokenizer_proc.anthropic.conversation``), its tools, tool choice, stop sequences, thinking
and output format in chat's names. Everything after that is the chat route's own code; an
error found there names the Anthropic field (``anthropic_names``).

Fields that change nothing here (``metadata``, ``service_tier``, ``cache_control``: the prefix
cache is automatic) are accepted; fields that ask for what this server cannot do (server
tools, MCP servers, containers, clearing tool uses) are 400s that name them. vLLM's extra
sampling fields (``seed``, ``min_p``, ``repetition_penalty``, ``logit_bias``) are taken too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from tokenizer_proc.anthropic.conversation import (
    ChatTurns,
    InputMessage,
    TextBlock,
    without_billing_header,
)
from tokenizer_proc.openai.schema import ChatCompletionRequest
from tokenizer_proc.request_edge.body import convert_body, field_path
from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = ["MessagesRequest", "TokenCountRequest", "anthropic_names"]

MIN_THINKING_BUDGET = 1024  # Anthropic's floor for budget_tokens


class ThinkingEnabled(msgspec.Struct, tag_field="type", tag="enabled", forbid_unknown_fields=True):
    budget_tokens: Annotated[int, Meta(ge=MIN_THINKING_BUDGET)]
    display: str | None = None  # how the client shows thinking: nothing to do here


class ThinkingAdaptive(
    msgspec.Struct, tag_field="type", tag="adaptive", forbid_unknown_fields=True
):
    display: str | None = None


class ThinkingDisabled(
    msgspec.Struct, tag_field="type", tag="disabled", forbid_unknown_fields=True
):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class ChoiceAuto(msgspec.Struct, tag_field="type", tag="auto", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = None


class ChoiceAny(msgspec.Struct, tag_field="type", tag="any", forbid_unknown_fields=True):
    disable_parallel_tool_use: bool | None = None


class ChoiceTool(msgspec.Struct, tag_field="type", tag="tool", forbid_unknown_fields=True):
    name: str
    disable_parallel_tool_use: bool | None = None


class ChoiceNone(msgspec.Struct, tag_field="type", tag="none", forbid_unknown_fields=True):
    pass


ToolChoice = ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class _Prompt(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What a request and its token count share: everything that makes the prompt."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    # Hints about the provider's own caching, capacity and accounts: nothing to do here (the
    # prefix cache is automatic, and no request ever waits on another's account).
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # The older spelling of output_config.format (the structured-outputs beta).
    output_format: dict[str, Any] | None = None

    @property
    def thinks(self) -> bool:
        return self.thinking is not None and not isinstance(self.thinking, ThinkingDisabled)

    def refuse_unsupported(self, ignored: list[str] | None) -> None:
        """Raises for a field that asks what this server cannot do. A tool's unknown field
        is noted in ``ignored`` (``decode_body``'s list), or refused when there is none."""
        if self.thinks and isinstance(self.tool_choice, (ChoiceAny, ChoiceTool)):
            # Anthropic's rule: a forced call cannot wait for the reasoning to end.
            raise RequestValidationError(
                "thinking may not be enabled when tool_choice forces tool use (any or tool)",
                "tool_choice",
            )
        if self.mcp_servers:
            raise RequestValidationError(
                "mcp_servers: MCP servers are not supported by this server", "mcp_servers"
            )
        _check_context_management(self.context_management)
        for i, tool in enumerate(self.tools or ()):
            _check_tool(tool, f"tools[{i}]", ignored)

    def to_chat(self, extra: dict[str, Any]) -> ChatCompletionRequest:
        """The chat request this runs as, with chat fields ``extra`` (sampling, stream).
        Raises RequestValidationError naming the Anthropic field."""
        turns = ChatTurns(_kept_thinking_turns(self.context_management))
        system = without_billing_header(self.system) if self.system is not None else None
        if system:
            turns.system(system)
        for i, message in enumerate(self.messages):
            turns.add(message, f"messages[{i}]")
        chat: dict[str, Any] = {"messages": turns.messages, **extra}
        if self.messages and self.messages[-1].role == "assistant":
            # Anthropic's prefill: the answer goes on from the last assistant turn's text.
            chat["continue_final_message"] = True
            chat["add_generation_prompt"] = False
        if self.tools is not None:
            chat["tools"] = [_chat_tool(tool) for tool in self.tools]
        if self.tool_choice is not None:
            chat.update(_chat_tool_choice(self.tool_choice))
        chat["chat_template_kwargs"] = self._template_kwargs()
        output_format = self.output_config.format if self.output_config is not None else None
        output_format = output_format or self.output_format
        if output_format is not None:
            chat["response_format"] = _chat_response_format(output_format)
        try:
            return convert_body(chat, ChatCompletionRequest)
        except RequestValidationError as exc:
            raise anthropic_names(exc) from exc

    def _template_kwargs(self) -> dict[str, Any]:
        """The template's switches: Qwen3's ``enable_thinking`` (a template without it
        ignores it; with thinking off the reasoning parser reads all text as the answer), and
        ``reasoning_effort`` from ``output_config.effort``, as the Responses API passes it."""
        # Anthropic thinks only when asked: no ``thinking`` is thinking off.
        kwargs: dict[str, Any] = {"enable_thinking": self.thinks}
        if self.output_config is not None and self.output_config.effort is not None:
            kwargs["reasoning_effort"] = self.output_config.effort
        return kwargs


class MessagesRequest(_Prompt, forbid_unknown_fields=True, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=0)]  # 0: the prompt is computed (and cached), no more
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    diagnostics: dict[str, Any] | None = None  # asks why a provider's cache missed: none here
    container: Any = None
    # vLLM's extra sampling fields, as the other routes take them
    seed: int | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def thinking_budget(self) -> int | None:
        """``thinking.budget_tokens``; None unless thinking is enabled with one."""
        thinking = self.thinking
        return thinking.budget_tokens if isinstance(thinking, ThinkingEnabled) else None

    def refuse_unsupported(self, ignored: list[str] | None) -> None:
        super().refuse_unsupported(ignored)
        if self.container is not None:
            raise RequestValidationError(
                "container: code execution containers are not supported by this server",
                "container",
            )
        if isinstance(self.thinking, ThinkingEnabled) and (
            self.thinking.budget_tokens >= self.max_tokens
        ):
            raise RequestValidationError(
                f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than "
                f"max_tokens ({self.max_tokens})",
                "thinking.budget_tokens",
            )

    def chat(self) -> ChatCompletionRequest:
        extra: dict[str, Any] = {
            # A max_tokens of 0 runs as 1, and the job is made 0 (``prefill_only``).
            "max_tokens": max(1, self.max_tokens),
            "stream": self.streaming,
            # Anthropic's top_k 0 is not a cut (chat spells that -1 or leaves it out).
            "top_k": self.top_k or None,
        }
        for name in ("temperature", "top_p", "seed", "min_p", "repetition_penalty", "logit_bias"):
            extra[name] = getattr(self, name)
        if self.stop_sequences:
            extra["stop"] = self.stop_sequences

        return self.to_chat({k: v for k, v in extra.items() if v is not None})


class TokenCountRequest(_Prompt, forbid_unknown_fields=True, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt fields of a request, without sampling."""

    def chat(self) -> ChatCompletionRequest:
        return self.to_chat({})


def _check_tool(tool: dict[str, Any], where: str, ignored: list[str] | None) -> None:
    """A client tool (``name``, ``input_schema``, ...); Anthropic's server tools (web search,
    code execution, the computer-use tools) are refused by their type."""
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise RequestValidationError(
            f"{where}: {kind!r} tools are not supported by this server; only client tools "
            "(name, description, input_schema)",
            f"{where}.type",
        )
    if tool.get("defer_loading"):
        raise RequestValidationError(
            f"{where}.defer_loading: tool search is not supported by this server (send false)",
            f"{where}.defer_loading",
        )
    callers = tool.get("allowed_callers")
    if callers is not None and "direct" not in callers:
        raise RequestValidationError(
            f"{where}.allowed_callers: programmatic tool calling is not supported by this "
            'server; the model calls tools directly ("direct")',
            f"{where}.allowed_callers",
        )
    for key in tool:
        if key in _TOOL_FIELDS:
            continue
        if ignored is None:
            raise RequestValidationError(f"{where}.{key}: unknown field", f"{where}.{key}")
        ignored.append(field_path(where, key))  # never read: _chat_tool takes known keys
    for key in ("name", "input_schema"):
        if key not in tool:
            raise RequestValidationError(f"{where}.{key} is required", f"{where}.{key}")
    if not isinstance(tool["input_schema"], dict):
        raise RequestValidationError(
            f"{where}.input_schema must be a JSON Schema object", f"{where}.input_schema"
        )


# A client tool's fields. What only shapes how a provider streams or shows the call
# (eager_input_streaming, input_examples, strict: the arguments are the model's own text
# under "auto", and follow the schema where a tool is forced) asks nothing more here.
_TOOL_FIELDS = frozenset(
    {
        "type",
        "name",
        "description",
        "input_schema",
        "cache_control",
        "strict",
        "eager_input_streaming",
        "input_examples",
        "defer_loading",
        "allowed_callers",
    }
)


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {"name": tool["name"], "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> dict[str, Any]:
    """Anthropic's tool choice as chat's: ``any`` is "required", ``tool`` a named function;
    ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``."""
    if isinstance(choice, ChoiceNone):
        return {"tool_choice": "none"}
    out: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    if isinstance(choice, ChoiceAuto):
        out["tool_choice"] = "auto"
    elif isinstance(choice, ChoiceAny):
        out["tool_choice"] = "required"
    else:
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    return out


def _chat_response_format(output_format: dict[str, Any]) -> dict[str, Any]:
    """``output_config.format`` (``{"type": "json_schema", "schema": ...}``) as chat's
    ``response_format``."""
    if output_format.get("type") != "json_schema" or "schema" not in output_format:
        raise RequestValidationError(
            'output_config.format must be {"type": "json_schema", "schema": {...}}',
            "output_config.format",
        )
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": output_format["schema"]},
    }


_CLEAR_THINKING = "clear_thinking_20251015"


def _check_context_management(config: dict[str, Any] | None) -> None:
    """Clearing thinking from earlier turns is done (``ChatTurns``); clearing tool uses,
    which would change what the model read of its own tools' results, is not."""
    for i, edit in enumerate((config or {}).get("edits") or ()):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != _CLEAR_THINKING:
            raise RequestValidationError(
                f"context_management.edits[{i}]: {kind!r} is not supported by this server; "
                f"only {_CLEAR_THINKING!r}",
                f"context_management.edits[{i}].type",
            )
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        if keep != "all" and not (
            isinstance(keep, dict)
            and keep.get("type") == "thinking_turns"
            and isinstance(keep.get("value"), int)
            and keep["value"] >= 1
        ):
            raise RequestValidationError(
                f'context_management.edits[{i}].keep must be "all" or '
                '{"type": "thinking_turns", "value": n}',
                f"context_management.edits[{i}].keep",
            )


def _kept_thinking_turns(config: dict[str, Any] | None) -> int | None:
    """How many of the latest assistant turns keep their thinking (None: all)."""
    for edit in (config or {}).get("edits") or ():
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
        return None if keep == "all" else int(keep["value"])
    return None


_CHAT_NAMES = (
    ("max_completion_tokens", "max_tokens"),
    ("sampling_params.thinking_budget", "thinking.budget_tokens"),
    ("response_format.json_schema.schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    (".function.parameters", ".input_schema"),
    (".function.", "."),
)


def anthropic_names(exc: RequestValidationError) -> RequestValidationError:
    """A chat-side refusal with the Anthropic field names (``tools[i].input_schema`` for
    ``tools[i].function.parameters``, ``stop_sequences`` for ``stop``, ...)."""
    text, param = str(exc), exc.param
    for chat_name, ours in _CHAT_NAMES:
        text = text.replace(chat_name, ours)
        param = param.replace(chat_name, ours) if param is not None else None
    text = text.replace("`stop`", "`stop_sequences`").replace("$.stop", "$.stop_sequences")
    if param is not None and (param == "stop" or param.startswith("stop[")):
        param = "stop_sequences" + param[len("stop") :]
    return RequestValidationError(text, param)
