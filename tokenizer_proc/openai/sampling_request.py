"""What the OpenAI completions and chat request bodies share (``SamplingRequest``): sampling,
choices, streaming, structured outputs, PD's bootstrap fields, and the known fields both
refuse (``COMMON_REFUSED``).

OpenAI's ``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` work (docs/design.md
section 10). Beyond OpenAI, the SGLang/vLLM sampling extensions (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``no_stop_trim``, ``stream_options.continuous_usage_stats``) work
(``extra_body`` in the official client), and so do structured outputs in OpenAI's, vLLM's and
SGLang's fields (``tokenizer_proc.request_edge.constraints``).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

from pipeline.io_struct import Constraint, LogprobParams, SamplingParams
from tokenizer_proc.openai.vllm_extras import AnswerExtras, check_prompt_logprobs, check_truncation
from tokenizer_proc.request_edge.bootstrap import (
    Bootstrap,
    HostField,
    PortField,
    RoomField,
    bootstrap_of,
)
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
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.fields import (
    LogitBias,
    MinP,
    CacheSalt,
    NonNegInt,
    Penalty,
    Priority,
    RepetitionPenalty,
    StopTokenIds,
    logit_bias_pairs,
)
from tokenizer_proc.request_edge.known_fields import Refusal, neutral, refuse

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
    # SGLang's adapter by name (docs/design/lora.md); vLLM's is the adapter's name as `model`.
    lora_path: str | None = None
    # Tenancy (docs/design/tenancy.md): vLLM's prefix-cache salt and scheduling priority.
    cache_salt: CacheSalt | None = None
    priority: Priority = 0
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


def neutrals(*entries: tuple[str, tuple[object, ...]]) -> tuple[Refusal, ...]:
    """A ``known_fields.neutral`` refusal for each (field, accepted values)."""
    return tuple(neutral(name, *values) for name, values in entries)


# Known to completions and chat alike (OpenAI's, SGLang's and vLLM's request fields) and not
# implemented here: accepted at the values that ask for nothing (``known_fields``).
COMMON_REFUSED: tuple[Refusal, ...] = neutrals(
    # SGLang
    ("stop_regex", ([], "")),
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
    ("ngram_corpus_id", ()),
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
