"""The detokenizer process: turns each ``BatchTokenIDOutput`` into a ``BatchStrOutput``
(columns and ``request_stats`` passed through untouched) and forwards embedding frames
as they came. Under ``--skip-tokenizer-init`` it loads no tokenizer and keeps no
per-request state: every row passes on with its ids and an empty text delta.

With several API workers (``--api-workers``) each has its own socket, and each gets one
frame per scheduler step holding only its own rows (the worker index is in the high bits
of every req_id: ``pipeline.worker_frames``); a control answer goes to the worker its
control_id names, and the scheduler's stats reports go to all."""

from __future__ import annotations

from typing import get_args

import logging

import msgspec
import zmq

from pipeline.config import ServerConfig
from pipeline.dispatch import TypeDispatcher, route
from pipeline.frame_checks import count_token_rows, read_token_rows
from pipeline.control_frames import (
    ControlAnswer,
)
from pipeline.io_struct import (
    COUNT_DTYPE,
    TOKEN_DTYPE,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerInput,
    SchedulerStatsReport,
)
from pipeline.columns import from_column
from pipeline.worker_ids import worker_of
from pipeline.process_util import ShutdownFlag, report_ready
from pipeline.sockets import FrameDecoder, RateLimitedWarning, bind_pull, connect_push, make_encoder
from pipeline.tokenizer_loader import load_tokenizer
from pipeline.token_texts import TokenTextCache
from pipeline.worker_frames import WorkerSplit, split_embedding_output, split_str_output
from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.logprob_texts import logprob_text_ids

logger = logging.getLogger("tokenpipe.detokenizer")


def detokenize_frame(
    detok: IncrementalDetokenizer | None,
    frame: BatchTokenIDOutput,
    texts: TokenTextCache | None = None,
) -> BatchStrOutput:
    """``detok`` None: --skip-tokenizer-init, the ids pass on without text. ``texts``: where
    the texts of logprob tokens come from, for the rows that show them. A row of a request
    whose first row this process never saw finishes as ``DETOKENIZER_LOST_TEXT``
    (``IncrementalDetokenizer.process``). Raises ValueError when a column disagrees (the
    caller drops the frame)."""
    token_texts = None
    finished = frame.finished_reasons
    if detok is None:
        deltas = [""] * count_token_rows(frame)
    else:
        rows = read_token_rows(frame)
        if frame.logprobs is not None and texts is not None:
            shows = detok.shows_logprob_texts(rows.req_ids, frame.decode_options)
            if shows.any():
                ids = from_column(frame.output_ids, TOKEN_DTYPE)
                counts = from_column(frame.output_counts, COUNT_DTYPE)
                token_texts = texts.frame_texts(
                    logprob_text_ids(frame.logprobs, ids, counts, shows)
                )
        deltas, finished = detok.process(
            rows.req_ids, rows.tokens, frame.finished_reasons, frame.decode_options
        )
    return BatchStrOutput(
        req_ids=frame.req_ids,
        text_deltas=deltas,
        output_ids=frame.output_ids,
        output_counts=frame.output_counts,
        completion_tokens=frame.completion_tokens,
        finished_reasons=finished,
        request_stats=frame.request_stats,
        logprobs=frame.logprobs,
        token_texts=token_texts,
    )


class Detokenizer:
    """The process's state between frames: the decode states, its sockets, and the table
    that hands each message to its handler. A handler gets the message and the frame it
    was decoded from, so what is not ours to change is forwarded as it came."""

    def __init__(self, config: ServerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self._init_decoding(config)
        self._init_sockets(config, ctx)
        self.dispatcher = TypeDispatcher(
            [
                route(BatchTokenIDOutput, self.on_tokens),
                route(BatchEmbeddingOutput, self.on_embeddings),
                route(SchedulerStatsReport, self.on_stats_report),
                # Every control answer, whatever its type, to the worker that asked.
                *(route(answer, self.on_control_answer) for answer in get_args(ControlAnswer)),
            ]
        )

    def _init_decoding(self, config: ServerConfig) -> None:
        tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model_path)
        self.detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer.tokenizer)
        self.texts = None if tokenizer is None else TokenTextCache(tokenizer.tokenizer)
        self.decoder: FrameDecoder[DetokenizerInput] = FrameDecoder(
            DetokenizerInput, logger, "detokenizer input"
        )
        self.encoder = make_encoder()
        self.inconsistent = RateLimitedWarning(logger)

    def _init_sockets(self, config: ServerConfig, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.inbox = bind_pull(ctx, config.detokenizer_input)
        self.outboxes = [
            connect_push(ctx, config.tokenizer_endpoint(i)) for i in range(config.api_workers)
        ]
        self.several = len(self.outboxes) > 1

    def handle(self, frame: zmq.Frame) -> None:
        """One frame off the inbox; one that does not decode is dropped (``FrameDecoder``)."""
        msg = self.decoder.decode(frame.buffer)
        if msg is not None:
            self.dispatcher.dispatch(msg, frame)

    def on_tokens(self, msg: BatchTokenIDOutput, frame: zmq.Frame) -> None:
        try:
            out = detokenize_frame(self.detok, msg, self.texts)
            if not self.several:
                self.outboxes[0].send(self.encoder.encode(out), copy=False)
                return
            parts = split_str_output(out, len(self.outboxes))
        except ValueError as exc:
            self.inconsistent.warn("dropped an inconsistent token frame: %s", exc)
            return
        self.send_parts(parts)

    def on_embeddings(self, msg: BatchEmbeddingOutput, frame: zmq.Frame) -> None:
        if not self.several:
            self.outboxes[0].send(frame, copy=False)
            return
        try:
            parts = split_embedding_output(msg, len(self.outboxes))
        except ValueError as exc:
            self.inconsistent.warn("dropped an inconsistent embedding frame: %s", exc)
            return
        self.send_parts(parts)

    def on_stats_report(self, msg: SchedulerStatsReport, frame: zmq.Frame) -> None:
        """Forwarded to every worker with this process's own count of live decode states, so
        /server_info shows per-request state left behind here too (frames arrive in order,
        so every row the scheduler sent before this report has been processed)."""
        live = self.detok.num_live if self.detok is not None else 0
        report = self.encoder.encode(msgspec.structs.replace(msg, detokenizer_live_reqs=live))
        for box in self.outboxes:
            box.send(report, copy=False)

    def on_control_answer(self, msg: ControlAnswer, frame: zmq.Frame) -> None:
        """To the worker its control_id names, as it came (not ours to change)."""
        worker = worker_of(msg.control_id)
        if 0 <= worker < len(self.outboxes):
            self.outboxes[worker].send(frame, copy=False)
        else:
            self.inconsistent.warn(
                "dropped a control answer for API worker %d, which does not exist", worker
            )

    def send_parts(
        self, split: WorkerSplit[BatchStrOutput] | WorkerSplit[BatchEmbeddingOutput]
    ) -> None:
        """Each worker's part of a frame to that worker; rows of no worker are dropped with a
        warning."""
        for worker, part in split.parts:
            self.outboxes[worker].send(self.encoder.encode(part), copy=False)
        if split.stray:
            self.inconsistent.warn(
                "dropped %d output rows of API workers that do not exist (req_ids %s)",
                len(split.stray),
                split.stray[:5],
            )


def run_detokenizer(config: ServerConfig) -> None:
    shutdown = ShutdownFlag.install()
    ctx = zmq.Context()
    detokenizer = Detokenizer(config, ctx)
    report_ready(ctx, config, "detokenizer")
    while not shutdown.is_set():
        if detokenizer.inbox.poll(200):
            detokenizer.handle(detokenizer.inbox.recv(copy=False))
    ctx.destroy(linger=0)
