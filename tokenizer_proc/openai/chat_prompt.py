"""A chat request's prompt text: its messages through the model's chat template, with the
template's refusals as 400s naming the field. The chat route, /v1/responses and /tokenize
render here, so /tokenize gives exactly the ids a chat request runs."""

from __future__ import annotations

from typing import Any

from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError, FinalMessageError
from tokenizer_proc.request_edge.errors import RequestValidationError


def render_chat_prompt(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool | None,
    kwargs: dict[str, Any] | None,
    continue_final_message: bool | None,
) -> str:
    """The prompt; ``add_generation_prompt`` is true unless false (vLLM's default)."""
    try:
        return template.render(
            messages,
            add_generation_prompt=add_generation_prompt is not False,
            tools=tools,
            kwargs=kwargs,
            continue_final_message=bool(continue_final_message),
        )
    except FinalMessageError as exc:
        raise RequestValidationError(str(exc), "continue_final_message") from exc
    except ChatTemplateError as exc:
        raise RequestValidationError(str(exc), "messages") from exc
