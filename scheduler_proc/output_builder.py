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
from itertools import chain

import numpy as np

from pipeline.io_struct import (
    COUNT_DTYPE,
    EMBEDDING_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    DecodeOptions,
    FinishReason,
    RequestOutputStats,
    UsageColumns,
)
from scheduler_proc.req import PENDING_STATS, Req


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
    return UsageColumns(prompt_tokens=prompt, cached_tokens=cached, image_tokens=image, audio_tokens=audio, video_tokens=video)


def build_token_output(reqs: Sequence[Req], *, dense_usage: bool = False) -> BatchTokenIDOutput:
    """One row per request: the tokens generated since its last row.

    The stats, decode-option and finish columns are asked of each request only while some
    request has stats pending (``PENDING_STATS``): a first row, a finished row and a row
    after a stats change are all pending, so a steady decode step skips those calls.
    ``dense_usage`` adds ``UsageColumns`` on every row (``--dense-usage-columns``)."""
    n = len(reqs)
    outputs = [r.output_ids for r in reqs]
    completion = np.array([len(o) for o in outputs], dtype=COUNT_DTYPE)
    sent = np.array([r.num_sent_tokens for r in reqs], dtype=COUNT_DTYPE)
    counts = completion - sent
    if n and counts.min() == 1 and counts.max() == 1:
        tokens = np.array([o[-1] for o in outputs], dtype=TOKEN_DTYPE)
    else:
        tokens = np.fromiter(
            chain.from_iterable(o[k:] for o, k in zip(outputs, sent.tolist())), dtype=TOKEN_DTYPE, count=int(counts.sum())
        )
    for r, done in zip(reqs, completion.tolist()):
        r.num_sent_tokens = done

    stats: list[RequestOutputStats | None] | None = None
    options: list[DecodeOptions | None] | None = None
    finished: list[FinishReason | None] | None = None
    if PENDING_STATS:
        stats = [r.take_request_stats_due() for r in reqs]
        if stats.count(None) == n:
            stats = None
        else:
            # A request's first row always carries stats, so options ride on stats rows.
            options = [r.take_decode_options_due() if st is not None else None for r, st in zip(reqs, stats)]
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
    stats = [r.take_request_stats_due() for r in reqs]
    assert all(s is not None for s in stats), "an embedding row must be finished before it is built"
    matrix = np.ascontiguousarray(embeddings, dtype=EMBEDDING_DTYPE)
    finished = [r.finished_reason for r in reqs]
    return BatchEmbeddingOutput(
        req_ids=np.fromiter((r.req_id for r in reqs), dtype=REQ_ID_DTYPE, count=len(reqs)).tobytes(),
        embeddings=matrix.tobytes(),
        shape=(int(matrix.shape[0]), int(matrix.shape[1])),
        request_stats=stats,  # type: ignore[arg-type]
        finished_reasons=finished,
    )
