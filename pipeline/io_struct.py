"""Every type that crosses a ZeroMQ socket, in one module; docs/wire.md describes each one
in language-neutral terms.

Field order is the wire contract: the structs are ``array_like`` (a frame is a msgpack
array, not a map), so new fields are appended last with a default. msgspec writes every
field of an ``array_like`` struct, defaults included (``omit_defaults`` does not shorten
one); a reader takes a shorter array (defaults fill the tail) and ignores extra trailing
elements. Output frames are columnar: per-row numbers travel as little-endian ``bytes``
columns of the dtypes below (``pipeline.columns`` packs and reads them), so a step of many
rows costs a few buffers, not an object per row. Per-request values that change only at a
few points of a request's life travel together in one ``RequestOutputStats``, on the rows
that need it; no per-row lists of them."""

from __future__ import annotations

from typing import Literal

import msgspec
import numpy as np

from pipeline.control_frames import ControlAnswer, ControlInput, LoraAdapter, PauseMode

# --- columns ---------------------------------------------------------------------------

REQ_ID_DTYPE = np.dtype("<i8")
TOKEN_DTYPE = np.dtype("<i4")
COUNT_DTYPE = np.dtype("<i4")
EMBEDDING_DTYPE = np.dtype("<f4")


# --- request side ----------------------------------------------------------------------


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """A request's sampling parameters, whatever dialect asked. A new field goes last, with a
    default that asks for nothing; scheduler_proc/sampling/param_columns.py declares where the
    scheduler carries it, docs/design/adding-a-sampling-parameter.md every other place."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    stream_interval: int | None = None  # None: the server's --stream-interval
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # docs/design.md section 10: min_p keeps p >= min_p * p_max; frequency and presence penalize
    # generated tokens (OpenAI), repetition prompt and output tokens (SGLang/vLLM); logit_bias
    # is (token id, bias) pairs, sorted by id, added to the logits before everything else.
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    # A cap on reasoning, forcing thinking_end's ids: scheduler_proc/sampling/thinking_budget.py
    thinking_budget: int | None = None  # output tokens before the end is forced; None: no cap
    thinking_end: tuple[int, ...] = ()  # the ids that end the reasoning (``</think>``'s)


MediaKind = Literal["image", "audio", "video"]


class MediaItem(msgspec.Struct, array_like=True, gc=False, frozen=True):
    kind: MediaKind
    num_tokens: int


class TraceContext(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """W3C trace context of the incoming HTTP request."""

    traceparent: str | None = None
    tracestate: str | None = None


class LogprobParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The logprobs a request asks for (docs/design/logprobs.md): the chosen token's
    always, the ``top_logprobs_num`` most likely tokens at each position (0..20), the
    logprobs of the ``token_ids_logprob`` ids at each position, and from
    ``logprob_start_len`` (-1: none) the prompt's. Values are the model's raw log-softmax,
    before bias, penalties, temperature and cuts."""

    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    token_ids_logprob: tuple[int, ...] = ()
    # The answer shows each entry's token text: the detokenizer sends the texts with the frame.
    return_text: bool = False


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class Constraint(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Structured output: what the request's tokens must spell, whatever dialect asked for it
    (OpenAI's ``response_format``, vLLM's ``structured_outputs``/``guided_*``, SGLang's
    ``json_schema``/``regex``/``ebnf``); compiled by the scheduler (xgrammar), cached by
    ``(kind, spec)``. ``kind`` (``CONSTRAINT_KINDS``) and its ``spec``: ``json_schema``, the
    schema as JSON text; ``json_object``, empty (any JSON object); ``regex``, the pattern;
    ``grammar``, EBNF (xgrammar's GBNF dialect); ``choice``, a JSON list of the strings
    allowed. ``param``: the request field that asked for it, named in the 400 an invalid
    ``spec`` gets (the engine's reason follows). ``any_whitespace``: False writes compact JSON,
    no whitespace but one space after ``,`` and ``:`` (vLLM's ``disable_any_whitespace``); part
    of the compile's key. ``reasoning_end``: the token ids that end the answer's reasoning; the
    grammar applies from the token after them (empty: from the first token)."""

    kind: str
    spec: str
    param: str
    any_whitespace: bool = True
    reasoning_end: tuple[int, ...] = ()


class LoraRef(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """The adapter a request names, as the API worker resolved it from the scheduler's last
    report: its name and load id (``LoraAdapter.id``)."""

    name: str
    id: int


class TokenizedGenerateReqInput(
    msgspec.Struct, tag="gen", array_like=True, omit_defaults=True, gc=False
):
    rid: str
    req_id: int
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool
    arrival_time: float
    media: tuple[MediaItem, ...] = ()
    trace: TraceContext | None = None
    # PD: the room pairs a request's prefill-server and decode-server halves; a decode
    # server fetches the KV from the prefill scheduler at ``bootstrap_endpoint``.
    bootstrap_endpoint: str | None = None
    bootstrap_room: int | None = None
    logprobs: LogprobParams | None = None  # None: no logprobs asked
    constraint: Constraint | None = None  # structured output; None: unconstrained
    # The tenant's prefix-cache salt: requests share cached KV only under the same salt.
    cache_salt: str | None = None
    priority: int = 0  # under priority scheduling; its order is the server's flag's
    lora: LoraRef | None = None  # the adapter it runs with; None: the base model


class TokenizedEmbeddingReqInput(
    msgspec.Struct, tag="emb", array_like=True, omit_defaults=True, gc=False
):
    rid: str
    req_id: int
    input_ids: list[int]
    arrival_time: float
    media: tuple[MediaItem, ...] = ()
    trace: TraceContext | None = None


class AbortReq(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True, gc=False):
    """Stops one request (``req_id``, or ``rid`` when the asking API worker does not hold
    it), or with ``abort_all`` every request, or only ``worker``'s. A non-zero
    ``control_id`` asks for an ``AbortResult`` of the same id."""

    req_id: int | None = None
    abort_all: bool = False
    reason: str = "aborted by client"
    rid: str | None = None
    worker: int | None = None  # with abort_all: only the requests of this API worker
    control_id: int = 0


SchedulerInput = TokenizedGenerateReqInput | TokenizedEmbeddingReqInput | AbortReq | ControlInput


# --- finish reasons --------------------------------------------------------------------


class FinishStop(msgspec.Struct, tag="stop", array_like=True, gc=False, frozen=True):
    matched: int | str


class FinishLength(msgspec.Struct, tag="length", array_like=True, gc=False, frozen=True):
    length: int


class FinishAbort(msgspec.Struct, tag="abort", array_like=True, gc=False, frozen=True):
    message: str
    status_code: int = 400
    # Seconds after which a retry may succeed; only on a refusal for a full waiting queue (503).
    retry_after: float | None = None


FinishReason = FinishStop | FinishLength | FinishAbort


# --- per-request stats -----------------------------------------------------------------


class SchedulerTimeStats(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True
):
    """Wall-clock seconds (``time.time()``) and durations recorded by the scheduler."""

    wait_queue_entry_time: float | None = None
    forward_entry_time: float | None = None
    prefill_finished_time: float | None = None
    completion_time: float | None = None
    queue_time: float = 0.0  # summed over every stay in the waiting queue
    storage_prefetch_wait: float = 0.0
    bootstrap_done_time: float | None = None
    decode_prebuilt_finish_time: float | None = None
    grammar_wait: float = 0.0  # a constrained request's wait for its grammar to compile (0: cached)


class CachedTokensDetails(msgspec.Struct, omit_defaults=True, gc=False, frozen=True):
    """A map on the wire on purpose: it is shown to users as-is, and the storage keys
    appear only while HiCache storage is attached."""

    device: int
    host: int
    storage: int | None = None
    storage_backend: str | None = None


class RequestOutputStats(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True
):
    """Frozen: a ``Req`` replaces its stats through one setter, so a sent object never
    changes under a consumer that still holds it."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_details: CachedTokensDetails | None = None
    num_retractions: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    video_tokens: int = 0
    time_stats: SchedulerTimeStats | None = None
    # The version of the weights that produced the request's latest tokens (None: not
    # admitted yet); it changes when new weights are swapped in while the request lives.
    weight_version: str | None = None
    # Speculative decoding (zeros when off): verify passes in which the request had drafts,
    # its draft tokens, and those accepted (docs/design/speculative.md).
    spec_verify_ct: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


# --- output side -----------------------------------------------------------------------


class UsageColumns(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """``--dense-usage-columns``: five COUNT_DTYPE columns, one value on every row of a
    ``BatchTokenIDOutput``, read from the row's current ``Req.stats`` when the row is built.
    For a consumer that keeps no per-request state (a gateway in another language; its
    schema: docs/wire.md section 6); the same values also travel in ``request_stats`` on
    the rows that are due (docs/design/stats.md)."""

    prompt_tokens: bytes
    cached_tokens: bytes
    image_tokens: bytes
    audio_tokens: bytes
    video_tokens: bytes


class BatchTokenIDOutput(msgspec.Struct, tag="tok", array_like=True, gc=False):
    """Scheduler -> detokenizer. Columns: req_ids (REQ_ID_DTYPE), output_ids (flat
    TOKEN_DTYPE), output_counts (COUNT_DTYPE, tokens per row), completion_tokens
    (COUNT_DTYPE, cumulative through the stop). ``usage`` is None unless the scheduler
    runs with ``--dense-usage-columns`` (then it is on every frame, every row)."""

    req_ids: bytes
    output_ids: bytes
    output_counts: bytes
    completion_tokens: bytes
    finished_reasons: list[FinishReason | None] | None = None
    request_stats: list[RequestOutputStats | None] | None = None
    # Per-row flags the detokenizer needs on a request's first row only.
    decode_options: list[DecodeOptions | None] | None = None
    # --dense-usage-columns only; appended last so older decoders ignore it.
    usage: UsageColumns | None = None
    # Logprobs of the rows that asked (output and prompt); one nil when no row did.
    logprobs: FrameLogprobs | None = None


class OutputLogprobs(msgspec.Struct, array_like=True, gc=False):
    """The logprobs of a frame's rows that asked for them, as columns laid out row by row,
    token by token (docs/wire.md): ``rows`` (int32, ascending) index the frame's rows; per
    token of a listed row i, ``token_logprobs`` (float32), ``top_k[i]`` pairs of ``top_ids``
    and ``top_logprobs``, ``ids_count[i]`` ``ids_logprobs``, and a prompt block's ``ranks``."""

    rows: bytes
    token_logprobs: bytes
    top_k: bytes
    top_ids: bytes
    top_logprobs: bytes
    ids_count: bytes
    ids_logprobs: bytes
    ranks: bytes = b""  # int32 per token: values at or above its own (vLLM's rank); b"": none


class InputLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs (``logprob_start_len`` s >= 0) on a request's first row: of prompt
    positions max(s, 1) on, each from the logits before it (position 0 has none), laid out as
    ``OutputLogprobs``, ranks included; ``counts`` (int32): each listed row's positions."""

    counts: bytes
    logprobs: OutputLogprobs


class FrameLogprobs(msgspec.Struct, array_like=True, gc=False):
    """A frame's logprobs: of its rows' output tokens, and prompt logprobs on requests'
    first rows; each nil when no row has any."""

    output: OutputLogprobs | None = None
    input: InputLogprobs | None = None


class DecodeOptions(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """What the detokenizer needs to know about a request; sent on its first row."""

    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    no_stop_trim: bool = False
    stream: bool = True
    logprob_texts: bool = False  # send the texts of this request's logprob tokens


class TokenTexts(msgspec.Struct, array_like=True, gc=False):
    """Single-token texts (each token decoded on its own, special tokens shown) for the
    ids in a frame's logprob columns: ``ids`` (int32, ascending, each once) and their
    texts in that order."""

    ids: bytes
    texts: list[str]


class BatchStrOutput(msgspec.Struct, tag="str", array_like=True, gc=False):
    """Detokenizer -> tokenizer manager. Same columns as ``BatchTokenIDOutput`` plus
    the text delta of each row; ``request_stats`` passes through unchanged."""

    req_ids: bytes
    text_deltas: list[str]
    output_ids: bytes
    output_counts: bytes
    completion_tokens: bytes
    finished_reasons: list[FinishReason | None] | None = None
    request_stats: list[RequestOutputStats | None] | None = None
    logprobs: FrameLogprobs | None = None  # passed through from BatchTokenIDOutput
    # The texts of the tokens in ``logprobs`` of the rows whose requests show them.
    token_texts: TokenTexts | None = None


class BatchEmbeddingOutput(msgspec.Struct, tag="emb_out", array_like=True, gc=False):
    """Scheduler -> tokenizer manager (through the detokenizer). Every row is finished,
    so every row carries stats."""

    req_ids: bytes
    embeddings: bytes  # float32 matrix, row-major
    shape: tuple[int, int]
    request_stats: list[RequestOutputStats]
    finished_reasons: list[FinishReason | None] | None = None


class SchedulerStatsReport(msgspec.Struct, tag="sched_stats", array_like=True, gc=False):
    """The scheduler's gauges, sent about twice a second while it works (and once when it
    goes idle) through the detokenizer, so one /metrics endpoint serves every process."""

    num_running_reqs: int
    num_queue_reqs: int
    token_usage: float  # KV held by requests (not by evictable cache) / pool capacity
    cache_hit_rate: float  # cached / prompt tokens of the prefills since the last report
    gen_throughput: float  # generated tokens per second since the last report
    num_retracted_reqs: int  # requests retracted since the last report
    num_retracted_requests_total: int
    kv_used_tokens: int
    kv_capacity: int
    cached_tokens_in_tree: int
    forward_steps_total: int
    live_reqs: int  # requests the scheduler holds in any state
    instance: int  # random per scheduler start: a change means every in-flight request was lost
    # The detokenizer's live decode states (it fills this in); -1: not filled in.
    detokenizer_live_reqs: int = -1
    # HiCache (zeros and None when it is off)
    hicache_host_used_tokens: int = 0
    hicache_host_capacity: int = 0
    hicache_storage_backend: str | None = None
    forward_tokens_total: int = 0  # prompt (cached too) + generated tokens since the start
    # The scheduler's torch intra-op threads now (scheduler_proc/model/thread_budget.py).
    torch_threads: int = 0
    num_grammar_queue_reqs: int = 0  # of num_queue_reqs, those whose grammar still compiles
    decode_sum_seq_lens: int = 0  # prompt + generated tokens of the running requests
    # Rollout control (scheduler_proc/rollout.py): the pause mode (None: running), the
    # weights' version, running totals, and the seconds of the updates since the last report.
    paused: PauseMode | None = None
    weight_version: str = "default"
    paused_seconds_total: float = 0.0
    weight_updates_ok: int = 0
    weight_updates_failed: int = 0
    weight_update_seconds: tuple[float, ...] = ()
    # LoRA (zeros when off): every adapter served, the slots, and the adapters of the
    # running and waiting requests (vLLM's lora_requests_info labels).
    lora_adapters: tuple[LoraAdapter, ...] = ()
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Speculative decoding (zeros when off), running totals since the start: drafts (a
    # request's drafts in one step), draft tokens, accepted tokens, and accepted tokens by
    # draft position (index 0: the first draft), as vLLM's spec_decode counters.
    spec_num_speculative_tokens: int = 0  # k; 0: speculation off
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


DetokenizerInput = BatchTokenIDOutput | BatchEmbeddingOutput | SchedulerStatsReport | ControlAnswer
TokenizerManagerInput = BatchStrOutput | BatchEmbeddingOutput | SchedulerStatsReport | ControlAnswer


# --- PD disaggregation: KV transfer between a prefill and a decode scheduler -------------


class KVLayout(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """Shape of one token's KV: both sides must agree, or the bytes would be misread."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"


class KVFetch(msgspec.Struct, tag="kv_fetch", array_like=True, gc=False):
    """Decode -> prefill scheduler (DEALER -> ROUTER): send the KV of ``token_ids`` for
    ``room``. Attempt 0 pairs with the prefill API's request of the same room; a later one
    is a re-bootstrap after a decode-side retraction (docs/wire.md section 8)."""

    room: int
    attempt: int
    token_ids: list[int]
    prompt_tokens: int
    layout: KVLayout
    lora: str | None = None  # the adapter the KV is computed with (its name); None: the base


class KVTransferHeader(msgspec.Struct, tag="kv_header", array_like=True, gc=False):
    """Prefill -> decode: the first frame of a transfer. When ``ok``, two raw frames (never
    pickle) follow with K and V, shaped [num_layers, num_tokens, num_kv_heads, head_dim]
    (docs/wire.md section 8); when not, ``error`` says why and nothing follows."""

    room: int
    attempt: int
    ok: bool
    error: str = ""
    num_tokens: int = 0
    layout: KVLayout | None = None
    first_token: int | None = None  # attempt 0: the token the prefill server sampled
    cached_tokens: int = 0  # of the prompt, served from the prefill server's cache
    cached_tokens_details: CachedTokensDetails | None = None
    prefill_finished_time: float | None = None
    # Attempt 0 of a request that asked for logprobs: its first token's (``output``) and its
    # prompt's (``input``, from ``logprob_start_len``) as the prefill server computed them,
    # one row each (row 0); a re-bootstrap carries none (nothing is sent twice).
    logprobs: FrameLogprobs | None = None


# --- control ---------------------------------------------------------------------------


class ProcessReady(msgspec.Struct, tag="ready", array_like=True, gc=False):
    """A child tells the supervisor it is serving."""

    name: str
    pid: int
