"""The detokenizer process: turns each ``BatchTokenIDOutput`` into a ``BatchStrOutput``
(columns and ``request_stats`` passed through untouched) and forwards embedding frames
as they came. Under ``--skip-tokenizer-init`` it loads no tokenizer and keeps no
per-request state: every row passes on with its ids and an empty text delta."""

from __future__ import annotations

import logging

import msgspec
import zmq

from pipeline.config import ServerConfig
from pipeline.frame_checks import count_token_rows, read_token_rows
from pipeline.io_struct import (
    COUNT_DTYPE,
    TOKEN_DTYPE,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerInput,
    FlushCacheResult,
    HiCacheStorageState,
    SchedulerStatsReport,
    from_column,
)
from pipeline.process_util import ShutdownFlag, report_ready
from pipeline.sockets import FrameDecoder, RateLimitedWarning, bind_pull, connect_push, make_encoder
from pipeline.tokenizer_loader import load_tokenizer
from pipeline.token_texts import TokenTextCache
from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.logprob_texts import logprob_text_ids

logger = logging.getLogger("tokenpipe.detokenizer")


def detokenize_frame(detok: IncrementalDetokenizer | None, frame: BatchTokenIDOutput, texts: TokenTextCache | None = None) -> BatchStrOutput:
    """``detok`` None: --skip-tokenizer-init, the ids pass on without text. ``texts``: where
    the texts of logprob tokens come from, for the rows that show them. Raises ValueError
    when a column disagrees (the caller drops the frame)."""
    token_texts = None
    if detok is None:
        deltas = [""] * count_token_rows(frame)
    else:
        rows = read_token_rows(frame)
        if frame.logprobs is not None and texts is not None:
            shows = detok.shows_logprob_texts(rows.req_ids, frame.decode_options)
            if shows.any():
                ids = from_column(frame.output_ids, TOKEN_DTYPE)
                counts = from_column(frame.output_counts, COUNT_DTYPE)
                token_texts = texts.frame_texts(logprob_text_ids(frame.logprobs, ids, counts, shows))
        deltas = detok.process(rows.req_ids, rows.tokens, frame.finished_reasons, frame.decode_options)
    return BatchStrOutput(
        req_ids=frame.req_ids,
        text_deltas=deltas,
        output_ids=frame.output_ids,
        output_counts=frame.output_counts,
        completion_tokens=frame.completion_tokens,
        finished_reasons=frame.finished_reasons,
        request_stats=frame.request_stats,
        logprobs=frame.logprobs,
        token_texts=token_texts,
    )


def run_detokenizer(config: ServerConfig) -> None:
    shutdown = ShutdownFlag.install()
    tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model_path).tokenizer
    detok = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
    texts = None if tokenizer is None else TokenTextCache(tokenizer)
    ctx = zmq.Context()
    inbox = bind_pull(ctx, config.detokenizer_input)
    outbox = connect_push(ctx, config.tokenizer_input)
    decoder: FrameDecoder[DetokenizerInput] = FrameDecoder(DetokenizerInput, logger, "detokenizer input")
    encoder = make_encoder()
    inconsistent = RateLimitedWarning(logger)
    report_ready(ctx, config, "detokenizer")

    while not shutdown.is_set():
        if not inbox.poll(200):
            continue
        frame = inbox.recv(copy=False)
        msg = decoder.decode(frame.buffer)
        if isinstance(msg, (BatchEmbeddingOutput, HiCacheStorageState, FlushCacheResult)):
            outbox.send(frame, copy=False)  # not ours to change: forward the frame as it came
        elif isinstance(msg, SchedulerStatsReport):
            # Forwarded with this process's own count of live decode states, so /server_info
            # shows per-request state left behind here too (frames arrive in order, so every
            # row the scheduler sent before this report has been processed).
            live = detok.num_live if detok is not None else 0
            report = msgspec.structs.replace(msg, detokenizer_live_reqs=live)
            outbox.send(encoder.encode(report), copy=False)
        elif isinstance(msg, BatchTokenIDOutput):
            try:
                out = detokenize_frame(detok, msg, texts)
            except ValueError as exc:
                inconsistent.warn("dropped an inconsistent token frame: %s", exc)
                continue
            outbox.send(encoder.encode(out), copy=False)
    ctx.destroy(linger=0)
