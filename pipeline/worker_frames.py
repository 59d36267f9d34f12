"""Splitting output frames by API worker (``tokenpipe serve --api-workers N``,
docs/design/processes.md): the detokenizer sends each worker one frame per step holding only
its rows.

A request's worker is in its ``req_id`` (``pipeline.worker_ids``). A part keeps its worker's
rows in their order, and every column is cut consistently with them, the logprob blocks' row
indices renumbered to the part's rows. The index arithmetic is numpy over the columns; only
the Python lists (text deltas, finish reasons, stats, token texts) are gathered entry by
entry, and only when a frame has rows of several workers. Rows whose worker does not exist
belong in no part (``WorkerSplit.stray``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np

from pipeline.frame_checks import count_token_rows, read_embedding_rows
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FrameLogprobs,
    InputLogprobs,
    OutputLogprobs,
    TokenTexts,
)
from pipeline.columns import from_column
from pipeline.worker_ids import WORKER_SHIFT
from pipeline.logprob_columns import (
    LOGPROB_ID_DTYPE,
    LogprobArrays,
    checked_logprobs,
    checked_prompt_logprobs,
)

Frame = TypeVar("Frame", BatchStrOutput, BatchEmbeddingOutput)
T = TypeVar("T")


def workers_of(req_ids: np.ndarray) -> np.ndarray:
    """``worker_of`` over a req_ids column (int64: an arithmetic shift, so a negative id
    gives a negative index, a worker that does not exist)."""
    return req_ids >> WORKER_SHIFT


class WorkerSplit(NamedTuple, Generic[Frame]):
    """A frame split by worker: one part per worker that has rows in it, in worker order,
    and the req_ids of the rows whose worker does not exist (an index >= the number of
    workers, or a negative req_id). A split returns those in ``stray`` rather than refusing
    the frame, so the caller warns about them and the other workers still get their rows (a
    refused frame would lose a step of every worker's requests, finished rows included)."""

    parts: list[tuple[int, Frame]]
    stray: list[int]


@dataclass(frozen=True, slots=True)
class _Route:
    """Which rows of a frame go to which worker."""

    workers: list[int]  # the workers that get a part, ascending
    picks: list[np.ndarray]  # per such worker: its frame rows, ascending
    owner: np.ndarray  # worker of each frame row
    local: np.ndarray  # each frame row's index in its worker's part (-1: stray)
    stray: list[int]


def _whole(req_ids: np.ndarray, workers: int) -> int | None:
    """The one worker every row belongs to, when there is one and it exists: the frame
    then goes on whole. One shift and one comparison over the column."""
    owner = workers_of(req_ids)
    if len(owner) and (owner == owner[0]).all() and 0 <= owner[0] < workers:
        return int(owner[0])
    return None


def _route(req_ids: np.ndarray, workers: int) -> _Route:
    owner = workers_of(req_ids)
    present = np.unique(owner).tolist()
    valid = [w for w in present if 0 <= w < workers]
    picks = [np.flatnonzero(owner == w) for w in valid]
    local = np.full(len(owner), -1, dtype=np.int64)
    for rows in picks:
        local[rows] = np.arange(len(rows))
    stray = req_ids[local < 0].tolist() if len(valid) < len(present) else []
    return _Route(valid, picks, owner, local, stray)


def _gather(column: Sequence[T] | None, rows: np.ndarray) -> list[T] | None:
    """The entries of ``rows`` of a nil-or-one-per-row list; None when none of them has one
    (a part keeps the frame's rule: one nil when no row has an entry)."""
    if column is None:
        return None
    part = [column[i] for i in rows.tolist()]
    return part if any(x is not None for x in part) else None


# --- token frames ----------------------------------------------------------------------


def split_str_output(frame: BatchStrOutput, workers: int) -> WorkerSplit[BatchStrOutput]:
    """One ``BatchStrOutput`` per worker with rows in ``frame``, holding exactly that
    worker's rows in their order; the req_ids of rows of no worker in ``stray``.

    When every row belongs to one existing worker (always, with one worker), its part is
    ``frame`` itself, unchecked and uncopied: its reader checks it, as without workers.
    Otherwise every column is checked first, logprob blocks and token texts included, and
    a disagreeing one raises ValueError with nothing split: a cut of columns that do not
    add up would hand rows each other's tokens and logprobs."""
    req_ids = from_column(frame.req_ids, REQ_ID_DTYPE)
    whole = _whole(req_ids, workers)
    if whole is not None:
        return WorkerSplit([(whole, frame)], [])
    n = count_token_rows(frame)
    counts = from_column(frame.output_counts, COUNT_DTYPE).astype(np.int64)
    tokens = from_column(frame.output_ids, TOKEN_DTYPE)
    if (len(counts) and counts.min() < 0) or int(counts.sum()) != len(tokens):
        raise ValueError(
            f"row counts sum to {int(counts.sum())} but the frame holds {len(tokens)} tokens"
        )
    lp = frame.logprobs
    output = (
        checked_logprobs(lp.output, counts) if lp is not None and lp.output is not None else None
    )
    prompt = (
        checked_prompt_logprobs(lp.input, n) if lp is not None and lp.input is not None else None
    )
    texts = _Texts.of(frame.token_texts) if frame.token_texts is not None else None
    route = _route(req_ids, workers)
    completion = from_column(frame.completion_tokens, COUNT_DTYPE)
    token_owner = np.repeat(route.owner, counts)  # the worker of each flat token
    # Texts are for the tokens of rows with output logprobs (their chosen tokens).
    listed = np.zeros(n, dtype=bool)
    if output is not None:
        listed[output.rows] = True
    listed_tokens = np.repeat(listed, counts)
    parts = []
    for w, rows in zip(route.workers, route.picks):
        mine = token_owner == w
        out = _output_part(output, w, route) if output is not None else None
        inp = _prompt_part(prompt, w, route) if prompt is not None else None
        part_texts = None
        if texts is not None and (out is not None or inp is not None):
            part_texts = texts.part(tokens[mine & listed_tokens], out, inp)
        part = BatchStrOutput(
            req_ids=req_ids[rows].tobytes(),
            text_deltas=[frame.text_deltas[i] for i in rows.tolist()],
            output_ids=tokens[mine].tobytes(),
            output_counts=counts[rows].astype(COUNT_DTYPE).tobytes(),
            completion_tokens=completion[rows].tobytes(),
            finished_reasons=_gather(frame.finished_reasons, rows),
            request_stats=_gather(frame.request_stats, rows),
            logprobs=FrameLogprobs(out, inp) if out is not None or inp is not None else None,
            token_texts=part_texts,
        )
        parts.append((w, part))
    return WorkerSplit(parts, route.stray)


def _cut(block: LogprobArrays, w: int, route: _Route) -> tuple[np.ndarray, OutputLogprobs] | None:
    """Which listed rows of ``block`` are worker ``w``'s (a bool each), and those rows as a
    block renumbered to its part's rows; None when none is."""
    keep = route.owner[block.rows] == w
    if not keep.any():
        return None
    return keep, block.select(keep, route.local[block.rows[keep]])


def _output_part(block: LogprobArrays, w: int, route: _Route) -> OutputLogprobs | None:
    cut = _cut(block, w, route)
    return None if cut is None else cut[1]


def _prompt_part(block: LogprobArrays, w: int, route: _Route) -> InputLogprobs | None:
    """A prompt block's part: its listed rows' ``tokens`` are their own counts."""
    cut = _cut(block, w, route)
    if cut is None:
        return None
    keep, logprobs = cut
    return InputLogprobs(counts=block.tokens[keep].astype(COUNT_DTYPE).tobytes(), logprobs=logprobs)


@dataclass(frozen=True, slots=True)
class _Texts:
    """A frame's ``TokenTexts``, checked: ids ascending, each once, one text each."""

    ids: np.ndarray
    texts: list[str]

    @staticmethod
    def of(texts: TokenTexts) -> _Texts:
        ids = from_column(texts.ids, LOGPROB_ID_DTYPE)
        if len(ids) != len(texts.texts):
            raise ValueError(f"token_texts has {len(ids)} ids and {len(texts.texts)} texts")
        return _Texts(ids, texts.texts)

    def part(
        self, chosen: np.ndarray, out: OutputLogprobs | None, inp: InputLogprobs | None
    ) -> TokenTexts | None:
        """The entries a part's logprob rows show: its listed rows' tokens and its top ids
        (output and prompt), as the detokenizer picked them for the whole frame. A subset
        of ascending unique ids stays ascending and unique: valid for ``TokenTextCache.add``."""
        wanted = [chosen]
        for block in (out, inp.logprobs if inp is not None else None):
            if block is not None:
                wanted.append(from_column(block.top_ids, LOGPROB_ID_DTYPE))
        hit = np.flatnonzero(np.isin(self.ids, np.concatenate(wanted)))
        if not len(hit):
            return None
        texts = self.texts
        return TokenTexts(ids=self.ids[hit].tobytes(), texts=[texts[i] for i in hit.tolist()])


# --- embedding frames ------------------------------------------------------------------


def split_embedding_output(
    frame: BatchEmbeddingOutput, workers: int
) -> WorkerSplit[BatchEmbeddingOutput]:
    """``split_str_output`` for an embedding frame: each part holds its worker's rows of
    the matrix, ``request_stats`` (one per row: every embedding row is finished) and
    ``finished_reasons``. A single-worker frame is returned itself; otherwise a frame whose
    shape, matrix or columns disagree raises ValueError."""
    req_ids = from_column(frame.req_ids, REQ_ID_DTYPE)
    whole = _whole(req_ids, workers)
    if whole is not None:
        return WorkerSplit([(whole, frame)], [])
    _, matrix = read_embedding_rows(frame)
    route = _route(req_ids, workers)
    parts = []
    for w, rows in zip(route.workers, route.picks):
        part = BatchEmbeddingOutput(
            req_ids=req_ids[rows].tobytes(),
            embeddings=matrix[rows].tobytes(),
            shape=(len(rows), frame.shape[1]),
            request_stats=[frame.request_stats[i] for i in rows.tolist()],
            finished_reasons=_gather(frame.finished_reasons, rows),
        )
        parts.append((w, part))
    return WorkerSplit(parts, route.stray)
