"""A request's way in: the scheduler's ``Req`` for an arriving message, whether the scheduler
can ever serve it, the answer when the waiting queue is full (both checked once, where a
request enters the scheduler: a refused request finishes with a 400 or a 503 instead of
crashing or starving the scheduler), and the stats its admission into a prefill records."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipeline.io_struct import (
    CONSTRAINT_KINDS,
    Constraint,
    FinishAbort,
    LogprobParams,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from pipeline.request_limits import MAX_STOP_TOKEN_IDS
from scheduler_proc.cache.hicache import Fetched, cached_details
from scheduler_proc.decode_mode import DecodeMode
from scheduler_proc.req import Req, StatsPending

# What a refusal for a full waiting queue tells the client to wait before retrying: about
# the time a few requests take to be admitted and finish on a small server; a hint only.
QUEUE_FULL_RETRY_AFTER = 1.0

# An embedding request generates nothing: it finishes when its prompt is prefilled.
_EMBEDDING_SAMPLING = SamplingParams(max_new_tokens=0)


def new_req(
    msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput,
    *,
    stream_interval: int,
    stats_pending: StatsPending,
    collect_time_stats: bool,
) -> Req:
    """The scheduler's request for a message from an API worker (not yet checked)."""
    logprob: LogprobParams | None = None
    constraint: Constraint | None = None
    salt, priority = None, 0
    if isinstance(msg, TokenizedEmbeddingReqInput):
        sampling, stream = _EMBEDDING_SAMPLING, False
    else:
        sampling, stream = msg.sampling_params, msg.stream
        logprob, constraint = msg.logprobs, msg.constraint
        salt, priority = msg.cache_salt, msg.priority
    return Req(
        rid=msg.rid,
        req_id=msg.req_id,
        input_ids=msg.input_ids,
        sampling=sampling,
        stream=stream,
        stream_interval=stream_interval,
        arrival_time=msg.arrival_time,
        stats_pending=stats_pending,
        media=msg.media,
        collect_time_stats=collect_time_stats,
        is_embedding=isinstance(msg, TokenizedEmbeddingReqInput),
        logprob=logprob,
        constraint=constraint,
        cache_salt=salt,
        priority=priority,
    )


@dataclass(frozen=True)
class AdmissionCheck:
    vocab_size: int  # token ids a prompt may hold
    model_vocab_size: int  # token ids logit_bias may name (the model's logits)
    context_length: int
    pool_capacity: int  # KV pool tokens
    mode: DecodeMode  # how much of the pool an output may take, and whether grammars run
    matches_stop_strings: bool  # False under --skip-tokenizer-init
    grammar_refusal: str | None  # why a constraint is refused without grammars (None: it is not)

    def problem(self, req: Req) -> str | None:
        """Why ``req`` can never be served here, or None. The tokenizer manager validates
        first; this guards the scheduler against a frame from elsewhere."""
        n = len(req.origin_input_ids)
        if n == 0:
            return "input_ids is empty"
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= self.vocab_size:
            return f"input_ids holds a token id outside the vocabulary [0, {self.vocab_size})"
        max_new = req.sampling.max_new_tokens
        if n > self.pool_capacity - self.mode.peak_output_slots(max_new):
            return (
                f"prompt ({n} tokens) plus max_new_tokens ({max_new}"
                f"{self.mode.output_slots_note}) exceeds the KV pool ({self.pool_capacity} tokens)"
            )
        # A generating request needs room for at least one new token; an embedding does not.
        if n > self.context_length or (n == self.context_length and not req.is_embedding):
            return f"prompt ({n} tokens) does not fit the context length ({self.context_length})"
        return self._sampling_problem(req.sampling) or self._constraint_problem(req.constraint)

    def _sampling_problem(self, sampling: SamplingParams) -> str | None:
        bias_ids = [token for token, _ in sampling.logit_bias]
        if bias_ids and (min(bias_ids) < 0 or max(bias_ids) >= self.model_vocab_size):
            return (
                f"logit_bias holds a token id outside the vocabulary [0, {self.model_vocab_size})"
            )
        stop_ids = len(sampling.stop_token_ids)
        if stop_ids > MAX_STOP_TOKEN_IDS:
            return f"stop_token_ids holds {stop_ids} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
        if sampling.stop and not self.matches_stop_strings:
            return (
                "stop strings need a tokenizer, and this server runs with "
                "--skip-tokenizer-init: use stop_token_ids"
            )
        return self._thinking_problem(sampling)

    def _thinking_problem(self, sampling: SamplingParams) -> str | None:
        budget, end = sampling.thinking_budget, sampling.thinking_end
        if budget is None:
            return None
        if budget < 0:
            return f"thinking_budget is {budget}; it must be at least 0"
        if not end:
            return "thinking_budget needs thinking_end, the token ids that end the reasoning"
        if min(end) < 0 or max(end) >= self.model_vocab_size:
            return (
                f"thinking_end holds a token id outside the vocabulary [0, {self.model_vocab_size})"
            )
        return self.mode.thinking_budget_refusal

    def _constraint_problem(self, c: Constraint | None) -> str | None:
        if c is None:
            return None
        if c.kind not in CONSTRAINT_KINDS:
            return (
                f"{c.param}: unknown structured-output kind {c.kind!r}; "
                f"expected one of {', '.join(CONSTRAINT_KINDS)}"
            )
        refusal = self.mode.constraint_refusal or self.grammar_refusal
        return None if refusal is None else f"{c.param}: {refusal}"


@dataclass(frozen=True)
class QueueLimit:
    """``--max-queued-requests``: how many requests may wait for admission. Checked where
    requests enter the queue one at a time, so the bound is exact: no burst slips past it,
    and queued and running requests are untouched."""

    bound: float  # math.inf: the waiting queue is unbounded

    @classmethod
    def of(cls, max_queued_requests: int | None) -> QueueLimit:
        return cls(math.inf if max_queued_requests is None else max_queued_requests)

    def refusal(self, num_waiting: int) -> FinishAbort | None:
        """The refusal of a request that finds ``num_waiting`` waiting, or None."""
        if num_waiting < self.bound:
            return None
        return FinishAbort(
            message=f"the waiting queue is full ({num_waiting} requests wait for admission); "
            "retry later",
            status_code=503,
            retry_after=QUEUE_FULL_RETRY_AFTER,
        )


def record_admission(req: Req, fetched: Fetched | None, storage_backend: str | None) -> bool:
    """Stats of an admission: time spent reading HiCache storage (every admission), and
    the cached tokens per tier (fixed at the first one). True for the first admission."""
    ts = req.stats.time_stats
    if fetched is not None and fetched.storage_seconds > 0 and ts is not None:
        req.update_time_stats(
            storage_prefetch_wait=ts.storage_prefetch_wait + fetched.storage_seconds
        )
    if req.admitted_once:
        return False
    req.admitted_once = True
    cached = req.num_computed
    host, storage = (fetched.host_tokens, fetched.storage_tokens) if fetched is not None else (0, 0)
    req.cached_by_tier = (cached - host - storage, host, storage)
    details = cached_details(*req.cached_by_tier, storage_backend)
    if cached or details is not None:
        req.update_stats(cached_tokens=cached, cached_tokens_details=details)
    return True
