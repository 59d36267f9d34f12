"""Splitting output frames by API worker (``tokenpipe serve --api-workers N``, docs/design.md
section 2): the detokenizer sends each worker one frame per step holding only its rows.

A request's worker is in its ``req_id``: ``req_id >> WORKER_SHIFT`` is the index of the API
worker (tokenizer manager) that assigned it, and a control's ``control_id`` carries the index
the same way. A part keeps its worker's rows in their order, and every column is cut
consistently with them, the logprob blocks' row indices renumbered to the part's rows. The
index arithmetic is numpy over the columns; only the Python lists (text deltas, finish
reasons, stats, token texts) are gathered entry by entry, and only when a frame has rows of
several workers.

Rows whose worker does not exist (an index >= the number of workers, or a negative req_id)
belong in no part: a split returns their req_ids in ``stray`` rather than refusing the
frame, so the caller warns about them and the other workers still get their rows (a
refused frame would lose a step of every worker's requests, finished rows included).
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
    WORKER_SHIFT,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FrameLogprobs,
    InputLogprobs,
    OutputLogprobs,
    TokenTexts,
    from_column,
)
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE

Frame = TypeVar("Frame", BatchStrOutput, BatchEmbeddingOutput)
T = TypeVar("T")


def workers_of(req_ids: np.ndarray) -> np.ndarray:
    """``worker_of`` over a req_ids column (int64: an arithmetic shift, so a negative id
    gives a negative index, a worker that does not exist)."""
    return req_ids >> WORKER_SHIFT


class WorkerSplit(NamedTuple, Generic[Frame]):
    """A frame split by worker: one part per worker that has rows in it, in worker order,
    and the req_ids of the rows whose worker does not exist (dropped: the caller warns)."""

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


def _gather(column: Sequence[T | None] | None, rows: np.ndarray) -> list[T | None] | None:
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
        raise ValueError(f"row counts sum to {int(counts.sum())} but the frame holds {len(tokens)} tokens")
    lp = frame.logprobs
    output = _Block.output(lp.output, counts) if lp is not None and lp.output is not None else None
    prompt = _PromptBlock.of(lp.input, n) if lp is not None and lp.input is not None else None
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
        out = output.part(w, route) if output is not None else None
        inp = prompt.part(w, route) if prompt is not None else None
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


def _listed_rows(block: OutputLogprobs, num_rows: int) -> np.ndarray:
    rows = from_column(block.rows, COUNT_DTYPE)
    if len(rows) and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError("logprob columns name a row outside the frame")
    return rows


@dataclass(frozen=True, slots=True)
class _Block:
    """An ``OutputLogprobs`` block's columns, checked, with the entries each listed row
    holds in each flat column (tokens, tokens * top_k, tokens * ids_count)."""

    rows: np.ndarray  # listed frame rows
    top_k: np.ndarray
    ids_count: np.ndarray
    chosen: np.ndarray
    top_ids: np.ndarray
    top_values: np.ndarray
    ids_values: np.ndarray
    sizes: tuple[np.ndarray, np.ndarray, np.ndarray]

    @staticmethod
    def output(block: OutputLogprobs, counts: np.ndarray) -> _Block:
        """The output block: its rows carry the frame's ``counts`` tokens each."""
        rows = _listed_rows(block, len(counts))
        return _Block.of(block, rows, counts[rows])

    @staticmethod
    def of(block: OutputLogprobs, rows: np.ndarray, tokens: np.ndarray) -> _Block:
        """``rows``: the listed rows (checked); ``tokens``: int64, entries per listed row."""
        top_k = from_column(block.top_k, COUNT_DTYPE)
        ids_count = from_column(block.ids_count, COUNT_DTYPE)
        if not len(rows) == len(top_k) == len(ids_count):
            raise ValueError("logprob columns do not match the frame's rows")
        if len(rows) and (top_k.min() < 0 or ids_count.min() < 0):
            raise ValueError("logprob columns give a negative top_k or ids_count")
        lp = _Block(
            rows,
            top_k,
            ids_count,
            from_column(block.token_logprobs, LOGPROB_DTYPE),
            from_column(block.top_ids, LOGPROB_ID_DTYPE),
            from_column(block.top_logprobs, LOGPROB_DTYPE),
            from_column(block.ids_logprobs, LOGPROB_DTYPE),
            (tokens, tokens * top_k, tokens * ids_count),
        )
        held = (len(lp.chosen), len(lp.top_ids), len(lp.ids_values))
        if len(lp.top_values) != len(lp.top_ids) or any(int(s.sum()) != h for s, h in zip(lp.sizes, held)):
            raise ValueError("logprob columns do not match the frame's token counts")
        return lp

    def keep(self, w: int, route: _Route) -> np.ndarray | None:
        """Which listed rows are worker ``w``'s; None when none is."""
        keep = route.owner[self.rows] == w
        return keep if keep.any() else None

    def columns(self, keep: np.ndarray, route: _Route) -> OutputLogprobs:
        """The columns of the ``keep`` listed rows, renumbered to their part's rows: each
        flat column keeps the entries of those rows (an entry's row by ``np.repeat``)."""
        chosen, top, ids = (np.repeat(keep, size) for size in self.sizes)
        return OutputLogprobs(
            rows=route.local[self.rows[keep]].astype(COUNT_DTYPE).tobytes(),
            token_logprobs=self.chosen[chosen].tobytes(),
            top_k=self.top_k[keep].tobytes(),
            top_ids=self.top_ids[top].tobytes(),
            top_logprobs=self.top_values[top].tobytes(),
            ids_count=self.ids_count[keep].tobytes(),
            ids_logprobs=self.ids_values[ids].tobytes(),
        )

    def part(self, w: int, route: _Route) -> OutputLogprobs | None:
        keep = self.keep(w, route)
        return None if keep is None else self.columns(keep, route)


@dataclass(frozen=True, slots=True)
class _PromptBlock:
    """An ``InputLogprobs`` block: its rows carry their own ``counts`` positions each."""

    counts: np.ndarray
    block: _Block

    @staticmethod
    def of(lp: InputLogprobs, num_rows: int) -> _PromptBlock:
        rows = _listed_rows(lp.logprobs, num_rows)
        counts = from_column(lp.counts, COUNT_DTYPE)
        if len(counts) != len(rows) or (len(counts) and counts.min() < 0):
            raise ValueError("prompt logprob columns do not match the frame's rows")
        return _PromptBlock(counts, _Block.of(lp.logprobs, rows, counts.astype(np.int64)))

    def part(self, w: int, route: _Route) -> InputLogprobs | None:
        keep = self.block.keep(w, route)
        if keep is None:
            return None
        return InputLogprobs(counts=self.counts[keep].tobytes(), logprobs=self.block.columns(keep, route))


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

    def part(self, chosen: np.ndarray, out: OutputLogprobs | None, inp: InputLogprobs | None) -> TokenTexts | None:
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


def split_embedding_output(frame: BatchEmbeddingOutput, workers: int) -> WorkerSplit[BatchEmbeddingOutput]:
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
