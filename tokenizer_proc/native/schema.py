"""Typed request bodies of the native API. Decoding with msgspec is the validation: a
wrong type, an unknown key or a value out of range fails with a message that names the
field (``... - at `$.sampling_params.max_new_tokens```)."""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from pipeline.io_struct import Constraint, LogprobParams, SamplingParams
from pipeline.request_limits import MAX_STOP_TOKEN_IDS
from tokenizer_proc.openai.constraints import (
    grammar_constraint,
    json_schema_constraint,
    one_constraint,
    regex_constraint,
)
from tokenizer_proc.openai.known_fields import Refusal, declare, neutral, refuse
from tokenizer_proc.request_errors import RequestValidationError

NonNegInt = Annotated[int, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
TokenId = Annotated[int, Meta(ge=0)]


Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]

# The sampling parameters of docs/design.md section 10 beyond temperature/top_p/top_k, with the ranges
# all three APIs share. Null is the neutral value (0, or 1 for repetition_penalty).
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # OpenAI's frequency and presence range
# SGLang allows [0, 2], vLLM anything above 0: a positive logit is divided by it, so not 0.
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
MAX_TOP_LOGPROBS = 20  # top_logprobs_num, as OpenAI's top_logprobs
MAX_TOKEN_IDS_LOGPROB = 128  # token_ids_logprob entries: each costs a float per token on the wire
MAX_LOGIT_BIAS = 1024
"""Entries of one request's ``logit_bias``: vLLM v1's limit (OpenAI documents none)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Token id -> bias, the id written as a string (JSON object keys are strings). The keys and
# values are checked by ``logit_bias_pairs`` so that the message can name the bad entry; the
# ids against the vocabulary by ``RequestChecks.validate_sampling``.
LogitBias = Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)]
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,18}")
# Bounded as logit_bias is: every running request shares one stop table as wide as the
# widest request's list, so one long list would slow every stop check of the batch.
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]


def logit_bias_pairs(bias: dict[str, float] | None, param: str) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as the wire carries it: (token id, bias) pairs sorted by id. ``param``
    is the field's path in the body, for the messages."""
    if not bias:
        return ()
    low, high = LOGIT_BIAS_RANGE
    pairs: dict[int, float] = {}
    for key, value in bias.items():
        if _TOKEN_ID_KEY.fullmatch(key) is None:
            raise RequestValidationError(
                f"{param} key {key[:40]!r} is not a token id: keys are non-negative integers written as strings",
                param,
            )
        if not low <= value <= high:
            raise RequestValidationError(
                f"{param}[{key!r}] is {value}; a bias must be in [{low:g}, {high:g}]", param
            )
        token = int(key)
        if token in pairs:  # "7" and "007"
            raise RequestValidationError(f"{param} names token id {token} twice", param)
        pairs[token] = value
    return tuple(sorted(pairs.items()))


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
                "sampling_params.seed and sampling_params.sampling_seed name the same seed; they differ",
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


Room = Annotated[int, Meta(ge=0, le=2**63 - 1)]
Port = Annotated[int, Meta(ge=1, le=65535)]
# tcp://host:port or ipc:///absolute/path: anything else would make ZeroMQ refuse it later.
_ENDPOINT = re.compile(
    r"tcp://[A-Za-z0-9.\-]+:[0-9]{1,5}|tcp://\[[0-9A-Fa-f:.]+\]:[0-9]{1,5}|ipc:///[^\s\x00]+"
)


class Bootstrap(msgspec.Struct, frozen=True):
    """PD disaggregation: the room shared by a request's prefill and decode halves, and the
    prefill server's KV endpoint the decode server fetches from."""

    room: int
    endpoint: str


# SGLang's router sends each bootstrap field as a scalar, or as a list with one entry per
# prompt of a batch; tokenpipe's requests carry one prompt, so a list must have one entry.
RoomField = Room | list[Room]
HostField = str | list[str]
PortField = Port | list[Port]


_T = TypeVar("_T")


def _single(value: _T | list[_T] | None, name: str) -> _T | None:
    if not isinstance(value, list):
        return value
    if len(value) != 1:
        raise RequestValidationError(
            f"{name} has {len(value)} entries; a request here has one prompt, so give one", name
        )
    return value[0]


def bootstrap_of(
    room: RoomField | None, endpoint: str | None, host: HostField | None, port: PortField | None
) -> Bootstrap | None:
    """The bootstrap fields of a request body (SGLang's ``bootstrap_host``/``bootstrap_port``,
    or a ZeroMQ ``bootstrap_endpoint``), or None when it has none."""
    room, host, port = (
        _single(room, "bootstrap_room"),
        _single(host, "bootstrap_host"),
        _single(port, "bootstrap_port"),
    )
    if room is None and endpoint is None and host is None and port is None:
        return None
    if room is None:
        raise RequestValidationError(
            "bootstrap_room is required with the other bootstrap fields", "bootstrap_room"
        )
    if endpoint is None:
        if host is None:
            raise RequestValidationError(
                "give bootstrap_endpoint, or bootstrap_host (and bootstrap_port)",
                "bootstrap_endpoint",
            )
        endpoint = (
            f"tcp://{f'[{host}]' if ':' in host else host}:{port if port is not None else 8998}"
        )
    if len(endpoint) > 512 or _ENDPOINT.fullmatch(endpoint) is None:
        raise RequestValidationError(
            f"bootstrap endpoint {endpoint[:100]!r} is not tcp://host:port or ipc:///path",
            "bootstrap_endpoint",
        )
    return Bootstrap(room=room, endpoint=endpoint)


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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
    # Logprobs (docs/design.md section 11), SGLang's names.
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    logprob_start_len: Annotated[int, Meta(ge=-1)] = -1
    token_ids_logprob: Annotated[list[TokenId], Meta(max_length=MAX_TOKEN_IDS_LOGPROB)] | None = (
        None
    )
    return_text_in_logprobs: bool = False

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
        ("lora_path", ()),
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
        ("priority", (0,)),
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
        ("cache_salt", ()),
    )
)
# What /generate decodes: GenerateRequest plus the known fields above.
GenerateBody = declare(GenerateRequest, GENERATE_REFUSED)


class AbortRequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    rid: str | None = None
    abort_all: bool = False


def decode_body(body: bytes, type_: type[_T]) -> _T:
    """Decodes a JSON body into ``type_``; every failure is a RequestValidationError."""
    if not body:
        raise RequestValidationError("request body is empty; expected a JSON object")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestValidationError(f"request body is not valid UTF-8 (byte {exc.start})") from exc
    try:
        obj = msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(str(exc), _param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise RequestValidationError(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deep nesting inside a free-form (Any) field
        raise RequestValidationError("request body is nested too deeply") from exc
    if _LONG_DIGITS.search(body) is not None:
        where = _int_out_of_range(obj)
        if where is not None:
            message = f"Integer out of range: must fit a signed 64-bit integer - at `{where}`"
            raise RequestValidationError(message, _param_of(message))
    return obj


def convert_body(obj: object, type_: type[_T]) -> _T:
    """``decode_body`` for a body already decoded to Python objects (one item of a /generate
    batch): the same type checks, and the same messages."""
    try:
        converted = msgspec.convert(obj, type=type_)
    except msgspec.ValidationError as exc:
        raise RequestValidationError(str(exc), _param_of(str(exc))) from exc
    where = _int_out_of_range(converted)
    if where is not None:
        message = f"Integer out of range: must fit a signed 64-bit integer - at `{where}`"
        raise RequestValidationError(message, _param_of(message))
    return converted


# msgspec decodes a JSON integer of any size into an `int` field, but no wire field can carry
# one beyond 64 bits (msgpack) and no field means anything there: refuse it as the client's
# error here rather than fail with a 500 when the request is encoded for the scheduler. Only an
# integer literal of 19 or more digits can be out of range, so other bodies skip the walk.
_LONG_DIGITS = re.compile(rb"\d{19}")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int_out_of_range(obj: object) -> str | None:
    """The path (``$.sampling_params.top_k``) of an int outside int64, or None."""
    stack: list[tuple[object, str]] = [(obj, "$")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                return path
        elif isinstance(value, msgspec.Struct):
            stack.extend(
                (getattr(value, name), f"{path}.{name}") for name in value.__struct_fields__
            )
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, dict):
            stack.extend((item, f"{path}.{key}") for key, item in value.items())
    return None


def _param_of(message: str) -> str | None:
    """``... - at `$.sampling_params.top_p``` -> ``sampling_params.top_p``; an unknown key
    names itself: ``Object contains unknown field `foo` - at `$.x``` -> ``x.foo``; a value of
    an object names the object: ``- at `$.logit_bias[...]``` -> ``logit_bias``."""
    marker = "- at `$."
    at = message.rfind(marker)
    where = message[at + len(marker) :].rstrip("`").removesuffix("[...]") if at >= 0 else None
    unknown = "unknown field `"
    if message.startswith("Object contains " + unknown):
        name = message[len("Object contains " + unknown) :].split("`", 1)[0]
        return f"{where}.{name}" if where else name
    return where
