"""Typed request bodies of the OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``), each a ``SamplingRequest`` with its own fields.

Decoding with msgspec (``tokenizer_proc.request_edge.body.decode_body``) is the validation of
types and ranges. Every field OpenAI documents for these two endpoints is accepted, so an
official client never trips on one: the ones this server cannot honour are refused with a 400
naming them when they ask for something (``functions``, ``audio``, ...), the ones that ask for
nothing here (``user``, ``store``, ``metadata``, ...) are accepted and ignored. Every other
field of SGLang's and vLLM's request schemas is known (``known_fields``): accepted at its
neutral value, refused otherwise. Each request type lists its refusals in one table,
``_REFUSED`` (plus ``COMMON_REFUSED``); the routes decode ``CompletionBody`` and
``ChatCompletionBody``, the request types with those known fields added.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeGuard

from msgspec import Meta

from pipeline.io_struct import Constraint, LogprobParams
from tokenizer_proc.openai.sampling_request import (
    COMMON_REFUSED,
    SamplingRequest,
    neutrals,
)
from tokenizer_proc.openai.chat_prompt import generation_prompt
from tokenizer_proc.openai.tools import ChatTool, ToolChoice, ToolPlan, plan_tools
from tokenizer_proc.openai.vllm_extras import AnswerExtras
from tokenizer_proc.request_edge.chat_messages import Message
from tokenizer_proc.request_edge.constraints import one_constraint
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.fields import NonNegInt, PositiveInt, TokenId
from tokenizer_proc.request_edge.known_fields import Refusal, declare

# --- /v1/completions -----------------------------------------------------------------------

# msgspec allows one array type per union, so the four prompt forms (a string, strings, token
# ids, lists of token ids) decode as "a string or a list of those"; ``prompts`` sorts them out.
PromptItem = str | TokenId | list[TokenId]


def _token_ids(items: list[PromptItem]) -> TypeGuard[list[int]]:
    return all(isinstance(p, int) for p in items)


def _strings_or_id_lists(items: list[PromptItem]) -> TypeGuard[list[str | list[int]]]:
    """All strings, or all lists of token ids (one prompt each)."""
    return all(isinstance(p, str) for p in items) or all(isinstance(p, list) for p in items)


class CompletionRequest(SamplingRequest, forbid_unknown_fields=True, kw_only=True):
    prompt: str | list[PromptItem]
    max_tokens: NonNegInt | None = None  # None: OpenAI's default, 16; 0 only with echo
    echo: bool | None = None
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's: a text prompt gets the tokenizer's special tokens (a Llama tokenizer's BOS)
    # unless false, as vLLM and SGLang encode prompts. None: not given, so true.
    add_special_tokens: bool | None = None

    _REFUSED: ClassVar[tuple[Refusal, ...]] = (
        ("suffix", bool, "suffix (insertion) is not supported by this server"),
        (
            "best_of",
            lambda v: v is not None and v != 1,
            "best_of is not supported by this server (use n)",
        ),
    ) + neutrals(("prompt_embeds", ()))

    DEFAULT_MAX_TOKENS: ClassVar[int] = 16

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.max_tokens == 0 and not self.echo:
            # With echo, 0 scores the prompt (its logprobs, no completion), as OpenAI's legacy
            # API and vLLM allow; without it there would be nothing to answer.
            raise RequestValidationError(
                "max_tokens 0 is only allowed with echo: true", "max_tokens"
            )

    def extras(self) -> AnswerExtras:
        """vLLM's: an echo with logprobs lists the prompt's logprobs too, with the same top
        count, unless ``prompt_logprobs`` says otherwise; a stream never lists them."""
        prompt_top = (
            self.prompt_logprobs
            if self.prompt_logprobs is not None
            else (self.logprobs if self.echo else None)
        )
        return AnswerExtras(
            output_top=self.logprobs,
            prompt_top=None if self.streaming else prompt_top,
            token_id_texts=bool(self.return_tokens_as_token_ids),
            token_ids=bool(self.return_token_ids),
        )

    def logprob_params(self) -> LogprobParams | None:
        """With ``echo`` and ``logprobs`` the prompt's logprobs too (from position 0, whose is
        null), as with ``prompt_logprobs``."""
        return self.extras().logprob_params(
            echo_prompt=bool(self.echo) and self.logprobs is not None
        )

    def max_output(self) -> int:
        """The output the request asks room for, as vLLM's truncation counts it."""
        return self.DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """Each prompt as a string or as token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise RequestValidationError("prompt must not be an empty list", "prompt")
        if _token_ids(prompt):
            return [prompt]
        if _strings_or_id_lists(prompt):
            return list(prompt)
        raise RequestValidationError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists "
            "of token ids (not a mix)",
            "prompt",
        )


# --- /v1/chat/completions ------------------------------------------------------------------


class ChatCompletionRequest(SamplingRequest, forbid_unknown_fields=True, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template, such as enable_thinking (SGLang's and vLLM's).
    chat_template_kwargs: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: Any = None
    web_search_options: Any = None
    # Documented, and asking for nothing this server could do differently: ignored.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's: false by default, since the chat template writes the BOS itself (a second
    # one would be the tokenizer's post-processor's).
    add_special_tokens: bool | None = None
    # vLLM's (tokenizer_proc.openai.vllm_extras); None: the default (false; true, or false with
    # continue_final_message: chat_prompt.generation_prompt; false).
    echo: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None

    _REFUSED: ClassVar[tuple[Refusal, ...]] = (
        ("functions", bool, "functions (function calling) are not supported by this server"),
        (
            "function_call",
            lambda v: v not in (None, "none"),
            "function_call is not supported by this server",
        ),
        (
            "modalities",
            lambda v: v is not None and "audio" in v,
            "audio output is not supported by this server",
        ),
        ("audio", lambda v: v is not None, "audio output is not supported by this server"),
        (
            "web_search_options",
            lambda v: v is not None,
            "web search is not supported by this server",
        ),
    ) + neutrals(
        # SGLang
        ("return_prompt_token_ids", (False,)),
        ("return_meta_info", (False,)),
        ("task", ()),
        # Taken with either value: an answer is split whenever --reasoning-parser is set.
        ("separate_reasoning", (True, False)),
        ("stream_reasoning", (True, False)),
        ("max_dynamic_patch", ()),
        ("min_dynamic_patch", ()),
        ("use_audio_in_video", (False,)),
        ("input_ids", ()),
        # vLLM
        ("documents", ()),
        ("chat_template", ()),
        ("mm_processor_kwargs", ()),
        ("include_reasoning", (True, False)),
    )

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        self.generation_prompt()  # both sent true is refused before anything else

    def generation_prompt(self) -> bool:
        """Whether the prompt ends with a generation prompt (``chat_prompt.generation_prompt``:
        true by default, false by default with ``continue_final_message``)."""
        return generation_prompt(self.add_generation_prompt, self.continue_final_message)

    def extras(self) -> AnswerExtras:
        """vLLM's: an echo lists the prompt's logprobs with ``top_logprobs``' count unless
        ``prompt_logprobs`` says otherwise (a stream never lists them); the answer's role is
        the last message's without a generation prompt, and an echo is that message's text
        when its role is the answer's."""
        if self.top_logprobs and not self.logprobs:
            raise RequestValidationError("top_logprobs needs logprobs: true", "top_logprobs")
        prompt_top = (
            self.prompt_logprobs
            if self.prompt_logprobs is not None
            else ((self.top_logprobs or 0) if self.echo else None)
        )
        last = self.messages[-1]
        role = "assistant" if self.generation_prompt() else last.role
        echo = (
            last.to_template(len(self.messages) - 1)["content"]
            if self.echo and last.role == role
            else ""
        )
        return AnswerExtras(
            output_top=(self.top_logprobs or 0) if self.logprobs else None,
            prompt_top=None if self.streaming else prompt_top,
            token_id_texts=bool(self.return_tokens_as_token_ids),
            token_ids=bool(self.return_token_ids),
            echo=echo,
            role=role,
        )

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current name) wins over ``max_tokens`` (deprecated);
        None when neither is given."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_template(i) for i, m in enumerate(self.messages)]

    def tool_plan(self) -> ToolPlan | None:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls)

    def chat_constraint(self, plan: ToolPlan | None) -> Constraint | None:
        """The request's structured output, or its tool choice's ("required" or a named
        function): one of the two, never both."""
        return one_constraint(self.constraint(), plan.constraint if plan is not None else None)

    def enable_thinking(self) -> bool:
        """``chat_template_kwargs.enable_thinking`` (Qwen3's switch), true unless false."""
        value = (self.chat_template_kwargs or {}).get("enable_thinking", True)
        return value is not False


# What the two routes decode: each request type plus the known fields of its refusals.
CompletionBody = declare(CompletionRequest, COMMON_REFUSED + CompletionRequest._REFUSED)
ChatCompletionBody = declare(ChatCompletionRequest, COMMON_REFUSED + ChatCompletionRequest._REFUSED)
