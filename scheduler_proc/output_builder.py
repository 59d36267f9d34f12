"""Builds the scheduler's output frames. Every output path (decode, the last chunk of a
prefill, a re-prefill after retraction, embeddings) goes through these functions, so every
row's stats are decided by ``Req.take_request_stats_due`` and nothing else.

Hot path: called once per step with every row that has output. Per-row work is one
attribute read or method call per column; the columns are packed with numpy.

``--dense-usage-columns`` (``dense_usage=True``) adds ``UsageColumns`` to every token frame:
prompt, cached and media token counts on every row, read from each row's ``Req.stats`` (the
same object ``take_request_stats_due`` sends), for a consumer that keeps no per-request
state. Off, nothing of it runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from pipeline.io_struct import (
    COUNT_DTYPE,
    EMBEDDING_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    DecodeOptions,
    FrameLogprobs,
    FinishReason,
    RequestOutputStats,
    UsageColumns,
)
from pipeline.logprob_columns import LogprobBlock, build_input_logprobs
from scheduler_proc.req import Req, StatsPending


def build_usage_columns(reqs: Sequence[Req]) -> UsageColumns:
    """The dense usage columns of these rows, read from each ``Req.stats`` (the current
    stats, whether or not this row's stats are due): one ``Req.stats`` read and five plain
    attribute reads of the frozen stats per row, then one numpy conversion."""
    stats = [r.stats for r in reqs]
    matrix = np.array(
        [
            [s.prompt_tokens for s in stats],
            [s.cached_tokens for s in stats],
            [s.image_tokens for s in stats],
            [s.audio_tokens for s in stats],
            [s.video_tokens for s in stats],
        ],
        dtype=COUNT_DTYPE,
    ).reshape(5, len(stats))
    prompt, cached, image, audio, video = (column.tobytes() for column in matrix)
    return UsageColumns(
        prompt_tokens=prompt,
        cached_tokens=cached,
        image_tokens=image,
        audio_tokens=audio,
        video_tokens=video,
    )


@dataclass(frozen=True, slots=True)
class SteadyRows:
    """Rows of a decode step that had no event (the running batch's columns): no stats,
    no finish, no decode options, so only ids and tokens go out. ``reqs`` holds their
    requests for ``--dense-usage-columns`` only (else it is empty)."""

    req_ids: np.ndarray
    tokens: np.ndarray
    counts: np.ndarray
    completion: np.ndarray
    reqs: list[Req]
    # The logprobs of the rows that carry some (rows: indices among these rows).
    logprobs: LogprobBlock | None = None

    def __len__(self) -> int:
        return len(self.req_ids)


def build_token_output(
    reqs: Sequence[Req],
    stats_pending: StatsPending,
    *,
    steady: SteadyRows | None = None,
    dense_usage: bool = False,
) -> BatchTokenIDOutput:
    """One row per request: the tokens generated since its last row; the ``steady`` rows
    (already columns) follow the ``reqs`` rows.

    The stats, decode-option and finish columns are asked of each request only while some
    request of their scheduler has stats pending (``stats_pending``, the set the requests
    were built with): a first row, a finished row and a row after a stats change are all
    pending, so a steady decode step skips those calls.
    ``dense_usage`` adds ``UsageColumns`` on every row (``--dense-usage-columns``)."""
    # Logprobs first: taking them is what marks them sent, whichever rows exist.
    logprobs = [
        (i, part)
        for i, part in (
            (i, r.take_pending_logprobs()) for i, r in enumerate(reqs) if r.pending_logprobs
        )
        if part
    ]
    if steady is None or not len(steady):
        frame = _build_request_rows(reqs, stats_pending, dense_usage)
    elif not reqs:
        frame = _steady_frame(steady, dense_usage)
    else:
        frame = _concat(
            _build_request_rows(reqs, stats_pending, dense_usage),
            _steady_frame(steady, dense_usage),
        )
    block = (
        LogprobBlock.of_parts([i for i, _ in logprobs], [part for _, part in logprobs])
        if logprobs
        else None
    )
    if steady is not None and steady.logprobs is not None:
        block = (
            steady.logprobs.shifted(len(reqs))
            if block is None
            else block.then(steady.logprobs, len(reqs))
        )
    # A request's first row is always a per-request row (its stats are due).
    prompt = [
        (i, part)
        for i, part in (
            (i, r.take_prompt_logprobs()) for i, r in enumerate(reqs) if r.prompt_logprobs
        )
        if part
    ]
    if block is not None or prompt:
        frame.logprobs = FrameLogprobs(
            output=block.columns() if block is not None else None,
            input=build_input_logprobs([i for i, _ in prompt], [part for _, part in prompt]),
        )
    return frame


def _steady_frame(steady: SteadyRows, dense_usage: bool) -> BatchTokenIDOutput:
    return BatchTokenIDOutput(
        req_ids=steady.req_ids.astype(REQ_ID_DTYPE, copy=False).tobytes(),
        output_ids=steady.tokens.astype(TOKEN_DTYPE, copy=False).tobytes(),
        output_counts=steady.counts.astype(COUNT_DTYPE).tobytes(),
        completion_tokens=steady.completion.astype(COUNT_DTYPE).tobytes(),
        usage=build_usage_columns(steady.reqs) if dense_usage else None,
    )


def _concat(first: BatchTokenIDOutput, second: BatchTokenIDOutput) -> BatchTokenIDOutput:
    """``first``'s rows then ``second``'s (whose per-row lists are all None)."""
    n = len(second.req_ids) // REQ_ID_DTYPE.itemsize

    def pad(column: list[Any] | None) -> list[Any] | None:
        return None if column is None else column + [None] * n

    usage = None
    if first.usage is not None and second.usage is not None:
        usage = UsageColumns(
            **{
                f: getattr(first.usage, f) + getattr(second.usage, f)
                for f in UsageColumns.__struct_fields__
            }
        )
    return BatchTokenIDOutput(
        req_ids=first.req_ids + second.req_ids,
        output_ids=first.output_ids + second.output_ids,
        output_counts=first.output_counts + second.output_counts,
        completion_tokens=first.completion_tokens + second.completion_tokens,
        finished_reasons=pad(first.finished_reasons),
        request_stats=pad(first.request_stats),
        decode_options=pad(first.decode_options),
        usage=usage,
    )


def _build_request_rows(
    reqs: Sequence[Req], stats_pending: StatsPending, dense_usage: bool
) -> BatchTokenIDOutput:
    n = len(reqs)
    outputs = [r.output_ids for r in reqs]
    completion = np.array([len(o) for o in outputs], dtype=COUNT_DTYPE)
    sent = np.array([r.num_sent_tokens for r in reqs], dtype=COUNT_DTYPE)
    counts = completion - sent
    if n and counts.min() == 1 and counts.max() == 1:
        tokens = np.array([o[-1] for o in outputs], dtype=TOKEN_DTYPE)
    else:
        tokens = np.fromiter(
            chain.from_iterable(o[k:] for o, k in zip(outputs, sent.tolist())),
            dtype=TOKEN_DTYPE,
            count=int(counts.sum()),
        )
    for r, done in zip(reqs, completion.tolist()):
        r.num_sent_tokens = done

    stats: list[RequestOutputStats | None] | None = None
    options: list[DecodeOptions | None] | None = None
    finished: list[FinishReason | None] | None = None
    if stats_pending:
        stats = [r.take_request_stats_due() for r in reqs]
        if stats.count(None) == n:
            stats = None
        else:
            # A request's first row always carries stats, so options ride on stats rows.
            options = [
                r.take_decode_options_due() if st is not None else None
                for r, st in zip(reqs, stats)
            ]
            if options.count(None) == n:
                options = None
            finished = [r.finished_reason for r in reqs]
            if finished.count(None) == n:
                finished = None
    return BatchTokenIDOutput(
        req_ids=np.array([r.req_id for r in reqs], dtype=REQ_ID_DTYPE).tobytes(),
        output_ids=tokens.tobytes(),
        output_counts=counts.tobytes(),
        completion_tokens=completion.tobytes(),
        finished_reasons=finished,
        request_stats=stats,
        decode_options=options,
        usage=build_usage_columns(reqs) if dense_usage else None,
    )


def build_embedding_output(reqs: Sequence[Req], embeddings: np.ndarray) -> BatchEmbeddingOutput:
    """Every embedding row is finished, so ``take_request_stats_due`` returns stats for
    each one; the assertion pins that contract rather than assuming it."""
    stats = [s for s in (r.take_request_stats_due() for r in reqs) if s is not None]
    assert len(stats) == len(reqs), "an embedding row must be finished before it is built"
    matrix = np.ascontiguousarray(embeddings, dtype=EMBEDDING_DTYPE)
    finished = [r.finished_reason for r in reqs]
    return BatchEmbeddingOutput(
        req_ids=np.fromiter(
            (r.req_id for r in reqs), dtype=REQ_ID_DTYPE, count=len(reqs)
        ).tobytes(),
        embeddings=matrix.tobytes(),
        shape=(int(matrix.shape[0]), int(matrix.shape[1])),
        request_stats=stats,
        finished_reasons=finished,
    )
