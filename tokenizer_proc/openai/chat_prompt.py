"""A chat request's prompt text: its messages through the model's chat template, with the
template's refusals as 400s naming the field. The chat route, /v1/responses and /tokenize
render here, so /tokenize gives exactly the ids a chat request runs; ``generation_prompt`` is
the one rule for whether the prompt ends with the template's generation prompt."""

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
    """The prompt, with the generation prompt as ``generation_prompt`` decides."""
    try:
        return template.render(
            messages,
            add_generation_prompt=generation_prompt(add_generation_prompt, continue_final_message),
            tools=tools,
            kwargs=kwargs,
            continue_final_message=bool(continue_final_message),
        )
    except FinalMessageError as exc:
        raise RequestValidationError(str(exc), "continue_final_message") from exc
    except ChatTemplateError as exc:
        raise RequestValidationError(str(exc), "messages") from exc


def generation_prompt(
    add_generation_prompt: bool | None, continue_final_message: bool | None
) -> bool:
    """Whether the prompt ends with the template's generation prompt, from the fields as sent
    (None: not given). vLLM's default is true, and SGLang's chat has no such field: with
    ``continue_final_message`` the last message is left open, so the default is false there,
    and only both fields sent true is refused, with vLLM's words (it checks the fields as
    sent, not their defaults)."""
    if continue_final_message:
        if add_generation_prompt:
            raise RequestValidationError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )
        return False
    return add_generation_prompt is not False
