"""Typed request bodies of the OpenAI-compatible API (``/v1/completions``,
``/v1/chat/completions``).

Decoding with msgspec (``tokenizer_proc.native.schema.decode_body``) is the validation of types and ranges: a
wrong type, a value out of range or a field that OpenAI does not document fails with a 400
that names the field. Every field OpenAI documents for these two endpoints is accepted, so an
official client never trips on one. The fields this server cannot honour are refused with a
400 naming them when they ask for something (``functions``, ``audio``, ...);
the ones that ask for nothing here (``user``, ``store``, ``metadata``, ``service_tier``,
``prompt_cache_key``, ...) are accepted and ignored. Each request type lists its refusals in
one table, ``_REFUSED`` (plus ``COMMON_REFUSED``).

OpenAI's ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` work (docs/design.md section 10).
Beyond OpenAI, the SGLang/vLLM sampling extensions ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``no_stop_trim`` and ``stream_options.continuous_usage_stats`` work
(``extra_body`` in the official client), and so do vLLM's ``prompt_logprobs``,
``return_tokens_as_token_ids``, ``return_token_ids``, ``truncate_prompt_tokens`` and chat's
``echo``, ``add_generation_prompt`` and ``continue_final_message``
(``tokenizer_proc.openai.vllm_extras``). So do structured outputs, in OpenAI's, vLLM's and
SGLang's fields (``tokenizer_proc.request_edge.constraints``). Every other field of SGLang's and
vLLM's request schemas is known (``known_fields``): accepted at its neutral value, refused
otherwise. The routes decode ``CompletionBody`` and ``ChatCompletionBody``: the request types with those
known fields added.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, TypeGuard

import msgspec
from msgspec import Meta

from pipeline.io_struct import Constraint, LogprobParams, SamplingParams
from tokenizer_proc.request_edge.bootstrap import (
    Bootstrap,
    HostField,
    PortField,
    RoomField,
    bootstrap_of,
)
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.fields import (
    LogitBias,
    MinP,
    NonNegInt,
    Penalty,
    PositiveInt,
    RepetitionPenalty,
    StopTokenIds,
    TokenId,
    logit_bias_pairs,
)
from tokenizer_proc.openai.tools import ChatTool, ToolChoice, ToolPlan, plan_tools
from tokenizer_proc.request_edge.constraints import (
    JsonSchema,
    ResponseFormat,
    StructuredOutputs,
    choice_constraint,
    grammar_constraint,
    json_schema_constraint,
    one_constraint,
    regex_constraint,
    response_format_constraint,
    structured_outputs_constraint,
)
from tokenizer_proc.request_edge.known_fields import Refusal, declare, neutral, refuse
from tokenizer_proc.request_edge.chat_messages import Message
from tokenizer_proc.openai.vllm_extras import AnswerExtras, check_prompt_logprobs, check_truncation

MAX_CHOICES = 128
"""OpenAI's limit on ``n``; also the limit on prompts x n of one completions request."""

Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
# int64, so that seed + choice index (< MAX_CHOICES) still fits the wire's and torch's range.
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
Choices = Annotated[int, Meta(ge=1, le=MAX_CHOICES)]
StopString = Annotated[str, Meta(min_length=1)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    # vLLM's and SGLang's: usage (so far) on every chunk; guidellm counts tokens with it.
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None  # documented; this server never pads chunks


class SamplingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What completions and chat share: sampling, choices, streaming, the ignored fields."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: StopString | list[StopString] | None = None
    n: Choices | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None  # ignored
    # SGLang/vLLM extensions
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: NonNegInt | None = None
    ignore_eos: bool | None = None
    stop_token_ids: StopTokenIds | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None  # SGLang's: the text is not cut at a stop string
    # vLLM's extras (tokenizer_proc.openai.vllm_extras)
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # Structured outputs, one per request: OpenAI's, vLLM's (current and older), SGLang's.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonSchema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    json_schema: JsonSchema | None = None
    regex: str | None = None
    ebnf: str | None = None
    # PD disaggregation (set by sglang-router)
    bootstrap_room: RoomField | None = None
    bootstrap_endpoint: str | None = None
    bootstrap_host: HostField | None = None
    bootstrap_port: PortField | None = None

    _REFUSED: ClassVar[tuple[Refusal, ...]] = ()  # each request type's own refusals

    def extras(self) -> AnswerExtras:
        """What the answer shows beyond its text (vLLM's extras)."""
        return AnswerExtras()

    def logprob_params(self) -> LogprobParams | None:
        """The logprobs each choice asks of the scheduler; None: none."""
        return self.extras().logprob_params(echo_prompt=False)

    def constraint(self) -> Constraint | None:
        """The structured output every choice follows; None: unconstrained. Two fields that
        each ask for one are refused, naming the later one in this order."""
        return one_constraint(
            response_format_constraint(self.response_format),
            structured_outputs_constraint(self.structured_outputs),
            json_schema_constraint(self.guided_json, "guided_json"),
            regex_constraint(self.guided_regex, "guided_regex"),
            choice_constraint(self.guided_choice, "guided_choice"),
            grammar_constraint(self.guided_grammar, "guided_grammar"),
            json_schema_constraint(self.json_schema, "json_schema"),
            regex_constraint(self.regex, "regex"),
            grammar_constraint(self.ebnf, "ebnf"),
        )

    def bootstrap(self) -> Bootstrap | None:
        return bootstrap_of(
            self.bootstrap_room, self.bootstrap_endpoint, self.bootstrap_host, self.bootstrap_port
        )

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def refuse_unsupported(self) -> None:
        """Raises RequestValidationError for the first field that asks for a feature this
        server does not have."""
        refuse(self, COMMON_REFUSED + self._REFUSED)
        if self.stream_options is not None and not self.stream:
            raise RequestValidationError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.top_k == 0:
            raise RequestValidationError("top_k must be -1 (off) or at least 1", "top_k")
        check_prompt_logprobs(self.prompt_logprobs, self.streaming)
        check_truncation(self.truncate_prompt_tokens)

    def sampling(self, max_tokens: int) -> list[SamplingParams]:
        """The wire sampling params of each choice: a seeded request gives choice i the seed
        ``seed + i``, so its choices differ and each is reproducible."""
        if self.min_tokens is not None and self.min_tokens > max_tokens:
            raise RequestValidationError("min_tokens must not exceed max_tokens", "min_tokens")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        first = SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=self.min_tokens or 0,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            ignore_eos=bool(self.ignore_eos),
            skip_special_tokens=True
            if self.skip_special_tokens is None
            else self.skip_special_tokens,
            no_stop_trim=bool(self.no_stop_trim),
            min_p=self.min_p or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=logit_bias_pairs(self.logit_bias, "logit_bias"),
        )
        if self.seed is None:
            return [first] * self.choices
        return [msgspec.structs.replace(first, seed=self.seed + i) for i in range(self.choices)]


def _neutrals(*entries: tuple[str, tuple[object, ...]]) -> tuple[Refusal, ...]:
    return tuple(neutral(name, *values) for name, values in entries)


# Known to completions and chat alike (OpenAI's, SGLang's and vLLM's request fields) and not
# implemented here: accepted at the values that ask for nothing (``known_fields``).
COMMON_REFUSED: tuple[Refusal, ...] = _neutrals(
    # SGLang
    ("stop_regex", ([], "")),
    ("lora_path", ()),
    ("session_id", ()),
    ("session_params", ()),
    ("custom_params", ()),
    ("custom_logit_processor", ()),
    ("images_config", ()),
    ("routed_dp_rank", (0,)),  # one data-parallel rank here: rank 0 is every request's
    ("disagg_prefill_dp_rank", (0,)),
    ("data_parallel_rank", (0,)),
    ("rid", ()),
    ("extra_key", ()),
    ("cache_salt", ()),
    ("ngram_corpus_id", ()),
    ("priority", (0,)),
    ("custom_labels", ()),
    ("return_hidden_states", (False,)),
    ("return_routed_experts", (False,)),
    ("routed_experts_start_len", (0,)),
    ("return_cached_tokens_details", (False,)),
    # vLLM
    ("use_beam_search", (False,)),
    ("length_penalty", (1.0,)),
    ("spaces_between_special_tokens", (True,)),
    # Not no_stop_trim: vLLM cuts the text right after the stop string, SGLang keeps the
    # whole token that completed it.
    ("include_stop_str_in_output", (False,)),
    ("allowed_token_ids", ()),
    ("bad_words", ([],)),
    # Structured outputs have one backend: asking for it by name, or for vLLM's default, is served.
    ("guided_decoding_backend", ("xgrammar", "auto")),
    ("guided_whitespace_pattern", ()),
    ("structural_tag", ()),
    ("logits_processors", ()),
    ("request_id", ()),
    ("kv_transfer_params", ()),
    ("vllm_xargs", ()),
)


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
    ) + _neutrals(("prompt_embeds", ()))

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
    # vLLM's (tokenizer_proc.openai.vllm_extras); None: the default (false, true, false).
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
    ) + _neutrals(
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
        if self.continue_final_message and self.add_generation_prompt is not False:
            # vLLM's words; add_generation_prompt is true unless sent false.
            raise RequestValidationError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                "continue_final_message",
            )

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
        role = "assistant" if self.add_generation_prompt is not False else last.role
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
