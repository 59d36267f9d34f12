"""The output-path benchmark's tokenpipe variant: the scheduler's real steady-step frame build
(``RunningBatch.due``, ``RunningBatch.take_steady`` and ``build_token_output``, as
``BatchDecoder.finish`` does), the real encoder of ``pipeline.sockets.make_encoder``, and the
detokenizer's real typed decoder plus reading the columns back as arrays."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from bench.output_path_steady import TOP_K, Timings, running_batch_of
from pipeline.columns import from_column
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    BatchTokenIDOutput,
    DetokenizerInput,
)
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE
from pipeline.sockets import FrameDecoder, make_encoder
from scheduler_proc.output_builder import build_token_output
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.sampling.logprobs import keep_decode_logprobs

logger = logging.getLogger("tokenpipe.bench.output_path")


def tokenpipe_variant(
    reqs: list[Req], stats_pending: StatsPending, logits: torch.Tensor | None = None
) -> Callable[[int], Timings]:
    """``stats_pending``: the requests' set. ``logits``: every request asked for logprobs;
    the step keeps them from these."""
    encoder = make_encoder()
    decoder: FrameDecoder[DetokenizerInput] = FrameDecoder(DetokenizerInput, logger, "bench frame")
    clock = time.perf_counter_ns
    batch = running_batch_of(reqs)
    none_finished = np.zeros(len(reqs), dtype=bool)

    def step(token: int) -> Timings:
        new = np.full(len(reqs), token, dtype=np.int64)
        batch.append_tokens(new)  # set-up, not timed
        if logits is not None:  # set-up, not timed: as BatchDecoder.finish keeps them
            keep_decode_logprobs(
                batch, logits, np.flatnonzero(batch.wants_logprobs[: len(batch)]), new
            )
        t0 = clock()
        steady = batch.take_steady(np.flatnonzero(batch.due(none_finished)))
        frame = build_token_output([], stats_pending, steady=steady)
        t1 = clock()
        data = encoder.encode(frame)
        t2 = clock()
        msg = decoder.decode(data)
        # Timed, as the detokenizer's own dispatch on the decoded type is.
        assert isinstance(msg, BatchTokenIDOutput)
        req_ids = from_column(msg.req_ids, REQ_ID_DTYPE)
        tokens = from_column(msg.output_ids, TOKEN_DTYPE)
        counts = from_column(msg.output_counts, COUNT_DTYPE)
        completion = from_column(msg.completion_tokens, COUNT_DTYPE)
        if logits is not None:
            assert (
                msg.logprobs is not None and msg.logprobs.output is not None
            )  # as a reader checks for them
            lp = msg.logprobs.output
            lp_rows = from_column(lp.rows, np.dtype("<i4"))
            chosen = from_column(lp.token_logprobs, LOGPROB_DTYPE)
            top_k = from_column(lp.top_k, np.dtype("<i4"))
            top_ids = from_column(lp.top_ids, LOGPROB_ID_DTYPE)
            top_values = from_column(lp.top_logprobs, LOGPROB_DTYPE)
            from_column(lp.ids_count, np.dtype("<i4"))
            from_column(lp.ids_logprobs, LOGPROB_DTYPE)
        t3 = clock()
        # Checks, not timed: a steady step, decoded intact.
        assert (
            msg.request_stats is None
            and msg.decode_options is None
            and msg.finished_reasons is None
        )
        assert len(req_ids) == len(tokens) == len(counts) == len(completion) == len(reqs)
        assert int(tokens[-1]) == token and int(counts.max()) == 1
        if logits is None:
            assert msg.logprobs is None
        else:
            assert (
                len(lp_rows) == len(chosen) == len(reqs)
                and int(top_k.min()) == int(top_k.max()) == TOP_K
            )
            assert (
                len(top_ids) == len(top_values) == TOP_K * len(reqs) and float(chosen.max()) <= 0.0
            )
        return t1 - t0, t2 - t1, t3 - t2, len(data)

    return step
