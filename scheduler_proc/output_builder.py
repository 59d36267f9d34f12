"""Builds the scheduler's output frames. Every output path (decode, the last chunk of a
prefill, a re-prefill after retraction, embeddings) goes through these functions, so every
row's stats are decided by ``Req.take_request_stats_due`` and nothing else.

Hot path: called once per step with every row that has output. Per-row work is one
attribute read or method call per column; the columns are packed with numpy.
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
    FinishReason,
)
from scheduler_proc.req import Req


def _none_if_all_none(values: list) -> list | None:  # type: ignore[type-arg]
    return values if any(v is not None for v in values) else None


def build_token_output(reqs: Sequence[Req]) -> BatchTokenIDOutput:
    """One row per request: the tokens generated since its last row."""
    n = len(reqs)
    req_ids = np.fromiter((r.req_id for r in reqs), dtype=REQ_ID_DTYPE, count=n)
    completion = np.fromiter((len(r.output_ids) for r in reqs), dtype=COUNT_DTYPE, count=n)
    sent = np.fromiter((r.num_sent_tokens for r in reqs), dtype=COUNT_DTYPE, count=n)
    counts = completion - sent
    if counts.max(initial=0) == 1 and counts.min(initial=1) == 1:
        tokens = np.fromiter((r.output_ids[-1] for r in reqs), dtype=TOKEN_DTYPE, count=n)
    else:
        tokens = np.fromiter(
            chain.from_iterable(r.output_ids[r.num_sent_tokens :] for r in reqs), dtype=TOKEN_DTYPE, count=int(counts.sum())
        )
    for r in reqs:
        r.num_sent_tokens = len(r.output_ids)
    finished: list[FinishReason | None] = [r.finished_reason for r in reqs]
    return BatchTokenIDOutput(
        req_ids=req_ids.tobytes(),
        output_ids=tokens.tobytes(),
        output_counts=counts.tobytes(),
        completion_tokens=completion.tobytes(),
        finished_reasons=_none_if_all_none(finished),
        request_stats=_none_if_all_none([r.take_request_stats_due() for r in reqs]),
        decode_options=_none_if_all_none([r.take_decode_options_due() for r in reqs]),
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
