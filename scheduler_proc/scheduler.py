"""Continuous batching: admission, (chunked) prefill, batched decode, retraction, stops and
aborts. Socket-free, so tests can drive it step by step; ``scheduler_proc.main`` wires it
to ZeroMQ. One ``step()``:
0. inputs: requests whose grammar compiled (``GrammarQueue``), what PD peers sent (``PdRole``);
1. prefill: the request mid-chunk, then waiting requests in arrival order while the token
   budget and the KV pool allow, leaving each running request its next decode slots;
2. decode: one pass of the ``DecodeMode`` over every running request, retracting requests
   first when the pool cannot give each its slots; with the overlap schedule its forward
   runs on its own thread, beside step 1's prefill when the slots are free already;
3. emit: one ``BatchTokenIDOutput`` with a row for each request whose output is due (none
   for a request mid-prefill); ``Req`` decides which rows carry stats.
A feature that is off is still an object (a no-op), so the step never asks which are on.
"""

from __future__ import annotations

import logging
import time
from itertools import islice

import torch

from pipeline.peer_errors import duplicate_rid_message
from pipeline.control_frames import (
    AbortResult,
    FlushCacheControl,
    FlushCacheResult,
    HiCacheStorageControl,
    HiCacheStorageState,
)
from pipeline.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishAbort,
    FinishLength,
    FinishReason,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from scheduler_proc.admission import AdmissionCheck, QueueLimit, new_req, record_admission
from scheduler_proc.batch.decode_pass import BatchDecoder
from scheduler_proc.batch import prefill_pass
from scheduler_proc.batch.prefill_pass import Chunk
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.speculative.proposer import Drafter
from scheduler_proc.cache.hicache import Fetched, HiCache
from scheduler_proc.cache.prefix_kv import PrefixKV
from scheduler_proc.control import abort_targets, flush_cache, storage_control
from scheduler_proc.decode_mode import DecodeMode, TokenDecode
from scheduler_proc.dllm import DllmConfig, DllmDecoder
from scheduler_proc.embedding import embedding_frame
from scheduler_proc.grammar_queue import GrammarQueue
from scheduler_proc.lora_queue import LoraQueue
from scheduler_proc.model.forward_worker import ForwardRunner, ForwardThread, InlineForward
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.model.weight_update import WeightStager
from scheduler_proc.output_builder import SteadyRows, build_token_output
from scheduler_proc.pd.role import PdRole, Unified
from scheduler_proc.priority import SchedulingPolicy, scheduling_policy
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.retraction import retract_until_fits
from scheduler_proc.rollout import Rollout
from scheduler_proc.sampling.grammar import GrammarCompiler, NoGrammars, StepMasks, TokenMasks
from scheduler_proc.stop_checker import StopChecker
from scheduler_proc.waiting_queue import PriorityOrder, WaitingQueue

logger = logging.getLogger("tokenpipe.scheduler")

Frame = BatchTokenIDOutput | BatchEmbeddingOutput


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
        overlap_schedule: bool = False,
        weight_version: str = "default",
        priority: PriorityOrder | None = None,  # priority scheduling's order; None: FCFS
        drafter: Drafter | None = None,  # speculative decoding's proposer; None: off
    ) -> None:
        self.runner = runner
        # Where decode forwards run: their own thread (the overlap schedule), or inline.
        self.forward: ForwardRunner = ForwardThread() if overlap_schedule else InlineForward()
        self.kv = runner.kv
        self.stop_checker = stop_checker
        self.context_length = context_length
        self.vocab_size = vocab_size  # token ids a prompt may hold
        self.stream_interval = stream_interval
        self.collect_time_stats = collect_time_stats
        self.dense_usage_columns = dense_usage_columns  # UsageColumns on every token frame
        self.prefill_budget = chunked_prefill_size if chunked_prefill_size > 0 else context_length
        self.max_running_requests = max_running_requests
        self.queue_limit = QueueLimit.of(max_queued_requests)
        self._init_cache(hicache)
        self._init_queues(scheduling_policy(priority))
        self._init_features(dllm, grammar, drafter)
        # Pause, continue and new weights (scheduler_proc/rollout.py).
        self.rollout = Rollout(WeightStager(runner.model), weight_version)
        self._init_counters()

    def _init_cache(self, hicache: HiCache | None) -> None:
        self.prefix_kv = PrefixKV(self.kv, hicache)
        self.cache = self.prefix_kv.cache
        # The host and storage tiers under the device pool (a NoHiCache when off).
        self.hicache = self.prefix_kv.hicache

    def _init_queues(self, scheduling: SchedulingPolicy) -> None:
        # This scheduler's requests whose next row carries stats (never another scheduler's).
        self.stats_pending = StatsPending()
        self.scheduling = scheduling  # admission order, preemption (scheduler_proc/priority.py)
        self.waiting: WaitingQueue = scheduling.waiting
        self.prefilling: list[Req] = []  # admitted, prefill not complete (mid-chunk)
        self.live: dict[int, Req] = {}
        # The clients' live requests by rid: several API workers each check only their own
        # rids, and only this process sees them all. Internal requests (PD KV fetches) have
        # their own names and are not here.
        self.live_rids: dict[str, Req] = {}
        self._rows_due: list[Req] = []  # rows produced outside a step (aborts, refusals)

    def _init_features(
        self, dllm: DllmConfig | None, grammar: GrammarCompiler | None, drafter: Drafter | None
    ) -> None:
        """Each feature is an object whether it is on or off."""
        # Structured outputs: constrained requests wait for their grammar in ``grammars``
        # (empty, with no compiler, without a tokenizer), and each step's mask of the
        # constrained rows is filled in ``masks``.
        self.grammars = GrammarQueue(grammar)
        self.masks: StepMasks = (
            TokenMasks(self.runner.model_config.vocab_size, grammar.stop_ids, self.runner.device)
            if grammar is not None
            else NoGrammars()
        )
        self.mode = self._decode_mode(dllm, drafter)
        self.loras = LoraQueue(self.runner.lora)  # requests whose adapter waits for a slot
        self.pd: PdRole = Unified()  # --disaggregation-mode: set by scheduler_proc.main
        self.admission = AdmissionCheck(
            self.vocab_size,
            self.runner.model_config.vocab_size,
            self.context_length,
            self.kv.capacity,
            self.mode,
            self.stop_checker.matches_stop_strings,
            self.grammars.refusal,
        )

    def _decode_mode(self, dllm: DllmConfig | None, drafter: Drafter | None) -> DecodeMode:
        """Block diffusion with ``dllm``, else tokens by decode (or verify) passes."""
        runner, alloc = self.runner, self.prefix_kv.alloc
        if dllm is not None:
            return DllmDecoder(dllm, runner, self.stop_checker, self.context_length, alloc)
        pending, dense = self.stats_pending, self.dense_usage_columns
        decoder = BatchDecoder(runner, self.stop_checker, pending, dense, self.masks, self.forward)
        return TokenDecode.build(decoder, self.context_length, alloc, drafter)

    def _init_counters(self) -> None:
        self.num_retracted_total = 0
        self.forward_steps = 0
        self.generated_tokens_total = 0
        self.prefill_tokens_total = 0  # prompt tokens of first admissions
        self.cached_tokens_total = 0  # of those, served from the prefix cache

    @property
    def running(self) -> RunningBatch | list[Req]:
        """The running requests: a ``RunningBatch`` (columns), or a list in dLLM mode."""
        return self.mode.running

    # --- inputs --------------------------------------------------------------------------

    def add_request(self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput) -> None:
        if msg.req_id in self.live:
            logger.warning(
                "dropped a request with a duplicate req_id %d (rid %r)", msg.req_id, msg.rid
            )
            return
        now = time.time()
        req = new_req(
            msg,
            stream_interval=self.stream_interval,
            stats_pending=self.stats_pending,
            collect_time_stats=self.collect_time_stats,
        )
        req.update_stats(weight_version=self.rollout.weight_version)
        lora_problem = None
        if isinstance(msg, TokenizedGenerateReqInput):  # an embedding has no part in PD
            # Before any check: a refused prefill half still answers its decode server.
            self.pd.bind(req, msg.bootstrap_room, msg.bootstrap_endpoint)
            lora_problem = self.loras.bind(req, msg.lora)
        refusal = self._refusal(req, lora_problem)
        if refusal is not None:
            req.finish(refusal, now)
            self._rows_due.append(req)
        elif req.constraint is not None and self.grammars.start(req, now):
            self._make_live(req)  # its grammar compiles: it waits apart, live
        elif req.finished:  # a spec the grammar cache knows is invalid
            self._rows_due.append(req)
        else:
            self.enqueue(req, now)

    def _refusal(self, req: Req, lora_problem: str | None) -> FinishReason | None:
        """Why a request is answered at once instead of queued: a duplicate rid (each API
        worker knows only its own live rids), a request this scheduler can never serve (the
        tokenizer manager validates first: this guards against a frame from elsewhere), or a
        full waiting queue."""
        if req.rid in self.live_rids:
            problem: str | None = duplicate_rid_message(req.rid)
        else:
            problem = lora_problem or self.admission.problem(req)
        if problem is not None:
            return FinishAbort(message=problem, status_code=400)
        full = self.queue_limit.refusal(self.num_waiting)
        return None if full is None or self.scheduling.displace(self, req) else full

    def enqueue(self, req: Req, now: float) -> None:
        """Queues an accepted request for admission in arrival order (or, when the PD side
        takes it, for its KV from a prefill server)."""
        req.enter_waiting_queue(now)
        self._make_live(req)
        if self.loras.admit(req):  # else it waits for a slot for its adapter
            self._queue(req, now)

    def _queue(self, req: Req, now: float) -> None:
        if not self.pd.on_admit(req, now):
            self.waiting.append(req)

    def _make_live(self, req: Req) -> None:
        self.live[req.req_id] = req
        if not req.kv_only:
            self.live_rids[req.rid] = req

    def storage_control(self, msg: HiCacheStorageControl) -> HiCacheStorageState:
        return storage_control(self.hicache, self.live.values(), msg)

    def flush_cache(self, msg: FlushCacheControl) -> FlushCacheResult:
        # Only when no request is live. Paused, the waiting requests hold no KV: the cache may
        # go then (SGLang's rule too).
        held = self.num_running if self.rollout.paused else len(self.live)
        return flush_cache(self.prefix_kv, held, self.num_waiting, self.num_running, msg)

    def abort(self, msg: AbortReq) -> AbortResult | None:
        """Stops the requests ``msg`` names; the ``AbortResult`` when it asked for one."""
        targets = abort_targets(msg, self.live)
        now = time.time()
        status_code = 503 if msg.abort_all else 499
        for req in targets:
            self.drop(req, FinishAbort(message=msg.reason, status_code=status_code), now)
        if not msg.control_id:
            return None
        return AbortResult(control_id=msg.control_id, aborted=len(targets))

    # --- the step ------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._busy() or self.grammars or self.loras)

    def _busy(self) -> bool:
        """Work a step does now, grammars still compiling aside."""
        if not self.rollout.runs_steps:  # paused: only the answers to aborts go out
            return bool(self._rows_due)
        return bool(
            self.waiting or self.prefilling or self.running or self._rows_due or self.pd.has_work
        )

    def only_compiling(self) -> bool:
        """Whether all this scheduler has to do is wait for grammars to compile: a step now
        would do nothing, so the loop may wait on its sockets instead of spinning."""
        return not self._busy() and bool(self.grammars) and not self.grammars.any_done()

    def close(self, wait: float = 0.0) -> bool:
        """Stops its threads; whether no grammar compile still runs after ``wait`` s."""
        self.forward.close()
        self.rollout.close()
        return self.grammars.close(wait)

    def step(self) -> list[Frame]:
        rows, self._rows_due = self._rows_due, []
        self._take_compiled(rows)
        if not self.rollout.runs_steps:
            return self._emit(rows, None)
        # Nothing new starts while a pause drains or an update waits for its safe point.
        prebuilt = self.pd.take_inputs(self, rows, time.time()) if self.rollout.admits else []
        chunks = self._schedule_chunks()
        # The decode forward runs beside the prefill's when its slots are free already: taking
        # them first then evicts nothing and retracts no one, as the sequential order would.
        started = bool(chunks and self.running and self.kv.num_free >= self.mode.demand())
        if started:
            self.mode.start()
        newly_running = self._prefill(chunks, rows)
        steady = self._decode(rows, started)
        frames = self._emit(rows, steady)
        # New requests join after their first row is built, which records what it sent.
        self.running.extend(prebuilt)
        self.running.extend(newly_running)
        return frames

    def _take_compiled(self, rows: list[Req]) -> None:
        """Step 0: constrained requests whose grammar compiled join the waiting queue (one
        refused, an invalid spec, has its row go out), and so do requests whose adapter got
        a slot. Never waits for a compile."""
        now = time.time()
        for req in self.grammars.take(now):
            if req.finished:
                rows.append(req)
            else:
                self.enqueue(req, now)
        for req in self.loras.take():  # their adapter has a slot now (or cannot have one)
            if req.finished:
                rows.append(req)
            else:
                self._queue(req, now)

    def _prefill(self, chunks: list[Chunk], rows: list[Req]) -> list[Req]:
        """Step 1: one pass over this step's chunks (``_schedule_chunks``). Returns the
        requests that start decoding (their first token sampled, unless the decode mode
        picks it)."""
        if not chunks:
            return []
        logits, done_rows, mid_chunk = prefill_pass.forward_chunks(self.runner, chunks)
        self.forward_steps += 1
        self.prefilling.extend(mid_chunk)
        self._prefill_done([chunks[i][0] for i in done_rows], rows)
        generating = [i for i in done_rows if not (chunks[i][0].finished or chunks[i][0].kv_only)]
        if not generating:
            return []
        reqs = [chunks[i][0] for i in generating]
        if not self.mode.samples_first_token:
            return reqs  # they decode block by block from the next step on
        if len(generating) < len(chunks):
            logits = logits[torch.tensor(generating, device=logits.device)]
        draw = prefill_pass.sample_first_tokens
        tokens = draw(self.runner, logits, reqs, self.stop_checker, self.masks)
        self.pd.on_first_token(reqs)  # before their rows take the first token's logprobs
        return self.append_tokens(reqs, tokens, rows)

    def _prefill_candidates(self) -> list[Req]:
        """The requests mid-chunk, then waiting ones in admission order, up to the number
        of requests that may run at once (under priority, preempting lower ones)."""
        if self.waiting and self.rollout.admits:
            self.scheduling.make_room(self)
        candidates, self.prefilling = self.prefilling, []
        room = self.max_running_requests - len(self.running) - len(candidates)
        if self.rollout.admits:
            candidates.extend(islice(self.waiting, max(room, 0)))
        return candidates

    def _schedule_chunks(self) -> list[Chunk]:
        """This step's prefill chunks, while the token budget and the pool allow (leaving
        each running request its next decode slots); admits the waiting requests that get
        theirs. Pooling needs every prompt token's hidden state, so embeddings skip the
        prefix cache."""
        now = time.time()
        budget = self.prefill_budget
        reserve = self.mode.demand()
        chunks: list[Chunk] = []
        for req in self._prefill_candidates():
            from_waiting = bool(self.waiting) and self.waiting[0] is req
            # No request reads the cache while some still decode on the old weights' KV.
            match = from_waiting and not req.is_embedding and not self.rollout.stale
            got = None
            if budget > 0:
                got = self.prefix_kv.admit(req, match=match, budget=budget, reserve=reserve)
                if got is None and from_waiting:  # under priority, lower ones may give way
                    got = self.scheduling.admit_by_preempting(self, req, match=match, budget=budget)
                    budget = 0 if got is None else len(got[0])  # none joins behind its victims
                if got is None:
                    budget = 0  # arrival order: nobody overtakes a request that does not fit
            if got is None:
                if req.num_computed > 0:  # mid-chunk: it stays in prefill (a waiting one waits)
                    self.prefilling.append(req)
                continue
            slots, fetched = got
            if from_waiting:
                self._admit(req, fetched, now)
            start = req.num_computed
            chunks.append((req, req.fill_ids[start : start + len(slots)], slots))
            budget -= len(slots)
        return chunks

    def _admit(self, req: Req, fetched: Fetched | None, now: float) -> None:
        """A waiting request got its first chunk's slots: it leaves the queue."""
        self.waiting.popleft()
        req.leave_waiting_queue(now)
        if record_admission(req, fetched, self.prefix_kv.storage_backend):  # its first
            self.prefill_tokens_total += len(req.origin_input_ids)
            self.cached_tokens_total += req.num_computed

    def _prefill_done(self, done: list[Req], rows: list[Req]) -> None:
        """Requests whose prefill completed: a PD KV job is released (its KV goes to the
        decode server); an embedding, or a prompt scored without a completion (its prompt
        logprobs are on the request), finishes."""
        finished_at = time.time()
        for req in done:
            ts = req.stats.time_stats
            if ts is not None and ts.prefill_finished_time is None:
                req.update_time_stats(prefill_finished_time=finished_at)
        for req in done:
            if req.kv_only:
                self._release(req)  # a re-bootstrap wanted only the KV: sent on release
            elif req.is_embedding or req.sampling.max_new_tokens == 0:
                req.finish(FinishLength(length=0), finished_at)
                rows.append(req)

    def _decode(self, rows: list[Req], started: bool) -> SteadyRows | None:
        """Step 2: one decode pass over every running request (``started``: its forward
        began before the prefill). Rows with an event (finished, a stop string to check,
        stats due) are queued in ``rows`` as requests; the other due rows are columns."""
        if not self.running:
            return None
        if not started:
            retract_until_fits(self)
        steady, generated = self.mode.step(rows)
        self.forward_steps += 1
        self.generated_tokens_total += generated
        return steady

    def _emit(self, rows: list[Req], steady: SteadyRows | None) -> list[Frame]:
        """Step 3: this step's frames; a finished request is released once its row is built."""
        frames: list[Frame] = []
        embedded = [r for r in rows if r.is_embedding]
        if embedded:
            rows = [r for r in rows if not r.is_embedding]
            frames.append(embedding_frame(embedded, self.runner.model_config.hidden_size))
        if rows or steady is not None:
            dense, pending = self.dense_usage_columns, self.stats_pending
            frames.append(build_token_output(rows, pending, steady=steady, dense_usage=dense))
        for req in rows + embedded:
            if req.finished:
                self._release(req)
            else:
                self.mode.note_sent(req)  # an event row of a running request went out
        return frames

    def append_tokens(self, reqs: list[Req], tokens: list[int], rows: list[Req]) -> list[Req]:
        """Appends one sampled token per request, checks stops, queues due rows; returns
        the requests that keep running."""
        self.generated_tokens_total += len(tokens)
        return prefill_pass.append_first_tokens(reqs, tokens, self.stop_checker, rows)

    def slots_for_joining(self, num_tokens: int, joining: int) -> torch.Tensor | None:
        """Slots for the KV of a prebuilt request joining after ``joining`` others this step:
        None while the batch is full or the pool cannot also give each its next token."""
        if self.num_running + joining >= self.max_running_requests:
            return None
        return self.prefix_kv.alloc(num_tokens, self.mode.demand() + joining + 1)

    # --- bookkeeping ---------------------------------------------------------------------

    def drop(self, req: Req, reason: FinishAbort, now: float) -> None:
        """Finishes ``req`` wherever it is with ``reason``, and queues its row."""
        self.pd.on_abort(req)
        if not (self.grammars.remove(req) or self.loras.remove(req)):
            for queue in (self.running, self.prefilling, self.waiting):
                if req in queue:
                    queue.remove(req)
                    break
        req.finish(reason, now)
        self._release(req)
        if not req.kv_only:  # internal: no client waits for a row
            self._rows_due.append(req)

    def release_kv(self, req: Req) -> None:
        self.mode.drop_block(req)  # a dLLM block in progress is never cached: it restarts
        # Nothing here ever matches the prefix of KV a prefill server built, nor KV of
        # weights swapped out.
        self.prefix_kv.release(req, cache=not req.kv_prebuilt and self.rollout.may_cache(req))
        self.rollout.on_release(req, self.prefix_kv)

    def _release(self, req: Req) -> None:
        self.pd.on_release(req, time.time())  # a prefill server sends (or keeps) the KV first
        self.release_kv(req)
        self.loras.release(req)
        self.live.pop(req.req_id, None)
        if self.live_rids.get(req.rid) is req:  # a refused duplicate leaves the live one's rid
            self.live_rids.pop(req.rid)

    @property
    def kv_tokens_held_by_requests(self) -> int:
        return self.prefix_kv.held_by_requests

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued, waiting for PD KV or for their grammar."""
        return len(self.waiting) + self.pd.num_waiting + len(self.grammars) + len(self.loras)
