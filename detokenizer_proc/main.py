"""The detokenizer process: turns each ``BatchTokenIDOutput`` into a ``BatchStrOutput``
(columns and ``request_stats`` passed through untouched) and forwards embedding frames
as they came. Under ``--skip-tokenizer-init`` it loads no tokenizer and keeps no
per-request state: every row passes on with its ids and an empty text delta.

With several API workers (``--api-workers``) each has its own socket, and each gets one
frame per scheduler step holding only its own rows (the worker index is in the high bits
of every req_id: ``pipeline.worker_frames``); a control answer goes to the worker its
control_id names, and the scheduler's stats reports go to all."""

from __future__ import annotations

import logging

import msgspec
import zmq

from pipeline.config import ServerConfig
from pipeline.frame_checks import count_token_rows, read_token_rows
from pipeline.io_struct import (
    COUNT_DTYPE,
    TOKEN_DTYPE,
    AbortResult,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerInput,
    FlushCacheResult,
    HiCacheStorageState,
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


def send_parts(
    outboxes: list[zmq.Socket[bytes]],
    split: WorkerSplit[BatchStrOutput] | WorkerSplit[BatchEmbeddingOutput],
    encoder: msgspec.msgpack.Encoder,
    warning: RateLimitedWarning,
) -> None:
    """Each worker's part of a frame to that worker; rows of no worker are dropped with a warning."""
    for worker, part in split.parts:
        outboxes[worker].send(encoder.encode(part), copy=False)
    if split.stray:
        warning.warn(
            "dropped %d output rows of API workers that do not exist (req_ids %s)",
            len(split.stray),
            split.stray[:5],
        )


def run_detokenizer(config: ServerConfig) -> None:
    shutdown = ShutdownFlag.install()
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model_path).tokenizer
    detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
    texts = None if tokenizer is None else TokenTextCache(tokenizer)
    ctx = zmq.Context()
    inbox = bind_pull(ctx, config.detokenizer_input)
    outboxes = [connect_push(ctx, config.tokenizer_endpoint(i)) for i in range(config.api_workers)]
    outbox = outboxes[0]
    several = len(outboxes) > 1
    decoder: FrameDecoder[DetokenizerInput] = FrameDecoder(
        DetokenizerInput, logger, "detokenizer input"
    )
    encoder = make_encoder()
    inconsistent = RateLimitedWarning(logger)
    report_ready(ctx, config, "detokenizer")

    while not shutdown.is_set():
        if not inbox.poll(200):
            continue
        frame = inbox.recv(copy=False)
        msg = decoder.decode(frame.buffer)
        if isinstance(msg, (HiCacheStorageState, FlushCacheResult, AbortResult)):
            worker = worker_of(msg.control_id)
            if 0 <= worker < len(outboxes):
                outboxes[worker].send(
                    frame, copy=False
                )  # not ours to change: forward the frame as it came
            else:
                inconsistent.warn(
                    "dropped a control answer for API worker %d, which does not exist", worker
                )
        elif isinstance(msg, BatchEmbeddingOutput):
            if not several:
                outbox.send(frame, copy=False)
                continue
            try:
                embedding_parts = split_embedding_output(msg, len(outboxes))
            except ValueError as exc:
                inconsistent.warn("dropped an inconsistent embedding frame: %s", exc)
                continue
            send_parts(outboxes, embedding_parts, encoder, inconsistent)
        elif isinstance(msg, SchedulerStatsReport):
            # Forwarded with this process's own count of live decode states, so /server_info
            # shows per-request state left behind here too (frames arrive in order, so every
            # row the scheduler sent before this report has been processed).
            live = detok.num_live if detok is not None else 0
            report = encoder.encode(msgspec.structs.replace(msg, detokenizer_live_reqs=live))
            for box in outboxes:
                box.send(report, copy=False)
        elif isinstance(msg, BatchTokenIDOutput):
            try:
                out = detokenize_frame(detok, msg, texts)
                if not several:
                    outbox.send(encoder.encode(out), copy=False)
                    continue
                str_parts = split_str_output(out, len(outboxes))
            except ValueError as exc:
                inconsistent.warn("dropped an inconsistent token frame: %s", exc)
                continue
            send_parts(outboxes, str_parts, encoder, inconsistent)
    ctx.destroy(linger=0)
