"""Tokenizes requests, sends them to the scheduler, and keeps one ``ReqState`` per live
request, updated from the detokenizer's frames.

``handle_output`` dispatches each frame by its type; ``_handle_str_output`` is the only
function that loops over a frame's rows: stats, text and finish for every row are applied in
that one pass. It is plain synchronous code, so the differential test drives it without an
HTTP server. Under ``--skip-tokenizer-init`` there is no tokenizer (``tokenizer`` is None):
prompts must be token ids, and whatever needs text (a text prompt, stop strings, media
placeholders, chat templates, /tokenize) is refused with a 400 from
``request_checks.without_tokenizer``. What a request is checked for before it is submitted
is ``RequestChecks``' (``checks``); the control round trips are ``ControlClient``'s
(``controls``); the adapters served are ``ServedAdapters``' (``loras``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import get_args

from pipeline.config import ServerConfig
from pipeline.dispatch import TypeDispatcher, route
from pipeline.frame_checks import read_embedding_rows, read_token_rows
from pipeline.peer_errors import duplicate_rid_message
from pipeline.request_ids import names_choice
from pipeline.control_frames import (
    ControlAnswer,
    LoraControlResult,
    PauseMode,
)
from pipeline.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    Constraint,
    FinishAbort,
    FinishLength,
    FinishReason,
    LogprobParams,
    LoraRef,
    MediaItem,
    SamplingParams,
    SchedulerStatsReport,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenizerManagerInput,
    TraceContext,
)
from pipeline.finish_reasons import DETOKENIZER_LOST_TEXT
from pipeline.worker_ids import WORKER_SHIFT
from pipeline.logprob_columns import RowLogprobs, read_input_logprobs, read_output_logprobs
from pipeline.token_texts import TokenTextCache
from pipeline.sockets import RateLimitedWarning
from pipeline.tokenizer_loader import LoadedTokenizer, ModelVocab
from tokenizer_proc.request_edge.bootstrap import Bootstrap
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.control_client import ControlClient
from tokenizer_proc.lora_names import ServedAdapters
from tokenizer_proc.manager_sockets import ManagerSockets
from tokenizer_proc.metrics import service_metrics
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_checks import RequestChecks
from tokenizer_proc.tracers import request_tracer

logger = logging.getLogger("tokenpipe.tokenizer_manager")


class TokenizerManager:
    def __init__(
        self,
        config: ServerConfig,
        vocab: LoadedTokenizer | ModelVocab,
        *,
        context_length: int,
        worker_index: int | None = None,
        clock: Callable[[], float] = time.time,
        req_id_base: int | None = None,
    ) -> None:
        self._clock = clock  # injectable, so the differential test is deterministic
        self.config = config
        self._init_model(vocab, context_length)
        self._init_request_ids(worker_index, req_id_base)
        self._init_observers()
        self._init_sockets()
        self._init_owners()
        self.dispatcher = self._output_handlers()

    def _init_model(self, vocab: LoadedTokenizer | ModelVocab, context_length: int) -> None:
        # None under --skip-tokenizer-init: the process then never loads one.
        self.tokenizer = vocab if isinstance(vocab, LoadedTokenizer) else None
        # Logprob entries' token texts, mostly sent by the detokenizer with each frame; None
        # with no tokenizer, which the routes answer with ids (``token_id:N``) or no texts.
        self.token_texts = (
            TokenTextCache(self.tokenizer.tokenizer) if self.tokenizer is not None else None
        )
        self.vocab_size = vocab.vocab_size
        self.context_length = context_length
        self.model_name = self.config.served_model_name or vocab.name

    def _init_request_ids(self, worker_index: int | None, req_id_base: int | None) -> None:
        self.states: dict[int, ReqState] = {}
        self.rid_to_req_id: dict[str, int] = {}
        # Of several API workers (--api-workers), this one's index: it lives in the high bits
        # of every req_id and control_id this manager makes (``worker_ids.WORKER_SHIFT``).
        config = self.config
        self.worker_index = config.api_worker_index if worker_index is None else worker_index
        # Each start counts up from the current time in microseconds, so a restarted API
        # process never reuses an id a scheduler may still hold from before the restart.
        base = time.time_ns() // 1000 if req_id_base is None else req_id_base
        self._next_req_id = itertools.count((self.worker_index << WORKER_SHIFT) + base)

    def _init_observers(self) -> None:
        """What this process observes and counts. Metrics and the tracer are always there:
        objects that do nothing when they are off, so no caller tests for them."""
        self.metrics = service_metrics(self.config, self.model_name, self.context_length)
        self.tracer = request_tracer(self.config, self.model_name)
        self._dropped_rows = RateLimitedWarning(logger)
        self.num_aborted_requests = 0
        # The first report proves the whole path (scheduler, detokenizer, this process) is up:
        # until then the service is starting, and /health says so (``ready``).
        self.last_scheduler_report: SchedulerStatsReport | None = None

    def _init_sockets(self) -> None:
        self.sockets = ManagerSockets(self.config, self.worker_index, self.handle_output)

    def _init_owners(self) -> None:
        # Validation and the control round trips have their own owners; the routes reach
        # them through these (``tm.checks.tokenize``, ``tm.controls.flush_cache``).
        self.checks = RequestChecks(
            self.config,
            self.tokenizer,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
        )
        self.controls = ControlClient(self.sockets.send, self.worker_index)
        self.loras = ServedAdapters(self.model_name, self.config.lora_enabled)

    def _output_handlers(self) -> TypeDispatcher[[], None]:
        """The handler of each frame type that reaches this process: a new message is a row."""
        return TypeDispatcher(
            [
                route(BatchStrOutput, self._handle_str_output),
                route(BatchEmbeddingOutput, self._handle_embedding_output),
                route(SchedulerStatsReport, self._on_scheduler_report),
                route(LoraControlResult, self._on_lora_result),
                *(
                    route(answer, self.controls.answer)
                    for answer in get_args(ControlAnswer)
                    if answer is not LoraControlResult
                ),
            ]
        )

    @property
    def ready(self) -> bool:
        """Whether the scheduler's reports reach this process through the detokenizer: every
        process of the pipeline has started (a fresh scheduler reports at once, an idle one
        every ``IDLE_REPORT_INTERVAL`` seconds)."""
        return self.last_scheduler_report is not None

    @property
    def weight_version(self) -> str:
        """The served weights' version, as the scheduler last reported it (every API worker
        gets the reports; the scheduler sends one before it answers an update)."""
        report = self.last_scheduler_report
        return report.weight_version if report is not None else self.config.weight_version

    @property
    def paused(self) -> PauseMode | None:
        """How generation is paused (None: it runs), as the scheduler last reported it."""
        report = self.last_scheduler_report
        return report.paused if report is not None else None

    # --- start and stop ------------------------------------------------------------------

    async def start(self) -> None:
        self.sockets.start()
        # Requests a previous incarnation of this process left in the scheduler have no
        # client any more: stop them rather than let them run to completion. Only this
        # worker's: the other API workers' clients are still there.
        self.sockets.send(
            AbortReq(abort_all=True, worker=self.worker_index, reason="the API process restarted")
        )

    async def close(self) -> None:
        self.tracer.shutdown()  # flushes spans still queued for export
        self.sockets.close()

    # --- requests ------------------------------------------------------------------------

    def submit_embedding(
        self, *, input_ids: list[int], rid: str | None, created_time: float | None = None
    ) -> ReqState:
        if len(input_ids) > self.context_length:
            raise RequestValidationError(
                f"input ({len(input_ids)} tokens) is longer than the context length "
                f"({self.context_length})",
                "input",
            )
        state = self.open_state(
            sampling=SamplingParams(max_new_tokens=0),
            stream=False,
            rid=rid,
            created_time=created_time,
        )
        state.operation = "embeddings"
        state.prompt_tokens = len(input_ids)
        self.sockets.send(
            TokenizedEmbeddingReqInput(
                rid=state.rid,
                req_id=state.req_id,
                input_ids=input_ids,
                arrival_time=state.created_time,
            )
        )
        return state

    def submit_generate(
        self,
        *,
        input_ids: list[int],
        sampling: SamplingParams,
        stream: bool,
        rid: str | None,
        media: tuple[MediaItem, ...] = (),
        trace: TraceContext | None = None,
        created_time: float | None = None,
        operation: str = "generate",
        route: str | None = None,
        internal: bool = False,
        bootstrap: Bootstrap | None = None,
        logprobs: LogprobParams | None = None,
        constraint: Constraint | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        lora: LoraRef | None = None,
    ) -> ReqState:
        if self.config.mode == "embedding" and not internal:
            raise RequestValidationError(
                "this server runs --mode embedding: use /v1/embeddings or /encode, or start a "
                "server in --mode generate",
                "model",
            )
        sampling, bootstrap = self.checks.pd_half(sampling, bootstrap, internal)
        self.checks.validate_sampling(len(input_ids), sampling)
        self.checks.validate_logprobs(logprobs)
        self.checks.validate_constraint(constraint)
        self.checks.validate_priority(priority)
        state = self.open_state(
            sampling=sampling, stream=stream, rid=rid, trace=trace, created_time=created_time
        )
        state.logprob = self.checks.answered_logprobs(logprobs, bootstrap)
        if state.logprob is not None and state.logprob.logprob_start_len >= 0:
            state.prompt_ids = input_ids  # the tokens the prompt logprobs belong to
            if state.logprob.return_text and self.token_texts is not None:
                # The prompt's texts in one batch; the frames bring the output's.
                self.token_texts.fill(input_ids[state.logprob.logprob_start_len :])
        state.operation = operation
        state.route = route
        state.internal = internal
        state.constraint_kind = constraint.kind if constraint is not None else None
        state.lora = lora
        state.prompt_tokens = len(input_ids)
        self.sockets.send(
            TokenizedGenerateReqInput(
                rid=state.rid,
                req_id=state.req_id,
                input_ids=input_ids,
                sampling_params=sampling,
                stream=stream,
                arrival_time=state.created_time,
                media=media,
                trace=trace,
                bootstrap_endpoint=bootstrap.endpoint if bootstrap is not None else None,
                bootstrap_room=bootstrap.room if bootstrap is not None else None,
                logprobs=logprobs,
                constraint=constraint,
                cache_salt=cache_salt,
                priority=priority,
                lora=lora,
            )
        )
        return state

    def open_state(
        self,
        *,
        sampling: SamplingParams,
        stream: bool,
        rid: str | None,
        trace: TraceContext | None = None,
        created_time: float | None = None,
    ) -> ReqState:
        """Assigns the req_id and registers the ReqState that outputs will update."""
        req_id = next(self._next_req_id)
        rid = rid if rid is not None else f"{req_id:x}-{time.monotonic_ns() & 0xFFFFFF:06x}"
        if rid in self.rid_to_req_id:
            raise RequestValidationError(duplicate_rid_message(rid), "rid")
        now = self._clock()
        state = ReqState(
            rid=rid,
            req_id=req_id,
            stream=stream,
            sampling=sampling,
            created_time=now if created_time is None else created_time,
            trace=trace,
            tokenized_time=now,
        )
        self.states[req_id] = state
        self.rid_to_req_id[rid] = req_id
        return state

    def abort(self, req_id: int, reason: str = "client disconnected") -> None:
        if req_id in self.states and not self.states[req_id].finished:
            self.sockets.send(AbortReq(req_id=req_id, reason=reason))

    def abort_all(self, reason: str) -> None:
        """Every request of every API worker."""
        self.sockets.send(AbortReq(abort_all=True, reason=reason))

    async def abort_rid(self, rid: str, reason: str, timeout: float = 10.0) -> bool:
        """Stops the running request ``rid``, or when none has that rid, every choice of the
        OpenAI request it names (``pipeline/request_ids.py``); False when none is running. A
        request of another API worker (--api-workers) is stopped by the scheduler, which
        finds it by the same rule and answers how many it stopped; its finished row goes to
        its own worker."""
        req_id = self.rid_to_req_id.get(rid)
        named = [req_id] if req_id is not None else self._choices_named(rid)
        for each in named:
            self.abort(each, reason)
        if named:
            return True
        if self.config.api_workers == 1:
            return False
        return await self.controls.abort_elsewhere(rid, reason, timeout)

    def _choices_named(self, name: str) -> list[int]:
        return [req_id for rid, req_id in self.rid_to_req_id.items() if names_choice(name, rid)]

    def forget(self, state: ReqState) -> None:
        self.states.pop(state.req_id, None)
        if self.rid_to_req_id.get(state.rid) == state.req_id:
            del self.rid_to_req_id[state.rid]

    # --- outputs: the one loop over rows -------------------------------------------------

    def handle_output(self, frame: TokenizerManagerInput) -> None:
        """Applies one frame from the detokenizer, by its type (``_output_handlers``)."""
        self.dispatcher.dispatch(frame)

    def _on_scheduler_report(self, frame: SchedulerStatsReport) -> None:
        last = self.last_scheduler_report
        if last is not None and last.instance != frame.instance:
            self._fail_in_flight(
                "the scheduler restarted and lost this request; send it again", 503
            )
            # Requests sent while no scheduler ran wait in the socket and reach the new one,
            # but their clients were just told they were lost: stop them there. Only this
            # worker's, and only those: whatever is sent from now on comes after this message
            # on the same socket.
            self.sockets.send(
                AbortReq(
                    abort_all=True,
                    worker=self.worker_index,
                    reason="reported lost to the client after a scheduler restart",
                )
            )
        self.last_scheduler_report = frame
        self.loras.learn(frame.lora_adapters)
        # Every worker gets the reports; one sets the gauges, or a multiprocess /metrics
        # would count the retraction total once per worker.
        if self.worker_index == 0:
            self.metrics.scheduler.update(frame)
            self.metrics.lora.on_report(frame)

    def _on_lora_result(self, frame: LoraControlResult) -> None:
        # Learnt before the waiting call answers its client: its change is seen at once.
        self.loras.learn(frame.adapters)
        self.controls.answer(frame)

    def _handle_str_output(self, frame: BatchStrOutput) -> None:
        now = self._clock()
        columns = read_token_rows(frame)  # ValueError when a column disagrees: nothing applied
        req_ids = columns.req_ids
        rows = columns.tokens
        completion = columns.completion_tokens
        logprobs, prompt_logprobs = _logprob_rows(frame, rows)
        if frame.token_texts is not None and self.token_texts is not None:
            self.token_texts.add(frame.token_texts)  # ValueError when its columns disagree
        stats_col = frame.request_stats
        finished_col = frame.finished_reasons
        metrics = self.metrics.requests
        observe_tokens = metrics.observes_tokens
        for i in range(len(req_ids)):
            state = self.states.get(req_ids[i])
            stats = stats_col[i] if stats_col is not None else None
            if state is not None and stats is not None:
                state.update_request_stats(stats, now)
            reason = finished_col[i] if finished_col is not None else None
            if reason is not None and reason == DETOKENIZER_LOST_TEXT:
                # A restarted detokenizer has none of this request's text: the row's ids
                # would show without it, so none of the row is output, and the request fails
                # (stats or not: its client must not wait). Later rows find no state.
                if state is not None:
                    self._finish(state, reason, now)
                    state.event.set()
                continue
            if state is None or state.request_stats is None:
                self._dropped_rows.warn(
                    "dropped an output row for req_id %d: %s",
                    req_ids[i],
                    "no live request" if state is None else "no stats yet",
                )
                continue
            if i in prompt_logprobs:
                state.prompt_logprobs.extend(prompt_logprobs[i])
            previous_token_time = state.last_token_time
            state.add_output(frame.text_deltas[i], rows[i], completion[i], now, logprobs.get(i))
            if observe_tokens and rows[i] and not state.internal:
                metrics.on_tokens(state, len(rows[i]), previous_token_time, now)
            if reason is not None:
                self._finish(state, reason, now)
            state.event.set()
        metrics.end_frame()

    def _handle_embedding_output(self, frame: BatchEmbeddingOutput) -> None:
        now = self._clock()
        req_ids, matrix = read_embedding_rows(frame)
        finished_col = frame.finished_reasons
        for i in range(len(req_ids)):
            state = self.states.get(req_ids[i])
            if state is None:
                self._dropped_rows.warn(
                    "dropped an embedding row for req_id %d: no live request", req_ids[i]
                )
                continue
            state.update_request_stats(frame.request_stats[i], now)
            state.embedding = matrix[i]
            reason = finished_col[i] if finished_col is not None else None
            self._finish(state, reason if reason is not None else FinishLength(length=0), now)
            state.event.set()

    def _fail_in_flight(self, message: str, status: int) -> None:
        """Finishes every live request with an abort, so no client waits forever for a
        process that no longer holds its request."""
        now = self._clock()
        logger.warning("%s: failing %d in-flight requests", message, len(self.states))
        for state in list(self.states.values()):
            self._finish(state, FinishAbort(message=message, status_code=status), now)
            state.event.set()

    def _finish(self, state: ReqState, reason: FinishReason, now: float) -> None:
        """Marks the state finished, counts and observes it, and forgets its ids."""
        state.finished_reason = reason
        state.finished_time = now
        if isinstance(reason, FinishAbort):
            self.num_aborted_requests += 1
            if reason == DETOKENIZER_LOST_TEXT:
                # The scheduler still runs it, for nobody: only this process can stop it.
                self.sockets.send(AbortReq(req_id=state.req_id, reason=reason.message))
        self._observe_finish(state)
        self.forget(state)

    def _observe_finish(self, state: ReqState) -> None:
        if state.internal:
            return
        metrics = self.metrics.requests
        reason = state.finished_reason
        if isinstance(reason, FinishAbort) and reason.retry_after is not None:
            # Counted here, once per pipeline request the scheduler refused for a full
            # waiting queue (an OpenAI request of n choices may count up to n), whichever
            # route it came by; it is also a request and an abort, as any refusal is.
            metrics.on_rejected("queue_full")
        if state.request_stats is None:  # lost before the scheduler reported: counted, no span
            if isinstance(reason, FinishAbort):
                metrics.on_lost(state)
            return
        metrics.on_finish(state)
        self.metrics.lora.on_finish(state)
        self.tracer.on_finish(state, operation=state.operation)


def _logprob_rows(
    frame: BatchStrOutput, rows: list[list[int]]
) -> tuple[dict[int, RowLogprobs], dict[int, RowLogprobs]]:
    """The output and prompt logprobs of the frame's rows, by row index. A ValueError (and
    nothing applied) when the logprob columns disagree with the rows."""
    lp = frame.logprobs
    if lp is None:
        return {}, {}
    output = (
        read_output_logprobs(lp.output, [len(r) for r in rows]) if lp.output is not None else {}
    )
    prompt = read_input_logprobs(lp.input, len(rows)) if lp.input is not None else {}
    return output, prompt
