"""The messages of a chat request (``/v1/chat/completions``, and the Responses API's input
as chat): their typed parts, and how each is shown to the chat template. A role may be any
string, as in vLLM (a model's template may know more roles than OpenAI's); under
--reject-unknown-fields only OpenAI's are taken (``refuse_custom_roles``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from tokenizer_proc.request_edge.errors import RequestValidationError


class TextPart(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    text: str


class ImageURLPart(msgspec.Struct, tag_field="type", tag="image_url", forbid_unknown_fields=True):
    image_url: Any


class InputAudioPart(
    msgspec.Struct, tag_field="type", tag="input_audio", forbid_unknown_fields=True
):
    input_audio: Any


class FilePart(msgspec.Struct, tag_field="type", tag="file", forbid_unknown_fields=True):
    file: Any


class RefusalPart(msgspec.Struct, tag_field="type", tag="refusal", forbid_unknown_fields=True):
    refusal: str


ContentPart = TextPart | ImageURLPart | InputAudioPart | FilePart | RefusalPart


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: str  # one of OPENAI_ROLES, or a custom role the template is given as it is
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # A conversation's earlier tool use: rendered by the template (tokenizer_proc/openai/tools.py).
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # Documented for the deprecated function calling and for audio, which this server refuses.
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None  # an earlier assistant refusal: ignored
    # An earlier answer of this server sent back as it came: its reasoning (vLLM's newer
    # ``reasoning``, and ``reasoning_content``) reaches the template, as in vLLM; OpenAI's
    # ``annotations`` (citations) say nothing to the model and are ignored.
    reasoning: str | None = None
    reasoning_content: str | None = None
    annotations: list[Any] | None = None

    def to_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined with newlines,
        ``developer`` as ``system`` (as vLLM and OpenAI do: templates know only ``system``),
        an assistant's reasoning as ``reasoning_content`` and ``reasoning`` (``reasoning``
        wins where both are given and differ, as vLLM reads only that one)."""
        where = f"messages[{index}]"
        self._refuse_unsupported(where)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self._text(where)}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [
                _template_tool_call(call, f"{where}.tool_calls[{j}]")
                for j, call in enumerate(self.tool_calls)
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            # Under both names, as vLLM passes it: Qwen3's template reads reasoning_content.
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out

    def _refuse_unsupported(self, where: str) -> None:
        if self.role == "function" or self.function_call is not None:
            raise RequestValidationError(
                f"{where}: function calls are not supported by this server (use tool calls)", where
            )
        if self.audio is not None:
            raise RequestValidationError(
                f"{where}: audio is not supported by this server", f"{where}.audio"
            )
        if self.tool_calls is not None and self.role != "assistant":
            raise RequestValidationError(
                f"{where}.tool_calls is only allowed on assistant messages", f"{where}.tool_calls"
            )
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise RequestValidationError(
                    f"{where}.{name} is only allowed on assistant messages", f"{where}.{name}"
                )
        if self.role == "tool" and self.tool_call_id is None:
            raise RequestValidationError(
                f"{where}.tool_call_id is required on tool messages", f"{where}.tool_call_id"
            )

    def _text(self, where: str) -> str:
        if self.content is None:
            # An assistant turn that only called tools has no content.
            if self.role == "assistant":
                return ""
            raise RequestValidationError(f"{where}.content is required", f"{where}.content")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if not isinstance(part, (TextPart, RefusalPart)):
                kind = type(part).__struct_config__.tag
                raise RequestValidationError(
                    f"{where}.content[{j}]: content parts of type {kind!r} are not supported by "
                    "this server; only 'text'",
                    f"{where}.content[{j}].type",
                )
            texts.append(part.text if isinstance(part, TextPart) else part.refusal)
        return "\n".join(texts)


def refuse_custom_roles(messages: Sequence[Message]) -> None:
    """Under --reject-unknown-fields, a role that is not OpenAI's is a 400 (in the words
    msgspec's check of the enumeration used)."""
    for i, message in enumerate(messages):
        if message.role not in OPENAI_ROLES:
            raise RequestValidationError(
                f"Invalid enum value {message.role!r} - at `$.messages[{i}].role` (this server "
                f"takes the roles {', '.join(OPENAI_ROLES)}: --reject-unknown-fields)",
                f"messages[{i}].role",
            )


def _template_tool_call(call: ToolCall, where: str) -> dict[str, Any]:
    """Templates (``arguments | tojson``) expect the arguments as an object, not the JSON
    text the API carries; vLLM parses them the same way, an empty string as ``{}``."""
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments else {}
    except json.JSONDecodeError as exc:
        message = f"{where}.function.arguments is not valid JSON: {exc}"
        raise RequestValidationError(message, f"{where}.function.arguments") from exc
    return {
        "id": call.id,
        "type": call.type,
        "function": {"name": call.function.name, "arguments": arguments},
    }
