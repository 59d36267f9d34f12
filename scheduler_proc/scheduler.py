"""Continuous batching: admission, (chunked) prefill, batched decode, retraction, stops and
aborts. Socket-free, so tests can drive it step by step; ``scheduler_proc.main`` wires it
to ZeroMQ.

One ``step()``:
0. inputs: constrained requests whose grammar finished compiling leave ``self.grammars``
   (scheduler_proc/grammar_queue.py) for the waiting queue; then ``self.pd`` (a
   ``PdRole``: scheduler_proc/pd/role.py) takes what its peers sent: a prefill server
   queues re-bootstrap fetches as internal requests; a decode server installs arrived KV,
   and those requests join the running batch "prebuilt";
1. prefill: continue the request that is mid-chunk, then admit waiting requests in arrival
   order while the token budget and the KV pool allow (leaving one slot per running request
   for the next decode step). ``PrefixKV`` gives each its slots and its cached prefix
   (from the device, or brought back from HiCache's host and storage tiers); one pass
   computes the chunks (``scheduler_proc.batch.prefill_pass``);
2. decode: one batched step over every running request (``scheduler_proc.batch.decode_pass``),
   retracting requests first when the pool cannot give each a slot (in ``--mode dllm``,
   one block refinement pass instead: ``scheduler_proc.dllm``);
3. emit: one ``BatchTokenIDOutput`` with a row for each request whose output is due.
A request mid-prefill emits no row. Which rows carry stats, ``Req`` decides: this
scheduler's ``stats_pending`` holds its requests whose next row does.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np
import torch

from pipeline.peer_errors import duplicate_rid_message
from pipeline.io_struct import (
    AbortReq,
    AbortResult,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishAbort,
    FinishLength,
    FlushCacheControl,
    FlushCacheResult,
    HiCacheStorageControl,
    HiCacheStorageState,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from scheduler_proc.admission import AdmissionCheck, queue_full_abort, record_admission
from scheduler_proc.batch.decode_pass import BatchDecoder
from scheduler_proc.control import abort_targets, flush_cache, storage_control
from scheduler_proc.dllm import DllmConfig, DllmDecoder
from scheduler_proc.embedding import pooled_embedding
from scheduler_proc.grammar_queue import GrammarQueue, accept_appended
from scheduler_proc.cache.hicache import HiCache
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.output_builder import SteadyRows, build_embedding_output, build_token_output
from scheduler_proc.pd.role import PdRole, Unified
from scheduler_proc.batch.prefill_pass import Chunk, forward_chunks, sample_first_tokens
from scheduler_proc.cache.prefix_kv import PrefixKV
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.retraction import take_victim
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.sampling.grammar import GrammarCompiler, TokenMasks
from scheduler_proc.stop_checker import StopChecker

logger = logging.getLogger("tokenpipe.scheduler")

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
        grammar: GrammarCompiler | None = None,
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
        self.dllm = (
            None
            if dllm is None
            else DllmDecoder(dllm, runner, stop_checker, context_length, self.prefix_kv.alloc)
        )
        self.admission = AdmissionCheck(
            vocab_size,
            runner.model_config.vocab_size,
            context_length,
            runner.kv.capacity,
            self.dllm,
            stop_checker.matches_stop_strings,
            grammars=grammar is not None,
        )
        # Structured outputs (None without a tokenizer): constrained requests wait for their
        # grammar here, and each step's mask of the constrained rows is filled in ``masks``.
        self.grammars = GrammarQueue(grammar) if grammar is not None else None
        self.masks = (
            TokenMasks(runner.model_config.vocab_size, grammar.stop_ids, runner.device)
            if grammar is not None
            else None
        )
        # This scheduler's requests whose next row carries stats (never another scheduler's).
        self.stats_pending = StatsPending()
        self.decoder = BatchDecoder(
            runner, stop_checker, self.stats_pending, dense_usage_columns, self.masks
        )
        self.pd: PdRole = (
            Unified()
        )  # --disaggregation-mode prefill or decode: set by scheduler_proc.main

        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []  # admitted, prefill not complete (mid-chunk)
        # Generate mode: the running requests as columns (a steady decode step is column
        # work). dLLM mode refines blocks request by request and keeps a plain list.
        self.running: RunningBatch | list[Req] = (
            RunningBatch(context_length, runner.model_config.vocab_size) if dllm is None else []
        )
        self.live: dict[int, Req] = {}
        # The clients' live requests by rid: several API workers each check only their own
        # rids, and only this process sees them all. Internal requests (PD KV fetches) have
        # their own names and are not here.
        self.live_rids: dict[str, Req] = {}
        self._rows_due: list[Req] = []  # rows produced outside a step (aborts, rejections)
        self.num_retracted_total = 0
        self.forward_steps = 0
        self.generated_tokens_total = 0
        self.prefill_tokens_total = 0  # prompt tokens of first admissions
        self.cached_tokens_total = 0  # of those, served from the prefix cache

    # --- inputs --------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput) -> None:
        if msg.req_id in self.live:
            logger.warning(
                "dropped a request with a duplicate req_id %d (rid %r)", msg.req_id, msg.rid
            )
            return
        now = time.time()
        if isinstance(msg, TokenizedEmbeddingReqInput):
            sampling, stream, logprob, room, endpoint, constraint = (
                _EMBEDDING_SAMPLING,
                False,
                None,
                None,
                None,
                None,
            )
        else:
            sampling, stream, logprob = msg.sampling_params, msg.stream, msg.logprobs
            room, endpoint, constraint = msg.bootstrap_room, msg.bootstrap_endpoint, msg.constraint
        req = Req(
            rid=msg.rid,
            req_id=msg.req_id,
            input_ids=msg.input_ids,
            sampling=sampling,
            stream=stream,
            stream_interval=self.stream_interval,
            arrival_time=msg.arrival_time,
            stats_pending=self.stats_pending,
            media=msg.media,
            collect_time_stats=self.collect_time_stats,
            is_embedding=isinstance(msg, TokenizedEmbeddingReqInput),
            logprob=logprob,
            constraint=constraint,
        )
        self.pd.bind(req, room, endpoint)
        if msg.rid in self.live_rids:  # each API worker knows only its own live rids
            problem: str | None = duplicate_rid_message(msg.rid)
        else:
            problem = self.admission.problem(req)
        if problem is not None:
            # The tokenizer manager validates first; this guards the scheduler against a
            # frame from elsewhere, answering instead of crashing or starving.
            req.finish(FinishAbort(message=problem, status_code=400), now)
            self._rows_due.append(req)
            return
        if self.max_queued_requests is not None and self.num_waiting >= self.max_queued_requests:
            # Checked here, where requests enter the queue one at a time, so the bound is
            # exact: no burst can slip past it. Queued and running requests are untouched.
            req.finish(queue_full_abort(self.num_waiting), now)
            self._rows_due.append(req)
            return
        if req.constraint is not None:
            assert self.grammars is not None  # admission refuses a constraint without grammars
            if self.grammars.start(req, now):  # its grammar compiles: it waits apart, live
                self._make_live(req)
                return
            if req.finished:  # a spec the cache knows is invalid
                self._rows_due.append(req)
                return
        self.enqueue(req, now)

    def enqueue(self, req: Req, now: float) -> None:
        """Queues an accepted request for admission in arrival order (or, when the PD side
        takes it, for its KV from a prefill server)."""
        req.enter_waiting_queue(now)
        self._make_live(req)
        if not self.pd.on_admit(req, now):
            self.waiting.append(req)

    def _make_live(self, req: Req) -> None:
        self.live[req.req_id] = req
        if not req.kv_only:
            self.live_rids[req.rid] = req

    def storage_control(self, msg: HiCacheStorageControl) -> HiCacheStorageState:
        """Attaches or detaches HiCache storage between two steps."""
        return storage_control(self.hicache, self.live.values(), msg)

    def flush_cache(self, msg: FlushCacheControl) -> FlushCacheResult:
        """Drops the prefix cache between two steps, when no request is live."""
        return flush_cache(self.prefix_kv, len(self.live), self.num_waiting, self.num_running, msg)

    def abort(self, msg: AbortReq) -> AbortResult | None:
        """Stops the requests ``msg`` names; the ``AbortResult`` when it asked for one."""
        targets = abort_targets(msg, self.live)
        now = time.time()
        for req in targets:
            self._remove(req)
            req.finish(
                FinishAbort(message=msg.reason, status_code=499 if not msg.abort_all else 503), now
            )
            self._release(req)
            if not req.kv_only:  # internal: no client waits for a row
                self._rows_due.append(req)
        return (
            AbortResult(control_id=msg.control_id, aborted=len(targets)) if msg.control_id else None
        )

    # --- the step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(
            self.waiting
            or self.prefilling
            or self.running
            or self._rows_due
            or self.pd.has_work
            or self.grammars
        )

    def only_compiling(self) -> bool:
        """Whether all this scheduler has to do is wait for grammars to compile: a step now
        would do nothing, so the loop may wait on its sockets instead of spinning."""
        busy = self.waiting or self.prefilling or self.running or self._rows_due or self.pd.has_work
        return (
            not busy
            and bool(self.grammars)
            and self.grammars is not None
            and not self.grammars.any_done()
        )

    def close(self) -> None:
        """Stops the grammar compiler's worker (a compile under way is left to finish)."""
        if self.grammars is not None:
            self.grammars.compiler.close()

    def step(self) -> list[BatchTokenIDOutput | BatchEmbeddingOutput]:
        rows, self._rows_due = self._rows_due, []
        if self.grammars:  # never waits: only compiles that have finished are taken
            now = time.time()
            for req in self.grammars.take(now):
                if req.finished:
                    rows.append(req)  # refused (an invalid spec): its row goes out, it is released
                else:
                    self.enqueue(req, now)
        prebuilt = self.pd.take_inputs(self, rows, time.time())
        newly_running = self._prefill(rows)
        steady = self._decode(rows)
        frames: list[BatchTokenIDOutput | BatchEmbeddingOutput] = []
        embedded = [r for r in rows if r.is_embedding]
        if embedded:
            rows = [r for r in rows if not r.is_embedding]
            size = self.runner.model_config.hidden_size
            frames.append(
                build_embedding_output(
                    embedded, np.stack([pooled_embedding(r, size) for r in embedded])
                )
            )
        if rows or steady is not None:
            frames.append(
                build_token_output(
                    rows, self.stats_pending, steady=steady, dense_usage=self.dense_usage_columns
                )
            )
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
        batch: list[Chunk] = []
        candidates = list(self.prefilling)
        self.prefilling = []
        slots_for_decode = self.decode_demand()
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
            got = self.prefix_kv.admit(
                req,
                match=from_waiting and not req.is_embedding,
                budget=budget,
                reserve=slots_for_decode,
            )
            if got is None:
                self._requeue_unscheduled(req)
                budget = 0  # arrival order: nobody overtakes a request that does not fit
                continue
            slots, fetched = got
            if from_waiting:
                self.waiting.popleft()
                req.leave_waiting_queue(now)
                if record_admission(req, fetched, self.prefix_kv.storage_backend):  # its first
                    self.prefill_tokens_total += len(req.origin_input_ids)
                    self.cached_tokens_total += req.num_computed
            take = len(slots)
            batch.append((req, req.fill_ids[req.num_computed : req.num_computed + take], slots))
            budget -= take
        if not batch:
            return []

        logits, done_rows, mid_chunk = forward_chunks(self.runner, batch)
        self.forward_steps += 1
        self.prefilling.extend(mid_chunk)
        if not done_rows:
            return []
        done = [batch[i][0] for i in done_rows]
        finished_at = time.time()
        for req in done:
            ts = req.stats.time_stats
            if ts is not None and ts.prefill_finished_time is None:
                req.update_time_stats(prefill_finished_time=finished_at)
        for req in done:
            if req.kv_only:
                self._release(req)  # a re-bootstrap wanted only the KV: sent on release
            elif req.is_embedding or req.sampling.max_new_tokens == 0:
                # An embedding, or a prompt scored without a completion (its prompt
                # logprobs are on the request): done with the prefill.
                req.finish(FinishLength(length=0), finished_at)
                rows.append(req)
        generating = [i for i in done_rows if not batch[i][0].finished and not batch[i][0].kv_only]
        if not generating:
            return []
        done = [batch[i][0] for i in generating]
        if self.dllm is not None:
            return done  # they decode block by block from the next step on: nothing to sample
        picked = (
            logits
            if len(generating) == len(batch)
            else logits[torch.tensor(generating, device=logits.device)]
        )
        tokens = sample_first_tokens(self.runner, picked, done, self.stop_checker, self.masks)
        self.pd.on_first_token(done)  # before their rows take the first token's logprobs
        return self.append_tokens(done, tokens, rows)

    def _release_kv(self, req: Req) -> None:
        if self.dllm is not None:
            self.dllm.drop_block(req)  # a block in progress is never cached: it restarts
        # Nothing here ever matches the prefix of KV a prefill server built.
        self.prefix_kv.release(req, cache=not req.kv_prebuilt)

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
        slots = self.prefix_kv.alloc(len(batch))
        assert slots is not None, "retraction left too few KV slots"
        steady = self.decoder.step(batch, slots, rows)
        self.forward_steps += 1
        self.generated_tokens_total += len(slots)
        return steady

    def append_tokens(self, reqs: list[Req], tokens: list[int], rows: list[Req]) -> list[Req]:
        """Appends one sampled token per request, checks stops, queues due rows; returns
        the requests that keep running."""
        still_running: list[Req] = []
        self.generated_tokens_total += len(tokens)
        for req, token in zip(reqs, tokens):
            req.output_ids.append(token)
            reason = accept_appended(req, token) if req.matcher is not None else None
            if reason is None:
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
        """Frees KV until every running request can take one more token (``take_victim``: whose)."""
        now = time.time()
        while not self.prefix_kv.fits(self.decode_demand()):
            self._retract(take_victim(self.prefilling, self.running), now)

    def decode_demand(self) -> int:
        """Pool slots the next decode step takes: one per request, or what each dLLM pass needs."""
        if self.dllm is None:
            return len(self.running)
        return sum(self.dllm.slots_needed(r) for r in self.running)

    def _retract(self, req: Req, now: float) -> None:
        self._release_kv(req)  # what it computed stays in the cache while the pool allows
        req.hidden_sum = None  # an embedding request pools again from its re-prefill
        req.mark_retracted(now)
        self.num_retracted_total += 1
        if self.pd.on_retract(req, now):
            return  # a decode server fetches its KV again (and logs it)
        self.waiting.appendleft(req)
        # A warning: retraction means the pool is too small for the load, and tests and
        # operators count these lines.
        logger.warning(
            "retracted req_id=%d rid=%s retraction_count=%d",
            req.req_id,
            req.rid,
            req.retraction_count,
        )

    def slots_for_joining(self, num_tokens: int, joining: int) -> torch.Tensor | None:
        """Slots for the KV of a prebuilt request joining after ``joining`` others this step:
        None while the batch is full or the pool cannot also give each its next token."""
        if self.num_running + joining >= self.max_running_requests:
            return None
        return self.prefix_kv.alloc(num_tokens, self.decode_demand() + joining + 1)

    # --- bookkeeping ---------------------------------------------------------------------

    def _remove(self, req: Req) -> None:
        self.pd.on_abort(req)
        if self.grammars is not None and self.grammars.remove(req):
            return
        for queue in (self.running, self.prefilling):
            if req in queue:
                queue.remove(req)
                return
        if req in self.waiting:
            self.waiting.remove(req)

    def _release(self, req: Req) -> None:
        self.pd.on_release(req, time.time())  # a prefill server sends (or keeps) the KV first
        self._release_kv(req)
        self.live.pop(req.req_id, None)
        if self.live_rids.get(req.rid) is req:  # a refused duplicate leaves the live one's rid
            self.live_rids.pop(req.rid)

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
        """Requests not yet admitted: queued, waiting for PD KV or for their grammar."""
        return (
            len(self.waiting)
            + self.pd.num_waiting
            + (len(self.grammars) if self.grammars is not None else 0)
        )
