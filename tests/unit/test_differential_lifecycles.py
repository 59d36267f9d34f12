"""Differential lifecycle test (docs/design.md section 9): stats sent only when due must give the
client, the metrics and the spans exactly what full stats on every row would give.

Two pipelines see the same frames. The optimized one is the real path: rows built by
``build_token_output`` (so ``take_request_stats_due`` decides; rows without an event
sometimes as the running batch's ``SteadyRows``), msgpack encode and typed
decode, the real detokenizer, the split by API worker (``pipeline.worker_frames``: each
request goes to one of ``WORKERS`` tokenizer managers at random, and each worker gets its
own part of each frame), another encode/decode per part, and the real
``TokenizerManager.handle_output`` of that worker. The reference frame is the same frame
with the current stats on every row, unsplit: every worker's manager gets it whole and
drops the rows that are not its own (exactly those: the test counts the drops). After
every frame, every row's client-visible output (text and ids since the last output, and
``meta_info``), every metrics observation and, per finished request, every span attribute
must be equal, each worker's against the same worker's.

Both pipelines share the code between the frame and the client, so each finished request
is also checked against the truth the simulation keeps (``tests.lifecycle_sim``): the ids
the client got, joined, are the request's tokens, and none of its first
``min_new_tokens`` is a stop token; its text is ``expected_text`` (stop tokens and stop
strings trimmed by plain decodes, ``min_new_tokens`` and several stop strings included,
and no stop string missed, special tokens inside it included); its ``queue_time`` is the
time the simulation kept it waiting (aborts in the queue included).

Logprobs (docs/design.md section 11): a share of requests ask for them, with values the simulation
derives from (request, position) (``tests.sim_logprobs``), so after every output each
request's entries at the tokenizer manager (``ReqState.logprobs``, or the stream chunks'
for a streaming request, and ``ReqState.prompt_logprobs``) and the /generate logprob keys
of its ``meta_info`` must equal those values exactly, float32-rounded: one entry per token
delivered, none lost, none sent twice across retractions and re-prefills. Each frame lists
exactly the rows that asked and carry tokens (and the first rows with prompt logprobs), and
a frame in which no row has any carries ``logprobs`` None. Streaming clients sometimes skip
a read, so rows wait as several chunks or merge into one while an event is being sent, and
their logprobs must follow.

The suite runs 10,000 lifecycles, half with metrics on and half off, to keep it within its
time budget (the spec's default of 20,000, and more, on request:
``python -m pytest tests/unit/test_differential_lifecycles.py --lifecycles 20000``).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.main import detokenize_frame
from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerInput,
    OutputLogprobs,
    SamplingParams,
    TokenizerManagerInput,
)
from pipeline.columns import from_column
from pipeline.logprob_columns import LogprobBlock
from pipeline.token_texts import TokenTextCache
from pipeline.tokenizer_loader import load_tokenizer
from pipeline.worker_frames import split_embedding_output, split_str_output, workers_of
from scheduler_proc.output_builder import SteadyRows, build_embedding_output, build_token_output
from scheduler_proc.req import Req
from tests.lifecycle_sim import (
    SimWorld,
    embedding_lifecycle,
    expected_text,
    lifecycle,
    make_req,
    make_sampling,
    pick_kind,
)
from tests.sim_logprobs import (
    LogprobTruth,
    expected_meta,
    make_logprob_params,
    prompt_positions,
)
from tokenizer_proc.native.logprob_meta import logprob_meta, prompt_logprob_meta
from tokenizer_proc.request_edge.meta_info import build_meta_info
from tokenizer_proc.metrics import ServiceMetrics
from tokenizer_proc.req_state import LogprobEntries, ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager
from tokenizer_proc.tracing import RequestTracer

TOKENIZER = load_tokenizer(None)
ENCODER = msgspec.msgpack.Encoder()
TO_DETOKENIZER = msgspec.msgpack.Decoder(DetokenizerInput)
TO_MANAGER = msgspec.msgpack.Decoder(TokenizerManagerInput)
MAX_ACTIVE = 12
WORKERS = 3  # API workers (tokenizer managers); each request is placed on one at random
SPAN_BATCH = 200  # finished requests between span comparisons (the exporter queue holds 2048 spans)
LOGPROB_SHARE = 0.25  # of the unified generation requests
NO_ENTRIES = LogprobEntries()


@functools.cache
def token_text(token: int) -> str:
    """``return_text_in_logprobs``: one token's text, special tokens shown (as /generate);
    kept, as the test asks for the same few thousand tokens' texts again and again."""
    return TOKENIZER.decode([token], skip_special_tokens=False)


class FramesOnly:
    """The tokenizer behind an optimized worker's token-text cache: it decodes only while a
    request arrives (its prompt, as ``TokenizerManager.submit_generate`` does, and, here
    only, its ``token_ids_logprob``, which no frame carries), so every other text a worker
    shows must have come with its part of a frame."""

    def __init__(self, real: Any) -> None:
        self.decoder = real.decoder
        self._real = real
        self.arriving = False

    def id_to_token(self, token: int) -> str | None:
        return self._real.id_to_token(token)

    def decode_batch(self, ids: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
        assert self.arriving, (
            f"a worker had to decode {ids[:4]}: its frames did not bring their texts"
        )
        return self._real.decode_batch(ids, skip_special_tokens=skip_special_tokens)


class Recorder:
    """Stands in front of one metric child and records each observation, in order."""

    def __init__(self, log: list[tuple[str, str, float]], name: str, child: Any) -> None:
        self._log, self._name, self._child = log, name, child

    def inc(self, amount: float = 1.0) -> None:
        self._log.append((self._name, "inc", amount))
        self._child.inc(amount)

    def observe(self, value: float) -> None:
        self._log.append((self._name, "observe", value))
        self._child.observe(value)

    def observe_many(self, value: float, count: int) -> None:
        # Recorded as the ``count`` observations it stands for.
        self._log.extend([(self._name, "observe", value)] * count)
        self._child.observe_many(value, count)


def record_metrics(tm: TokenizerManager) -> list[tuple[str, str, float]]:
    log: list[tuple[str, str, float]] = []
    if not isinstance(tm.metrics, ServiceMetrics):  # metrics off: nothing to record
        return log
    requests = tm.metrics.requests
    for attr, value in list(vars(requests).items()):
        if isinstance(value, dict):
            setattr(requests, attr, {k: Recorder(log, f"{attr}[{k}]", v) for k, v in value.items()})
        elif hasattr(value, "inc") or hasattr(value, "observe"):
            setattr(requests, attr, Recorder(log, attr, value))
    return log


@dataclass
class Delivered:
    """What the client of one request has received so far, joined (text, ids, and the
    tokenizer manager's logprob entries behind them), the last ``meta_info`` and the
    number of events."""

    text: str = ""
    ids: list[int] = field(default_factory=list)
    meta_info: dict[str, Any] | None = None
    logprobs: LogprobEntries = field(default_factory=LogprobEntries)
    events: int = 0

    def add(self, output: dict[str, Any]) -> None:
        for event in output.get("events", [output]):
            if "embedding" in event:
                continue
            if "events" not in output:  # a non-streaming answer is the whole output
                self.text, self.ids, self.logprobs = "", [], LogprobEntries()
            self.text += event["text"]
            self.ids += event["output_ids"]
            self.meta_info = event["meta_info"]
            self.events += 1
            entries = event["logprobs"]
            if entries is not None:
                self.logprobs.chosen += entries.chosen
                self.logprobs.top += entries.top
                self.logprobs.ids += entries.ids


@dataclass
class Pipeline:
    tms: list[TokenizerManager]  # one per API worker, by worker index
    detok: IncrementalDetokenizer
    metrics_logs: list[list[tuple[str, str, float]]]  # per worker
    spans: list[InMemorySpanExporter]  # per worker
    # True: each worker gets its part of each frame; False: every worker gets every frame whole
    split: bool
    states: dict[int, ReqState] = field(default_factory=dict)
    texts: TokenTextCache | None = None  # the detokenizer's logprob token texts
    text_of: dict[int, Callable[[int], str] | None] = field(
        default_factory=dict
    )  # req_id -> return_text_in_logprobs
    first_event_sent: set[int] = field(
        default_factory=set
    )  # streaming req_ids past their first event
    dropped: list[int] = field(
        default_factory=lambda: [0] * WORKERS
    )  # rows each worker must have dropped so far
    decoders: list[FramesOnly | None] = field(
        default_factory=lambda: [None] * WORKERS
    )  # the split side's text-cache tokenizers, by worker

    def feed(self, frame: BatchTokenIDOutput | BatchEmbeddingOutput) -> None:
        wire = TO_DETOKENIZER.decode(ENCODER.encode(frame))
        # The detokenizer passes embedding frames on as they came (split by worker on the split
        # side).
        out = (
            wire
            if isinstance(wire, BatchEmbeddingOutput)
            else detokenize_frame(self.detok, wire, self.texts)
        )  # type: ignore[arg-type]
        owners = workers_of(from_column(out.req_ids, REQ_ID_DTYPE))
        if self.split:
            self.feed_parts(frame, out)
        else:
            received = TO_MANAGER.decode(ENCODER.encode(out))
            if isinstance(frame, BatchTokenIDOutput):
                # The logprob columns pass through the detokenizer unchanged; none stays none.
                assert received.logprobs == wire.logprobs and (received.logprobs is None) == (
                    frame.logprobs is None
                )  # type: ignore[union-attr]
            for w, tm in enumerate(self.tms):
                tm.handle_output(received)
                self.dropped[w] += int((owners != w).sum())  # the rows of the other workers
        # Each worker dropped exactly the rows that are not its own (the split: none), so
        # the reference's drops change nothing the comparison sees.
        for w, tm in enumerate(self.tms):
            assert tm._dropped_rows.total == self.dropped[w], (
                f"worker {w} dropped {tm._dropped_rows.total} rows, expected {self.dropped[w]}"
            )

    def feed_parts(
        self,
        frame: BatchTokenIDOutput | BatchEmbeddingOutput,
        out: BatchStrOutput | BatchEmbeddingOutput,
    ) -> None:
        """As the detokenizer sends them: one part per worker with rows, each through that
        worker's socket (encode, typed decode) to that worker's manager."""
        split = (
            split_embedding_output(out, WORKERS)
            if isinstance(out, BatchEmbeddingOutput)
            else split_str_output(out, WORKERS)
        )
        assert not split.stray and split.parts, "every row belongs to an existing worker"
        for w, part in split.parts:
            received = TO_MANAGER.decode(ENCODER.encode(part))
            self.tms[w].handle_output(received)
        if isinstance(frame, BatchTokenIDOutput):
            # The logprob columns pass through the detokenizer; none stays none in every part.
            assert (frame.logprobs is None) == all(
                part.logprobs is None  # type: ignore[union-attr]
                for _, part in split.parts
            )

    def finished_spans(self) -> list[list[dict[str, Any]]]:
        """Per worker, the exported spans without their random ids: name, kind, times,
        parent link, attributes, events and status must all be equal."""
        return [self.worker_spans(tm, spans) for tm, spans in zip(self.tms, self.spans)]

    def metrics_marks(self) -> list[int]:
        return [len(log) for log in self.metrics_logs]

    def metrics_since(self, marks: list[int]) -> list[list[tuple[str, str, float]]]:
        """Each worker's metrics observations since ``marks``, in worker order."""
        return [log[mark:] for log, mark in zip(self.metrics_logs, marks)]

    @staticmethod
    def worker_spans(tm: TokenizerManager, spans: InMemorySpanExporter) -> list[dict[str, Any]]:
        tm.tracer.force_flush()
        out = [
            {
                "name": sp.name,
                "kind": sp.kind,
                "start": sp.start_time,
                "end": sp.end_time,
                "has_parent": sp.parent is not None,
                "attributes": dict(sp.attributes or {}),
                "events": [(e.name, e.timestamp) for e in sp.events],
                "status": (sp.status.status_code, sp.status.description),
            }
            for sp in spans.get_finished_spans()
        ]
        spans.clear()
        return out

    def client_output(self, req_id: int) -> dict[str, Any] | None:
        """What the client would receive now for this request (None: nothing yet)."""
        state = self.states[req_id]
        if state.request_stats is None:
            return None
        if state.stream:
            # As /generate streams them: one event per chunk, the finish on the last only.
            chunks, finished = state.take_pending(), state.finished
            events = []
            for i, c in enumerate(chunks):
                interim = None if finished and i == len(chunks) - 1 else c
                meta = build_meta_info(state, interim)
                self.add_logprob_meta(
                    meta, state, c.ids, c.logprobs, first_event=req_id not in self.first_event_sent
                )
                self.first_event_sent.add(req_id)
                events.append(
                    {"text": c.text, "output_ids": c.ids, "meta_info": meta, "logprobs": c.logprobs}
                )
            return {"events": events}
        if state.finished:
            text, ids = state.text, state.output_ids
        else:
            return None
        if state.embedding is not None:
            return {"embedding": state.embedding.tolist(), "meta_info": build_meta_info(state)}
        meta = build_meta_info(state)
        self.add_logprob_meta(meta, state, ids, state.logprobs, first_event=True)
        return {
            "text": text,
            "output_ids": ids,
            "meta_info": meta,
            "logprobs": state.logprobs if state.logprob else None,
        }

    def add_logprob_meta(
        self,
        meta: dict[str, Any],
        state: ReqState,
        ids: list[int],
        entries: LogprobEntries | None,
        *,
        first_event: bool,
    ) -> None:
        """The logprob keys as /generate adds them (``tokenizer_proc.native.events``): the
        output ones of these ids, the prompt's on the first event only."""
        asked = state.logprob
        if asked is None:
            return
        text_of = self.text_of[state.req_id]
        meta.update(logprob_meta(asked, ids, entries, text_of))
        if asked.logprob_start_len >= 0 and first_event:
            meta.update(
                prompt_logprob_meta(asked, state.prompt_ids, state.prompt_logprobs, text_of)
            )


def make_pipeline(metrics: bool, clock: Any, split: bool) -> Pipeline:
    config = ServerConfig(
        scheduler_input="ipc:///unused", tokenizer_input="ipc:///unused", enable_metrics=metrics
    )
    tms = [
        TokenizerManager(
            config, TOKENIZER, context_length=2048, worker_index=w, clock=clock, req_id_base=1
        )
        for w in range(WORKERS)
    ]
    spans = [InMemorySpanExporter() for _ in tms]
    for tm, exporter in zip(tms, spans):
        tm.tracer = RequestTracer(config, tm.model_name, exporter=exporter)
    detok = IncrementalDetokenizer(TOKENIZER.tokenizer)
    pipe = Pipeline(
        tms,
        detok,
        [record_metrics(tm) for tm in tms],
        spans,
        split,
        texts=TokenTextCache(TOKENIZER.tokenizer),
    )
    if split:
        pipe.decoders = [FramesOnly(TOKENIZER.tokenizer) for _ in tms]
        for tm, decoder in zip(tms, pipe.decoders):
            tm.token_texts = TokenTextCache(decoder)  # type: ignore[arg-type]
    return pipe


def compare_spans(opt: Pipeline, ref: Pipeline, seed: int) -> int:
    """Each worker's spans against the same worker's, in worker order."""
    compared = 0
    for w, (got, want) in enumerate(zip(opt.finished_spans(), ref.finished_spans())):
        for a, b in zip(got, want):
            if a != b:
                pytest.fail(
                    f"seed {seed}: span of worker {w} differs\n optimized: {a}\n reference: {b}"
                )
        assert len(got) == len(want), (
            f"seed {seed}: worker {w} exported {len(got)} spans against {len(want)}"
        )
        compared += len(got)
    return compared


def run_differential(lifecycles: int, seed: int, metrics: bool) -> int:
    """Drives ``lifecycles`` random lifecycles; returns the number of rows compared."""
    rng = random.Random(seed)
    world = SimWorld(rng, TOKENIZER)
    opt, ref = (
        make_pipeline(metrics, lambda: world.now, split=True),
        make_pipeline(metrics, lambda: world.now, split=False),
    )
    # Its own generator, so the lifecycles drawn for a seed are those drawn without workers.
    placement = random.Random(f"workers-{seed}")
    stop_token = next(iter(TOKENIZER.eos_token_ids))
    active: list[tuple[Req, Any]] = []
    delivered: dict[int, Delivered] = {}
    prompt_sent: set[int] = set()  # req_ids whose prompt logprobs went out
    truth = LogprobTruth(world.vocab_size)
    started = compared = finished_since_spans = spans = 0
    while started < lifecycles or active:
        while started < lifecycles and len(active) < MAX_ACTIVE and rng.random() < 0.5:
            embedding = rng.random() < 0.08
            stream = not embedding and rng.random() < 0.6
            sampling = (
                SamplingParams(max_new_tokens=0) if embedding else make_sampling(rng, stream)[0]
            )
            kind = "embedding" if embedding else pick_kind(rng)
            # The server refuses logprobs through PD and in --mode dllm.
            asked = (
                make_logprob_params(rng, world.vocab_size)
                if kind == "unified" and rng.random() < LOGPROB_SHARE
                else None
            )
            if asked is not None and rng.random() < 0.5:
                asked = msgspec.structs.replace(asked, return_text=True)
            rid = f"sim-{seed}-{started}"
            worker = placement.randrange(WORKERS)
            s_opt = opt.tms[worker].open_state(sampling=sampling, stream=stream, rid=rid)
            s_ref = ref.tms[worker].open_state(sampling=sampling, stream=stream, rid=rid)
            assert s_opt.req_id == s_ref.req_id
            if embedding:
                s_opt.operation = s_ref.operation = "embeddings"
            opt.states[s_opt.req_id], ref.states[s_ref.req_id] = s_opt, s_ref
            req = make_req(
                rng,
                s_opt.req_id,
                sampling,
                stream,
                metrics,
                world.now,
                world.stats_pending,
                embedding=embedding,
                logprob=asked,
            )
            # The reference decodes each token; the optimized side answers from the texts
            # the detokenizer sent with the frames (the prompt's decoded on arrival).
            shown = asked is not None and asked.return_text
            opt.text_of[req.req_id] = opt.tms[worker].token_texts if shown else None
            ref.text_of[req.req_id] = token_text if shown else None
            for state in (s_opt, s_ref):
                state.logprob = asked  # as TokenizerManager.submit_generate records them
                if asked is not None and asked.logprob_start_len >= 0:
                    state.prompt_ids = req.origin_input_ids
            texts, decoder = opt.tms[worker].token_texts, opt.decoders[worker]
            if shown and texts is not None and decoder is not None:
                decoder.arriving = True
                if asked.logprob_start_len >= 0:  # type: ignore[union-attr]
                    start = asked.logprob_start_len  # type: ignore[union-attr]
                    texts.fill(req.origin_input_ids[start:])
                texts.fill(asked.token_ids_logprob)  # type: ignore[union-attr]
                decoder.arriving = False
            active.append(
                (
                    req,
                    embedding_lifecycle(world, req)
                    if embedding
                    else lifecycle(world, req, stop_token, kind),
                )
            )
            started += 1
        if rng.random() < 0.01:
            world.toggle_storage()
        world.rows = []
        world.embedding_rows = []
        still = []
        for req, steps in active:
            try:
                next(steps)
                still.append((req, steps))
            except StopIteration:
                pass
        active = still
        if world.rows:
            compared += compare_frame(world, opt, ref, seed, delivered, prompt_sent, truth)
            finished_since_spans += sum(r.finished for r in world.rows)
        if world.embedding_rows:
            compared += compare_embedding_frame(world, opt, ref, seed)
            finished_since_spans += len(world.embedding_rows)
        if finished_since_spans >= SPAN_BATCH:
            spans += compare_spans(opt, ref, seed)
            finished_since_spans = 0
        world.now += 0.01 + rng.random() / 1000
    spans += compare_spans(opt, ref, seed)
    assert spans >= 2 * lifecycles, "every request should have exported a span and its stages"
    for tm in opt.tms + ref.tms:
        tm.tracer.shutdown()  # ends its exporter thread
    return compared


def compare_frame(
    world: SimWorld,
    opt: Pipeline,
    ref: Pipeline,
    seed: int,
    delivered: dict[int, Delivered],
    prompt_sent: set[int],
    truth: LogprobTruth,
) -> int:
    # Rows without an event (not finished, no stats due, no stop strings to check) may come
    # as the running batch's columns (``SteadyRows``), after the per-request rows.
    steady = [
        r
        for r in world.rows
        if not r.finished
        and r not in world.stats_pending
        and not r.sampling.stop
        and world.rng.random() < 0.5
    ]
    rows = [r for r in world.rows if r not in steady] + steady if steady else world.rows
    # The rows whose logprobs this frame must list: those that asked and carry tokens, and
    # for prompt logprobs the first row of an asking request once its prompt was computed.
    want_output = [
        i
        for i, r in enumerate(rows)
        if r.logprob is not None and len(r.output_ids) > r.num_sent_tokens
    ]
    want_prompt = [
        i
        for i, r in enumerate(rows)
        if r.req_id in world.prompt_computed
        and r.req_id not in prompt_sent
        and prompt_positions(r.logprob, len(r.origin_input_ids))
    ]
    prompt_sent.update(rows[i].req_id for i in want_prompt)
    frame = build_token_output(
        rows[: len(rows) - len(steady)], world.stats_pending, steady=steady_rows(steady)
    )
    check_frame_logprobs(frame, want_output, want_prompt, seed)
    reference = msgspec.structs.replace(frame, request_stats=[r.stats for r in rows])
    marks = (opt.metrics_marks(), ref.metrics_marks())
    # A streaming client that does not read this step (a finished row is always read): its
    # rows wait as chunks, or merge into the last one while an event is being sent
    # (``ReqState.sending``); its next read gets them all, as several events.
    unread = [r.req_id for r in rows if r.stream and not r.finished and world.rng.random() < 0.2]
    sending = [opt.states[i] for i in unread if world.rng.random() < 0.5]
    sending += [ref.states[s.req_id] for s in sending]
    for state in sending:
        state.sending = True
    opt.feed(frame)
    ref.feed(reference)
    for state in sending:
        state.sending = False
    for req in rows:
        if req.req_id in unread:
            check_logprobs(
                world, req, opt, delivered.setdefault(req.req_id, Delivered()), truth, seed
            )
            continue
        got, want = opt.client_output(req.req_id), ref.client_output(req.req_id)
        if got != want:
            pytest.fail(
                f"seed {seed}: output of {req.rid} differs at t={world.now:.3f}\n optimized: "
                f"{got}\n reference: {want}"
            )
        got_so_far = delivered.setdefault(req.req_id, Delivered())
        if got is not None:
            check_logprob_meta(world, req, opt, got, got_so_far, truth, seed)
            got_so_far.add(got)
        check_logprobs(world, req, opt, got_so_far, truth, seed)
        if req.finished:
            check_against_truth(world, req, delivered.pop(req.req_id), seed)
            truth.forget(req.req_id)
    same_states(opt, ref, seed)
    new_opt, new_ref = opt.metrics_since(marks[0]), ref.metrics_since(marks[1])
    if new_opt != new_ref:
        pytest.fail(
            f"seed {seed}: metrics observations differ at t={world.now:.3f}\n optimized: "
            f"{new_opt}\n reference: {new_ref}"
        )
    return len(rows)


def same_states(opt: Pipeline, ref: Pipeline, seed: int) -> None:
    """Each worker holds the same live requests on both sides: the split sent none of its
    rows elsewhere, and the reference's dropped rows touched no request."""
    for w, (a, b) in enumerate(zip(opt.tms, ref.tms)):
        if a.states.keys() != b.states.keys():
            pytest.fail(
                f"seed {seed}: worker {w} holds {sorted(a.states)} against {sorted(b.states)}"
            )


def steady_rows(reqs: list[Req]) -> SteadyRows | None:
    """These requests' rows as ``RunningBatch.take_steady`` hands them over: columns of
    their unsent tokens, and the logprobs of those that asked; marks the tokens sent."""
    if not reqs:
        return None
    sent = np.array([r.num_sent_tokens for r in reqs], dtype=np.int64)
    completion = np.array([len(r.output_ids) for r in reqs], dtype=np.int64)
    tokens = np.array([t for r in reqs for t in r.output_ids[r.num_sent_tokens :]], dtype=np.int64)
    listed = [
        (j, part)
        for j, r in enumerate(reqs)
        if r.logprob is not None and (part := r.take_pending_logprobs()) is not None
    ]
    logprobs = (
        LogprobBlock.of_parts([j for j, _ in listed], [part for _, part in listed])
        if listed
        else None
    )
    for r in reqs:
        r.num_sent_tokens = len(r.output_ids)
    return SteadyRows(
        np.array([r.req_id for r in reqs], dtype=np.int64),
        tokens,
        completion - sent,
        completion,
        [],
        logprobs,
    )


def check_against_truth(world: SimWorld, req: Req, got: Delivered, seed: int) -> None:
    """A finished request's whole output against what the simulation knows it must be."""
    where = f"seed {seed}: {req.rid} ({req.finished_reason}, {req.sampling})"
    assert got.ids == req.output_ids, (
        f"{where}: the client got ids {got.ids}, the request made {req.output_ids}"
    )
    # min_new_tokens bans what would stop the request: under EOS pressure too, none of its
    # first tokens is one.
    stops = TOKENIZER.eos_token_ids | set(req.sampling.stop_token_ids)
    assert not stops.intersection(got.ids[: req.sampling.min_new_tokens]), (
        f"{where}: a stop token before min_new_tokens"
    )
    want = expected_text(TOKENIZER, req)
    assert got.text == want, f"{where}: the client got text {got.text!r}, expected {want!r}"
    assert got.meta_info is not None and got.meta_info["completion_tokens"] == len(
        req.output_ids
    ), where
    if "queue_time" in got.meta_info:  # metrics on
        assert got.meta_info["queue_time"] == pytest.approx(
            world.queue_time[req.req_id], rel=1e-9, abs=1e-9
        ), where


def frame_rows(block: OutputLogprobs | None) -> list[int]:
    return [] if block is None else np.frombuffer(block.rows, dtype=np.int32).tolist()


def check_frame_logprobs(
    frame: BatchTokenIDOutput, want_output: list[int], want_prompt: list[int], seed: int
) -> None:
    """The frame lists exactly the rows that have logprobs; one nil when none has any."""
    lp = frame.logprobs
    if not want_output and not want_prompt:
        assert lp is None, f"seed {seed}: a frame in which no row has logprobs carries {lp}"
        return
    assert lp is not None, (
        f"seed {seed}: rows {want_output} (prompt: {want_prompt}) have logprobs, the frame none"
    )
    assert frame_rows(lp.output) == want_output, (
        f"seed {seed}: output logprob rows {frame_rows(lp.output)}, expected {want_output}"
    )
    got_prompt = frame_rows(lp.input.logprobs) if lp.input is not None else []
    assert got_prompt == want_prompt, (
        f"seed {seed}: prompt logprob rows {got_prompt}, expected {want_prompt}"
    )


def check_logprobs(
    world: SimWorld, req: Req, pipe: Pipeline, got: Delivered, truth: LogprobTruth, seed: int
) -> None:
    """After each of a request's outputs: the tokenizer manager's entries are exactly the
    simulation's values of every token delivered so far (and of every prompt position,
    once the prompt was computed), whatever retractions came."""
    state, asked = pipe.states[req.req_id], req.logprob
    where = f"seed {seed}: {req.rid} ({asked}) after {len(got.ids)} tokens delivered"
    if asked is None:
        assert (
            not state.logprobs.chosen
            and not state.prompt_logprobs.chosen
            and not got.logprobs.chosen
        ), where
        return
    if state.stream:
        assert not state.logprobs.chosen, (
            f"{where}: a streaming request's entries go to its chunks only"
        )
        want = truth.output(req.req_id, asked, len(got.ids))
        assert got.logprobs == want, (
            f"{where}: output logprobs\n got:  {got.logprobs}\n want: {want}"
        )
    else:
        want = truth.output(req.req_id, asked, len(state.output_ids))
        assert state.logprobs == want, (
            f"{where}: output logprobs\n got:  {state.logprobs}\n want: {want}"
        )
    want_prompt = (
        truth.prompt(req.req_id, asked, len(req.origin_input_ids))
        if req.req_id in world.prompt_computed
        else NO_ENTRIES
    )
    assert state.prompt_logprobs == want_prompt, (
        f"{where}: prompt logprobs\n got:  {state.prompt_logprobs}\n want: {want_prompt}"
    )


def check_logprob_meta(
    world: SimWorld,
    req: Req,
    pipe: Pipeline,
    now: dict[str, Any],
    before: Delivered,
    truth: LogprobTruth,
    seed: int,
) -> None:
    """The logprob keys of each event of this output (``before``: what the client had):
    the entries of that event's tokens, and the prompt's on the request's first event
    only (a streaming request's first, or the whole answer)."""
    asked = req.logprob
    events = now.get("events", [now])
    if asked is None:
        for event in events:
            assert not any("logprobs" in k for k in event["meta_info"]), (
                f"seed {seed}: {req.rid} asked no logprobs"
            )
        return
    offset = len(before.ids) if "events" in now else 0
    computed = req.req_id in world.prompt_computed
    want_prompt = (
        truth.prompt(req.req_id, asked, len(req.origin_input_ids)) if computed else NO_ENTRIES
    )
    for n, event in enumerate(events):
        ids, first = event["output_ids"], before.events + n == 0 or "events" not in now
        prompt_ids = req.origin_input_ids if first and asked.logprob_start_len >= 0 else None
        want_out = truth.between(req.req_id, asked, offset, offset + len(ids))
        want = expected_meta(
            asked, ids, want_out, prompt_ids, want_prompt, pipe.text_of[req.req_id]
        )
        got = {k: v for k, v in event["meta_info"].items() if "logprobs" in k}
        if got != want:
            pytest.fail(
                f"seed {seed}: {req.rid} ({asked}), event at token {offset}: logprob keys\n got:  "
                f"{got}\n want: {want}"
            )
        offset += len(ids)


def compare_embedding_frame(world: SimWorld, opt: Pipeline, ref: Pipeline, seed: int) -> int:
    rows = world.embedding_rows
    vectors = np.asarray([[world.rng.random() for _ in range(4)] for _ in rows], dtype=np.float32)
    frame = build_embedding_output(rows, vectors)
    marks = (opt.metrics_marks(), ref.metrics_marks())
    opt.feed(frame)
    ref.feed(msgspec.structs.replace(frame, request_stats=[r.stats for r in rows]))
    for req in rows:
        got, want = opt.client_output(req.req_id), ref.client_output(req.req_id)
        if got != want or got is None:
            pytest.fail(
                f"seed {seed}: embedding output of {req.rid} differs\n optimized: {got}\n "
                f"reference: {want}"
            )
    same_states(opt, ref, seed)
    if opt.metrics_since(marks[0]) != ref.metrics_since(marks[1]):
        pytest.fail(f"seed {seed}: metrics observations of an embedding frame differ")
    return len(rows)


@pytest.mark.parametrize("metrics", [True, False], ids=["metrics-on", "metrics-off"])
def test_due_stats_match_full_stats_on_every_row(
    request: pytest.FixtureRequest, metrics: bool
) -> None:
    total = int(request.config.getoption("--lifecycles"))
    seed = int(request.config.getoption("--lifecycle-seed"))
    per_seed = 500
    compared = 0
    for k in range(0, total // 2, per_seed):
        compared += run_differential(
            min(per_seed, total // 2 - k), seed + k + (0 if metrics else 1_000_003), metrics
        )
    assert compared > total  # every lifecycle emitted at least one row
