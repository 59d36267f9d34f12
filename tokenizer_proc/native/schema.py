"""Typed request bodies of the native API. Decoding with msgspec is the validation: a
wrong type, an unknown key or a value out of range fails with a message that names the
field (``... - at `$.sampling_params.max_new_tokens```)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

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
from tokenizer_proc.request_edge.constraints import (
    grammar_constraint,
    json_schema_constraint,
    one_constraint,
    regex_constraint,
)
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.fields import (
    MAX_TOKEN_IDS_LOGPROB,
    MAX_TOP_LOGPROBS,
    CacheSalt,
    LogitBias,
    MinP,
    NonNegInt,
    Penalty,
    PositiveInt,
    Priority,
    RepetitionPenalty,
    StopTokenIds,
    TokenId,
    logit_bias_pairs,
)
from tokenizer_proc.request_edge.known_fields import Refusal, declare, neutral, refuse


Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]

# SGLang's sampling parameters that tokenpipe does not implement, at the values that ask for
# nothing (``known_fields``). They are declared as fields below too: a nested struct cannot be
# extended the way ``declare`` extends a whole body.
SAMPLING_REFUSED: tuple[Refusal, ...] = tuple(
    neutral(name, *values)
    for name, values in (
        ("stop_regex", ([], "")),
        ("n", (1,)),
        ("structural_tag", ()),
        ("spaces_between_special_tokens", (True,)),
        ("custom_params", ({},)),
    )
)


class GenerateSamplingParams(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # 0 scores the prompt, as in SGLang: no output, its logprobs when asked.
    max_new_tokens: NonNegInt = 128
    min_new_tokens: NonNegInt = 0
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    seed: Seed | None = None
    sampling_seed: Seed | None = None  # SGLang's name for ``seed``
    stop: str | list[str] | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    stream_interval: PositiveInt | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    min_p: MinP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    logit_bias: LogitBias | None = None
    # Structured outputs, SGLang's way: the schema as JSON text, a regex, or an EBNF grammar
    # (at most one of them: ``constraint``).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Known, not implemented: see SAMPLING_REFUSED.
    stop_regex: Any = None
    n: Any = None
    structural_tag: Any = None
    spaces_between_special_tokens: Any = None
    custom_params: Any = None

    def to_wire(self) -> SamplingParams:
        refuse(self, SAMPLING_REFUSED, where="sampling_params.")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(s == "" for s in stop):
            raise RequestValidationError(
                "sampling_params.stop must not contain an empty string", "sampling_params.stop"
            )
        if self.top_k == 0:
            raise RequestValidationError(
                "sampling_params.top_k must be -1 (off) or at least 1", "sampling_params.top_k"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestValidationError(
                "sampling_params.min_new_tokens must not exceed max_new_tokens",
                "sampling_params.min_new_tokens",
            )
        if (
            self.seed is not None
            and self.sampling_seed is not None
            and self.seed != self.sampling_seed
        ):
            raise RequestValidationError(
                "sampling_params.seed and sampling_params.sampling_seed name the same seed; they "
                "differ",
                "sampling_params.sampling_seed",
            )
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed if self.seed is not None else self.sampling_seed,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            stop=tuple(stop),
            ignore_eos=self.ignore_eos,
            stream_interval=self.stream_interval,
            skip_special_tokens=self.skip_special_tokens,
            no_stop_trim=self.no_stop_trim,
            min_p=self.min_p or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=logit_bias_pairs(self.logit_bias, "sampling_params.logit_bias"),
        )

    def constraint(self) -> Constraint | None:
        """The structured output asked for, named by its field (``sampling_params.regex``...);
        two at once are refused, as SGLang refuses them."""
        where = "sampling_params."
        return one_constraint(
            json_schema_constraint(self.json_schema, where + "json_schema"),
            regex_constraint(self.regex, where + "regex"),
            grammar_constraint(self.ebnf, where + "ebnf"),
        )


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # SGLang's words lead in a refusal both peers word (request_edge.peer_wording).
    PEER_WORDING: ClassVar[str] = "sglang"

    text: str | None = None
    input_ids: list[TokenId] | None = None
    sampling_params: GenerateSamplingParams = msgspec.field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    image_data: list[str] | str | None = None
    audio_data: list[str] | str | None = None
    video_data: list[str] | str | None = None
    # PD disaggregation (set by sglang-router)
    bootstrap_room: RoomField | None = None
    bootstrap_endpoint: str | None = None
    bootstrap_host: HostField | None = None
    bootstrap_port: PortField | None = None
    model: str | None = None  # sglang-router sends null; a name must be the served model's
    # The adapter, by name (docs/design/lora.md); a batch's may list one per prompt.
    lora_path: str | None = None
    # Logprobs (docs/design.md section 11), SGLang's names.
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1
    token_ids_logprob: Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = (
        None
    )
    return_text_in_logprobs: bool = False
    # Tenancy (docs/design/tenancy.md): vLLM's prefix-cache salt, and the scheduling priority
    # (null: 0, as SGLang sends it).
    cache_salt: CacheSalt | None = None
    priority: Priority | None = None

    def logprob_params(self) -> LogprobParams | None:
        """What the scheduler computes; None when no logprobs are asked."""
        if not self.return_logprob:
            return None
        return LogprobParams(
            top_logprobs_num=self.top_logprobs_num,
            logprob_start_len=self.logprob_start_len,
            token_ids_logprob=tuple(self.token_ids_logprob or ()),
            return_text=self.return_text_in_logprobs,
        )

    def bootstrap(self) -> Bootstrap | None:
        return bootstrap_of(
            self.bootstrap_room, self.bootstrap_endpoint, self.bootstrap_host, self.bootstrap_port
        )

    def refuse_unsupported(self) -> None:
        refuse(self, GENERATE_REFUSED)


# The fields of SGLang's GenerateReqInput that tokenpipe does not implement, at the values
# that ask for nothing. sglang-router sends several with every body.
GENERATE_REFUSED: tuple[Refusal, ...] = tuple(
    neutral(name, *values)
    for name, values in (
        ("session_id", ()),
        ("input_embeds", ()),
        ("mm_hashes", ()),
        ("mm_content_hashes", ()),
        ("use_audio_in_video", (False,)),
        ("video_config", ()),
        ("return_sampling_mask", (False,)),
        ("return_flat_raw_top_logprobs", (False,)),
        ("return_flat_raw_top_logprobs_b64", (False,)),
        ("log_metrics", (True,)),
        ("return_hidden_states", (False,)),
        ("return_routed_experts", (False,)),
        ("routed_experts_start_len", (0,)),
        ("return_indexer_topk", (False,)),
        ("modalities", ()),
        ("session_params", ()),
        ("lora_id", ()),
        ("custom_logit_processor", ()),
        ("positional_embed_overrides", ()),
        ("bootstrap_pair_key", ()),
        ("decode_tp_size", ()),
        ("routed_dp_rank", (0,)),  # one data-parallel rank here: rank 0 is every request's
        ("data_parallel_rank", (0,)),
        ("disagg_prefill_dp_rank", (0,)),
        ("kv_router_hint", ()),
        ("routing_key", ()),
        ("conversation_id", ()),
        ("http_worker_ipc", ()),
        ("background", (False,)),
        ("require_reasoning", (False,)),
        ("max_thinking_tokens", ()),
        ("extra_key", ()),
        ("no_logs", (False,)),
        ("custom_labels", ()),
        ("return_bytes", (False,)),
        ("return_entropy", (False,)),
        ("return_prompt_token_ids", (False,)),
        ("external_trace_header", ()),
        ("received_time", ()),
        ("need_wait_for_mm_inputs", (False,)),
        ("num_items_assigned", ()),
        ("encoder_urls", ()),
        ("max_dynamic_patch", ()),
        ("min_dynamic_patch", ()),
        ("image_max_dynamic_patch", ()),
        ("video_max_dynamic_patch", ()),
        ("images_config", ()),
        ("multi_item_delimiter_indices", ()),
    )
)
# What /generate decodes: GenerateRequest plus the known fields above.
GenerateBody = declare(GenerateRequest, GENERATE_REFUSED)
