"""Continuous batching: admission, (chunked) prefill, batched decode, retraction, stops and
aborts. Socket-free, so tests can drive it step by step; ``scheduler_proc.main`` wires it
to ZeroMQ.

One ``step()``:
1. prefill: continue the request that is mid-chunk, then admit waiting requests in arrival
   order while the token budget and the KV pool allow (leaving one slot per running request
   for the next decode step). ``PrefixKV`` gives each its slots and its cached prefix
   (from the device, or brought back from HiCache's host and storage tiers);
2. decode: one batched step over every running request, retracting requests first when the
   pool cannot give each a slot (in ``--mode dllm``, one block refinement pass instead:
   ``scheduler_proc.dllm``);
3. emit: one ``BatchTokenIDOutput`` with a row for each request whose output is due.
A request mid-prefill emits no row.

PD disaggregation (``pd_prefill`` / ``pd_decode``, set by ``scheduler_proc.main``): a prefill
server also answers KV fetches and sends a request's KV when it releases it; a decode
server takes requests "prebuilt" (step 0: install arrived KV, emit the prefill's first
token) and re-bootstraps a retracted one instead of re-prefilling it.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

import numpy as np

from pipeline.io_struct import (
    AbortReq,
    AbortResult,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    FlushCacheControl,
    FlushCacheResult,
    HiCacheStorageControl,
    HiCacheStorageState,
    KVFetch,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    worker_of,
)
from scheduler_proc.dllm import DllmConfig, DllmDecoder
from scheduler_proc.embedding import accumulate_hidden, pooled_embedding
from scheduler_proc.hicache import Fetched, HiCache, apply_storage_control, cached_details
from scheduler_proc.model_runner import ModelRunner
from scheduler_proc.output_builder import SteadyRows, build_embedding_output, build_token_output
from scheduler_proc.pd_decode import DecodeBootstrap, DecodeBootstrapper, install_prebuilt
from scheduler_proc.pd_prefill import KVFetchJob, PrefillHalf, PrefillKVSender, keep_first_logprobs, kv_job_request
from scheduler_proc.logprobs import keep_decode_logprobs, keep_prompt_logprobs, step_logprobs
from scheduler_proc.prefix_kv import PrefixKV
from scheduler_proc.req import PENDING_STATS, Req
from scheduler_proc.running_batch import RunningBatch
from scheduler_proc.sampler import SamplingColumns, draw_counter
from scheduler_proc.stop_checker import CONTEXT, LENGTH, RUNNING, STOP_TOKEN, StopChecker

logger = logging.getLogger("tokenpipe.scheduler")

_EMPTY_SLOTS = torch.empty(0, dtype=torch.long)
# What a refusal for a full waiting queue tells the client to wait before retrying: about
# the time a few requests take to be admitted and finish on a small server; a hint only.
QUEUE_FULL_RETRY_AFTER = 1.0

# An embedding request generates nothing: it finishes when its prompt is prefilled.
_EMBEDDING_SAMPLING = SamplingParams(max_new_tokens=0)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        stop_checker: StopChecker,
        *,
        context_length: int,
        vocab_size: int,
        chunked_prefill_size: int,
        max_running_requests: int,
        stream_interval: int,
        collect_time_stats: bool,
        dense_usage_columns: bool = False,
        dllm: DllmConfig | None = None,
        hicache: HiCache | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.runner = runner
        self.prefix_kv = PrefixKV(runner.kv, hicache)
        self.kv = runner.kv
        self.cache = self.prefix_kv.cache
        self.hicache = hicache  # host and storage tiers under the device pool, or None
        self.stop_checker = stop_checker
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.prefill_budget = chunked_prefill_size if chunked_prefill_size > 0 else context_length
        self.max_running_requests = max_running_requests
        self.max_queued_requests = max_queued_requests  # None: the waiting queue is unbounded
        self.stream_interval = stream_interval
        self.collect_time_stats = collect_time_stats
        self.dense_usage_columns = dense_usage_columns  # UsageColumns on every token frame
        self.dllm = None if dllm is None else DllmDecoder(dllm, runner, stop_checker, context_length, self.prefix_kv.alloc)

        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prefill not complete (mid-chunk)
        # Generate mode: the running requests as columns (a steady decode step is column
        # work). dLLM mode refines blocks request by request and keeps a plain list.
        self.running: RunningBatch | list[Req] = RunningBatch(context_length, runner.model_config.vocab_size) if dllm is None else []
        self.live: dict[int, Req] = {}
        self._rows_due: list[Req] = []  # rows produced outside a step (aborts, rejections)
        self.num_retracted_total = 0
        self.forward_steps = 0
        self.generated_tokens_total = 0
        self.prefill_tokens_total = 0  # prompt tokens of first admissions
        self.cached_tokens_total = 0  # of those, served from the prefix cache
        self.pd_prefill: PrefillKVSender | None = None  # --disaggregation-mode prefill
        self.pd_decode: DecodeBootstrapper | None = None  # --disaggregation-mode decode
        self._next_kv_job_id = -1  # internal re-bootstrap requests count down: never a client's req_id

    # --- inputs --------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput) -> None:
        if msg.req_id in self.live:
            logger.warning("dropped a request with a duplicate req_id %d (rid %r)", msg.req_id, msg.rid)
            return
        now = time.time()
        embedding = isinstance(msg, TokenizedEmbeddingReqInput)
        req = Req(
            rid=msg.rid,
            req_id=msg.req_id,
            input_ids=msg.input_ids,
            sampling=_EMBEDDING_SAMPLING if embedding else msg.sampling_params,  # type: ignore[union-attr]
            stream=False if embedding else msg.stream,  # type: ignore[union-attr]
            stream_interval=self.stream_interval,
            arrival_time=msg.arrival_time,
            media=msg.media,
            collect_time_stats=self.collect_time_stats,
            is_embedding=embedding,
            logprob=None if embedding else msg.logprobs,  # type: ignore[union-attr]
        )
        room = None if embedding else msg.bootstrap_room  # type: ignore[union-attr]
        if room is not None and self.pd_prefill is not None:
            req.pd = PrefillHalf(room)
        elif room is not None and self.pd_decode is not None and msg.bootstrap_endpoint:  # type: ignore[union-attr]
            req.pd = DecodeBootstrap(room, msg.bootstrap_endpoint)  # type: ignore[union-attr]
        problem = self._admission_problem(req)
        if problem is not None:
            # The tokenizer manager validates first; this guards the scheduler against a
            # frame from elsewhere, answering instead of crashing or starving.
            req.finish(FinishAbort(message=problem, status_code=400), now)
            self._rows_due.append(req)
            return
        if self._queue_full():
            # Checked here, where requests enter the queue one at a time, so the bound is
            # exact: no burst can slip past it. Queued and running requests are untouched.
            req.finish(self._queue_full_abort(), now)
            self._rows_due.append(req)
            return
        req.enter_waiting_queue(now)
        self.live[req.req_id] = req
        if isinstance(req.pd, DecodeBootstrap):
            self.pd_decode.start(req, now)  # type: ignore[union-attr]
        else:
            self.waiting.append(req)

    def _queue_full(self) -> bool:
        return self.max_queued_requests is not None and self.num_waiting >= self.max_queued_requests

    def _queue_full_abort(self) -> FinishAbort:
        return FinishAbort(
            message=f"the waiting queue is full ({self.num_waiting} requests wait for admission); retry later",
            status_code=503,
            retry_after=QUEUE_FULL_RETRY_AFTER,
        )

    def _admission_problem(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "input_ids is empty"
        if min(req.origin_input_ids) < 0 or max(req.origin_input_ids) >= self.vocab_size:
            return f"input_ids holds a token id outside the vocabulary [0, {self.vocab_size})"
        max_new = req.sampling.max_new_tokens
        if n > self.kv.capacity - (max_new if self.dllm is None else self.dllm.peak_output_slots(max_new)):
            return (
                f"prompt ({n} tokens) plus max_new_tokens ({max_new}{' in whole blocks' if self.dllm else ''}) exceeds "
                f"the KV pool ({self.kv.capacity} tokens)"
            )
        # A generating request needs room for at least one new token; an embedding does not.
        if n > self.context_length or (n == self.context_length and not req.is_embedding):
            return f"prompt ({n} tokens) does not fit the context length ({self.context_length})"
        bias_ids = [token for token, _ in req.sampling.logit_bias]
        if bias_ids and (min(bias_ids) < 0 or max(bias_ids) >= self.runner.model_config.vocab_size):
            return f"logit_bias holds a token id outside the vocabulary [0, {self.runner.model_config.vocab_size})"
        if req.sampling.stop and not self.stop_checker.matches_stop_strings:
            return "stop strings need a tokenizer, and this server runs with --skip-tokenizer-init: use stop_token_ids"
        return None

    def storage_control(self, msg: HiCacheStorageControl) -> HiCacheStorageState:
        """Attaches or detaches HiCache storage between two steps. On a change, every
        admitted request's ``cached_tokens_details`` changes keys through the one stats
        setter, so its next row shows the storage keys appear or go."""
        state = apply_storage_control(self.hicache, msg)
        backend = state.backend
        for req in self.live.values():
            if req.admitted_once:
                details = cached_details(*req.cached_by_tier, backend)
                if details != req.stats.cached_tokens_details:
                    req.update_stats(cached_tokens_details=details)
        return state

    def flush_cache(self, msg: FlushCacheControl) -> FlushCacheResult:
        """Drops the prefix cache between two steps, as SGLang's ``flush_cache`` does: only
        when no request is live (waiting, running, or in a PD hand-over), else nothing
        changes and the answer says why."""
        if self.live:
            error = (
                "Cache not flushed because there are pending requests. "
                f"#queue-req: {self.num_waiting}, #running-req: {self.num_running}"
            )
            logger.warning(error)
            return FlushCacheResult(control_id=msg.control_id, ok=False, error=error)
        dropped = self.prefix_kv.flush()
        logger.info("cache flushed: %d device, %d host and %d storage tokens dropped", *dropped)
        return FlushCacheResult(
            control_id=msg.control_id, ok=True, device_tokens=dropped.device, host_tokens=dropped.host, storage_tokens=dropped.storage
        )

    def abort(self, msg: AbortReq) -> AbortResult | None:
        """Stops the requests ``msg`` names; the ``AbortResult`` when it asked for one."""
        if msg.abort_all:
            targets = [r for r in self.live.values() if msg.worker is None or worker_of(r.req_id) == msg.worker]
        elif msg.rid is not None:  # from an API worker that does not hold the request
            targets = [r for r in self.live.values() if r.rid == msg.rid and r.req_id >= 0]
        else:
            targets = [self.live[msg.req_id]] if msg.req_id in self.live else []
        now = time.time()
        for req in targets:
            self._remove(req)
            req.finish(FinishAbort(message=msg.reason, status_code=499 if not msg.abort_all else 503), now)
            self._release(req)
            if not isinstance(req.pd, KVFetchJob):  # internal: no client waits for a row
                self._rows_due.append(req)
        return AbortResult(control_id=msg.control_id, aborted=len(targets)) if msg.control_id else None

    # --- the step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        prebuilt = self.pd_decode is not None and self.pd_decode.has_work
        return bool(self.waiting or self.prefilling or self.running or self._rows_due or prebuilt)

    def step(self) -> list[BatchTokenIDOutput | BatchEmbeddingOutput]:
        rows, self._rows_due = self._rows_due, []
        prebuilt = self._take_pd_inputs(rows)
        newly_running = self._prefill(rows)
        steady = self._decode(rows)
        frames: list[BatchTokenIDOutput | BatchEmbeddingOutput] = []
        embedded = [r for r in rows if r.is_embedding]
        if embedded:
            rows = [r for r in rows if not r.is_embedding]
            size = self.runner.model_config.hidden_size
            frames.append(build_embedding_output(embedded, np.stack([pooled_embedding(r, size) for r in embedded])))
        if rows or steady is not None:
            frames.append(build_token_output(rows, steady=steady, dense_usage=self.dense_usage_columns))
        batch = self.running if isinstance(self.running, RunningBatch) else None
        for req in rows + embedded:
            if req.finished:
                self._release(req)
            elif batch is not None and req in batch:
                batch.note_sent(req)  # an event row of a running request went out
        # New requests join after their first row is built, which records what it sent.
        self.running.extend(prebuilt)
        self.running.extend(newly_running)
        return frames

    def _prefill(self, rows: list[Req]) -> list[Req]:
        now = time.time()
        budget = self.prefill_budget
        batch: list[tuple[Req, list[int], torch.Tensor]] = []
        candidates = list(self.prefilling)
        self.prefilling = []
        slots_for_decode = self._decode_demand()
        admitted = len(self.running) + len(candidates)
        for req in self.waiting:
            if admitted >= self.max_running_requests:
                break
            candidates.append(req)
            admitted += 1
        for req in candidates:
            from_waiting = bool(self.waiting) and self.waiting[0] is req
            if budget <= 0:
                self._requeue_unscheduled(req)
                continue
            # Pooling needs every prompt token's hidden state, so embeddings skip the cache.
            got = self.prefix_kv.admit(req, match=from_waiting and not req.is_embedding, budget=budget, reserve=slots_for_decode)
            if got is None:
                self._requeue_unscheduled(req)
                budget = 0  # arrival order: nobody overtakes a request that does not fit
                continue
            slots, fetched = got
            if from_waiting:
                self.waiting.popleft()
                req.leave_waiting_queue(now)
                self._record_admission(req, fetched)
            take = len(slots)
            batch.append((req, req.fill_ids[req.num_computed : req.num_computed + take], slots))
            budget -= take
        if not batch:
            return []

        embeds = any(req.is_embedding for req, _, _ in batch)
        prompt_logprobs = any(req.prompt_logprobs_next is not None for req, _, _ in batch)
        logits, hidden = self.runner.extend(
            [toks for _, toks, _ in batch],
            [req.kv_slots if req.kv_slots is not None else _EMPTY_SLOTS for req, _, _ in batch],
            [slots for _, _, slots in batch],
            return_hidden=embeds or prompt_logprobs,
        )
        self.forward_steps += 1
        if embeds:
            accumulate_hidden(batch, hidden)  # type: ignore[arg-type]
        if prompt_logprobs:
            keep_prompt_logprobs(batch, hidden, self.runner.logits)  # type: ignore[arg-type]
        done_rows: list[int] = []
        for i, (req, toks, slots) in enumerate(batch):
            req.kv_slots = slots if req.kv_slots is None else torch.cat((req.kv_slots, slots))
            req.num_computed += len(toks)
            if req.num_computed == req.seq_len:
                done_rows.append(i)
            else:
                self.prefilling.append(req)
        if not done_rows:
            return []
        done = [batch[i][0] for i in done_rows]
        finished_at = time.time()
        for req in done:
            ts = req.stats.time_stats
            if ts is not None and ts.prefill_finished_time is None:
                req.update_time_stats(prefill_finished_time=finished_at)
        for req in done:
            if isinstance(req.pd, KVFetchJob):
                self._release(req)  # a re-bootstrap wanted only the KV: sent on release
            elif req.is_embedding or req.sampling.max_new_tokens == 0:
                # An embedding, or a prompt scored without a completion (its prompt
                # logprobs are on the request): done with the prefill.
                req.finish(FinishLength(length=0), finished_at)
                rows.append(req)
        generating = [i for i in done_rows if not batch[i][0].finished and not isinstance(batch[i][0].pd, KVFetchJob)]
        if not generating:
            return []
        done = [batch[i][0] for i in generating]
        if self.dllm is not None:
            return done  # they decode block by block from the next step on: nothing to sample
        picked = logits if len(generating) == len(batch) else logits[torch.tensor(generating, device=logits.device)]
        tokens = self._sample(picked, done)
        if self.pd_prefill is not None:
            for req in done:
                keep_first_logprobs(req)  # for the KV header, before its own row takes them
        return self._append_tokens(done, tokens, rows)

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        """The next token of each of these requests (not in the running batch: a first token
        after a prefill), each drawn at its output index."""
        columns = SamplingColumns.from_requests(
            [r.sampling for r in reqs],
            [r.seed for r in reqs],
            [draw_counter(len(r.output_ids)) for r in reqs],
            [r.origin_input_ids for r in reqs],
            [r.output_ids for r in reqs],
            logits.shape[-1],
            logits.device,
        )
        tokens = self.runner.sample(logits, columns)
        asking = [i for i, r in enumerate(reqs) if r.logprob is not None]
        if asking:
            self._keep_logprobs(logits, np.array(asking), tokens, [reqs[i] for i in asking])
        return tokens.tolist()  # type: ignore[no-any-return]

    @staticmethod
    def _keep_logprobs(logits: torch.Tensor, rows: np.ndarray, tokens: np.ndarray, reqs: list[Req]) -> None:
        """The logprobs of this step's token of each request that asked (one batched
        computation), kept on the request until its row goes out."""
        parts = step_logprobs(logits, rows, tokens[rows], [r.logprob for r in reqs])  # type: ignore[misc]
        for req, part in zip(reqs, parts):
            req.pending_logprobs.append(part)

    def _record_admission(self, req: Req, fetched: Fetched | None) -> None:
        """Stats of an admission: time spent reading HiCache storage (every admission), and
        the cached tokens per tier (fixed at the first one)."""
        ts = req.stats.time_stats
        if fetched is not None and fetched.storage_seconds > 0 and ts is not None:
            req.update_time_stats(storage_prefetch_wait=ts.storage_prefetch_wait + fetched.storage_seconds)
        if req.admitted_once:
            return
        req.admitted_once = True
        cached = req.num_computed
        self.prefill_tokens_total += len(req.origin_input_ids)
        self.cached_tokens_total += cached
        host, storage = (fetched.host_tokens, fetched.storage_tokens) if fetched is not None else (0, 0)
        req.cached_by_tier = (cached - host - storage, host, storage)
        details = cached_details(*req.cached_by_tier, self.prefix_kv.storage_backend)
        if cached or details is not None:
            req.update_stats(cached_tokens=cached, cached_tokens_details=details)

    def _release_kv(self, req: Req) -> None:
        if self.dllm is not None:
            self.dllm.drop_block(req)  # a block in progress is never cached: it restarts
        self.prefix_kv.release(req)

    def _requeue_unscheduled(self, req: Req) -> None:
        """A candidate that got no slots this step: a mid-chunk request stays in prefill,
        a waiting one stays where it is."""
        if req.num_computed > 0:
            self.prefilling.append(req)

    def _decode(self, rows: list[Req]) -> SteadyRows | None:
        """One decode step over every running request. Rows with an event (finished, a
        stop string to check, stats due) are queued in ``rows`` as requests; the other due
        rows come back as columns."""
        if not self.running:
            return None
        self._retract_until_fits()
        if isinstance(self.running, list):
            assert self.dllm is not None
            self.running, committed = self.dllm.step(self.running, rows)
            self.forward_steps += 1
            self.generated_tokens_total += committed
            return None
        batch = self.running
        n = len(batch)
        slots = self.prefix_kv.alloc(n)
        assert slots is not None, "retraction left too few KV slots"
        logits = self.runner.decode(batch.last_tokens(), batch.seq_len[:n], batch.write_kv_slots(slots))
        self.forward_steps += 1
        new = self.runner.sample(logits, batch.sampling_columns())
        batch.append_tokens(new)
        asking = np.flatnonzero(batch.wants_logprobs[:n])
        if asking.size:
            keep_decode_logprobs(batch, logits, asking, new)
        self.generated_tokens_total += n
        out_len = batch.output_len()
        code, check_strings = self.stop_checker.check_columns(
            new, out_len, batch.seq_len[:n], batch.min_new[:n], batch.max_new[:n],
            batch.ignore_eos[:n], batch.stop_ids[:n], batch.has_stop_strings[:n],
        )  # fmt: skip
        due = batch.due(code != RUNNING)
        event = (code != RUNNING) | check_strings
        if PENDING_STATS:  # stats changed since their last row: that row goes the per-request way
            for req in list(PENDING_STATS):
                if req in batch:
                    row = batch.row_of(req)
                    event[row] |= due[row]
        steady_rows = np.flatnonzero(due & ~event)
        steady = batch.take_steady(steady_rows, with_reqs=self.dense_usage_columns) if steady_rows.size else None
        event_rows = np.flatnonzero(event)
        if event_rows.size:
            self._decode_events(batch, event_rows, code, new, out_len, rows)
        return steady

    def _decode_events(
        self, batch: RunningBatch, event_rows: np.ndarray, code: np.ndarray, new: np.ndarray, out_len: np.ndarray, rows: list[Req]
    ) -> None:
        """The rows of a decode step that need their request: a finish (the request leaves
        the batch), a stop string to check, stats due. Per-row work, for these rows only."""
        events = [(batch.reqs[i], int(code[i]), int(new[i]), int(out_len[i])) for i in event_rows.tolist()]
        for req, outcome, token, length in events:
            batch.sync(req)
            reason: FinishReason | None = None
            if req.sampling.stop and outcome != STOP_TOKEN and length >= req.sampling.min_new_tokens:
                reason = self.stop_checker.check(req)  # the text decides; its order of checks wins
            elif outcome == STOP_TOKEN:
                reason = FinishStop(matched=token)
            elif outcome == LENGTH:
                reason = FinishLength(length=req.sampling.max_new_tokens)
            elif outcome == CONTEXT:
                reason = FinishLength(length=length)
            if reason is not None:
                req.finish(reason)
                batch.remove(req)  # its pending logprobs go back to it
            if req.output_due():
                if reason is None:
                    batch.hand_over_logprobs(req)  # this row goes out the per-request way
                rows.append(req)

    def _append_tokens(self, reqs: list[Req], tokens: list[int], rows: list[Req]) -> list[Req]:
        """Appends one sampled token per request, checks stops, queues due rows; returns
        the requests that keep running."""
        still_running: list[Req] = []
        self.generated_tokens_total += len(tokens)
        for req, token in zip(reqs, tokens):
            req.output_ids.append(token)
            reason = self.stop_checker.check(req)
            if reason is not None:
                req.finish(reason)
            else:
                still_running.append(req)
            if req.output_due():
                rows.append(req)
        return still_running

    # --- retraction ----------------------------------------------------------------------

    def _retract_until_fits(self) -> None:
        """Frees KV until every running request can take one more token: mid-prefill
        requests first, then running ones with the fewest output tokens (then the longest
        prompt). The last running request is never retracted: admission guarantees that
        one request alone always fits."""
        now = time.time()
        while not self.prefix_kv.fits(self._decode_demand()):
            if self.prefilling:
                victim = self.prefilling.pop()
            elif len(self.running) > 1:
                if isinstance(self.running, RunningBatch):
                    victim = self.running.retraction_victim()
                else:
                    victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
                self.running.remove(victim)
            else:
                raise RuntimeError("a single request does not fit the KV pool; admission should have refused it")
            self._retract(victim, now)

    def _decode_demand(self) -> int:
        """Pool slots the next decode step takes: one per request, or what each dLLM pass needs."""
        if self.dllm is None:
            return len(self.running)
        return sum(self.dllm.slots_needed(r) for r in self.running)

    def _retract(self, req: Req, now: float) -> None:
        if isinstance(req.pd, DecodeBootstrap):
            self.prefix_kv.release(req, cache=False)
            req.mark_retracted(now)
            self.pd_decode.start(req, now)  # type: ignore[union-attr]
            self.num_retracted_total += 1
            logger.warning(
                "retracted req_id=%d rid=%s retraction_count=%d: re-bootstrapping its KV from %s",
                req.req_id, req.rid, req.retraction_count, req.pd.endpoint,
            )
            return
        self._release_kv(req)  # what it computed stays in the cache while the pool allows
        req.hidden_sum = None  # an embedding request pools again from its re-prefill
        req.mark_retracted(now)
        self.waiting.appendleft(req)
        self.num_retracted_total += 1
        # A warning: retraction means the pool is too small for the load, and tests and
        # operators count these lines.
        logger.warning("retracted req_id=%d rid=%s retraction_count=%d", req.req_id, req.rid, req.retraction_count)

    # --- PD disaggregation -----------------------------------------------------------------

    def _take_pd_inputs(self, rows: list[Req]) -> list[Req]:
        """Prefill server: takes decode servers' fetches. Decode server: takes arrived KV,
        installs it while the pool allows (in arrival order) and returns the requests that
        join the running batch after this step's decode; failed bootstraps become rows."""
        now = time.time()
        if self.pd_prefill is not None:
            for identity, fetch in self.pd_prefill.receive(now):
                self._add_kv_job(identity, fetch, now)
        if self.pd_decode is None:
            return []
        rows.extend(self.pd_decode.poll(now))
        ready = self.pd_decode.ready
        joined: list[Req] = []
        while ready and len(self.running) + len(self.prefilling) + len(joined) < self.max_running_requests:
            req = ready[0]
            pd = req.pd
            assert isinstance(pd, DecodeBootstrap) and pd.prebuilt is not None
            header = pd.prebuilt.header
            # Room for its KV, plus one slot for each running request's next token and its own.
            slots = self.prefix_kv.alloc(header.num_tokens, self._decode_demand() + len(joined) + 1)
            if slots is None:
                break
            ready.popleft()
            install_prebuilt(req, self.kv, slots, time.time())
            if req.output_ids:  # re-bootstrapped: its last token is the next decode step's input
                joined.append(req)
            else:  # the prefill server's first token is this request's first output
                joined.extend(self._append_tokens([req], [header.first_token], rows))  # type: ignore[list-item]
        return joined

    def _add_kv_job(self, identity: bytes, fetch: KVFetch, now: float) -> None:
        """A decode server's re-bootstrap: an internal request that computes the KV of
        ``fetch.token_ids`` (from the prefix cache where it can) and emits no row."""
        req = kv_job_request(identity, fetch, self._next_kv_job_id, now, self.collect_time_stats)
        self._next_kv_job_id -= 1
        problem = self._admission_problem(req) if fetch.token_ids else "the fetch names no tokens"
        if problem is not None:
            self.pd_prefill.refuse(identity, fetch, problem)  # type: ignore[union-attr]
            return
        req.enter_waiting_queue(now)
        self.live[req.req_id] = req
        self.waiting.append(req)

    # --- bookkeeping ---------------------------------------------------------------------

    def _remove(self, req: Req) -> None:
        if self.pd_decode is not None:
            self.pd_decode.discard(req)
        for queue in (self.running, self.prefilling):
            if req in queue:
                queue.remove(req)
                return
        if req in self.waiting:
            self.waiting.remove(req)

    def _release(self, req: Req) -> None:
        if self.pd_prefill is not None and req.pd is not None:
            self.pd_prefill.on_release(req, time.time())  # sends (or keeps) the KV first
        if isinstance(req.pd, DecodeBootstrap):
            self.prefix_kv.release(req, cache=False)  # nothing here ever matches a PD request's prefix
        else:
            self._release_kv(req)
        self.live.pop(req.req_id, None)

    @property
    def kv_tokens_held_by_requests(self) -> int:
        return self.prefix_kv.held_by_requests

    @property
    def cache_size(self) -> int:
        return self.cache.total_size

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + (self.pd_decode.num_waiting if self.pd_decode is not None else 0)
