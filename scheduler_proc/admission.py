"""A request's way in: whether the scheduler can ever serve it, the answer when the waiting
queue is full (both checked once, where a request enters the scheduler: a refused request
finishes with a 400 or a 503 instead of crashing or starving the scheduler), and the
stats its admission into a prefill records."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.io_struct import CONSTRAINT_KINDS, FinishAbort
from pipeline.request_limits import MAX_STOP_TOKEN_IDS
from scheduler_proc.dllm import DllmDecoder
from scheduler_proc.cache.hicache import Fetched, cached_details
from scheduler_proc.req import Req

# What a refusal for a full waiting queue tells the client to wait before retrying: about
# the time a few requests take to be admitted and finish on a small server; a hint only.
QUEUE_FULL_RETRY_AFTER = 1.0


@dataclass(frozen=True)
class AdmissionCheck:
    vocab_size: int  # token ids a prompt may hold
    model_vocab_size: int  # token ids logit_bias may name (the model's logits)
    context_length: int
    pool_capacity: int  # KV pool tokens
    dllm: DllmDecoder | None  # --mode dllm: the output takes whole blocks of slots
    matches_stop_strings: bool  # False under --skip-tokenizer-init
    grammars: bool = False  # structured outputs: False under --skip-tokenizer-init

    def problem(self, req: Req) -> str | None:
        """Why ``req`` can never be served here, or None. The tokenizer manager validates
        first; this guards the scheduler against a frame from elsewhere."""
        n = len(req.origin_input_ids)
        if n == 0:
            return "input_ids is empty"
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= self.vocab_size:
            return f"input_ids holds a token id outside the vocabulary [0, {self.vocab_size})"
        max_new = req.sampling.max_new_tokens
        if n > self.pool_capacity - (
            max_new if self.dllm is None else self.dllm.peak_output_slots(max_new)
        ):
            return (
                f"prompt ({n} tokens) plus max_new_tokens ({max_new}{' in whole blocks' if self.dllm else ''}) exceeds "
                f"the KV pool ({self.pool_capacity} tokens)"
            )
        # A generating request needs room for at least one new token; an embedding does not.
        if n > self.context_length or (n == self.context_length and not req.is_embedding):
            return f"prompt ({n} tokens) does not fit the context length ({self.context_length})"
        bias_ids = [token for token, _ in req.sampling.logit_bias]
        if bias_ids and (min(bias_ids) < 0 or max(bias_ids) >= self.model_vocab_size):
            return (
                f"logit_bias holds a token id outside the vocabulary [0, {self.model_vocab_size})"
            )
        stop_ids = len(req.sampling.stop_token_ids)
        if stop_ids > MAX_STOP_TOKEN_IDS:
            return f"stop_token_ids holds {stop_ids} ids; at most {MAX_STOP_TOKEN_IDS} are allowed"
        if req.sampling.stop and not self.matches_stop_strings:
            return "stop strings need a tokenizer, and this server runs with --skip-tokenizer-init: use stop_token_ids"
        return None if req.constraint is None else self._constraint_problem(req)

    def _constraint_problem(self, req: Req) -> str | None:
        c = req.constraint
        assert c is not None
        if c.kind not in CONSTRAINT_KINDS:
            return f"{c.param}: unknown structured-output kind {c.kind!r}; expected one of {', '.join(CONSTRAINT_KINDS)}"
        if self.dllm is not None:
            # A dLLM pass commits positions of a block out of order; a grammar reads left to right.
            return f"{c.param}: structured outputs are not supported in --mode dllm"
        if not self.grammars:
            return f"{c.param}: structured outputs need a tokenizer, and this server runs with --skip-tokenizer-init"
        return None


def queue_full_abort(num_waiting: int) -> FinishAbort:
    """The refusal of a request that finds the waiting queue full."""
    return FinishAbort(
        message=f"the waiting queue is full ({num_waiting} requests wait for admission); retry later",
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
