"""Property tests of every column splitter and frame check: random row counts (zeros
included, next to multi-token rows), random column lengths, and the readers' answers
compared with a plain reference."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.main import detokenize_frame
from pipeline.frame_checks import read_embedding_rows, read_token_rows
from pipeline.io_struct import (
    COUNT_DTYPE,
    EMBEDDING_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    DecodeOptions,
    FinishLength,
    RequestOutputStats,
    UsageColumns,
)
from pipeline.columns import split_token_rows, to_column
from pipeline.tokenizer_loader import load_tokenizer

counts_lists = st.lists(st.integers(min_value=0, max_value=4), max_size=40)


def _reference_rows(counts: list[int]) -> list[list[int]]:
    """Row i holds the next counts[i] ids of 0, 1, 2, ... in order."""
    rows, next_id = [], 0
    for c in counts:
        rows.append(list(range(next_id, next_id + c)))
        next_id += c
    return rows


def _token_frame(
    counts: list[int], *, kind: type = BatchTokenIDOutput, **lists: object
) -> BatchTokenIDOutput | BatchStrOutput:
    n = len(counts)
    columns = dict(
        req_ids=to_column(range(100, 100 + n), REQ_ID_DTYPE),  # type: ignore[arg-type]
        output_ids=to_column(range(sum(counts)), TOKEN_DTYPE),  # type: ignore[arg-type]
        output_counts=to_column(counts, COUNT_DTYPE),
        completion_tokens=to_column(counts, COUNT_DTYPE),
    )
    if kind is BatchStrOutput:
        columns["text_deltas"] = lists.pop("text_deltas", [""] * n)
    return kind(**columns, **lists)  # type: ignore[no-any-return]


@given(counts_lists)
def test_split_token_rows_gives_each_row_its_own_tokens(counts: list[int]) -> None:
    ids = to_column(range(sum(counts)), TOKEN_DTYPE)  # type: ignore[arg-type]
    assert split_token_rows(ids, to_column(counts, COUNT_DTYPE)) == _reference_rows(counts)


def test_empty_rows_beside_a_two_token_row_keep_their_tokens() -> None:
    """The shortcut for one token per row once took [2, 0] for it (rows == tokens)."""
    assert split_token_rows(to_column([10, 11], TOKEN_DTYPE), to_column([2, 0], COUNT_DTYPE)) == [
        [10, 11],
        [],
    ]
    assert split_token_rows(
        to_column([10, 11, 12], TOKEN_DTYPE), to_column([0, 3, 0], COUNT_DTYPE)
    ) == [[], [10, 11, 12], []]


@given(counts_lists, st.integers(min_value=-3, max_value=3).filter(lambda d: d != 0))
def test_split_token_rows_refuses_counts_that_miss_the_token_column(
    counts: list[int], delta: int
) -> None:
    total = sum(counts) + delta
    if total < 0:
        return
    with pytest.raises(ValueError):
        split_token_rows(
            to_column(range(total), TOKEN_DTYPE),  # type: ignore[arg-type]
            to_column(counts, COUNT_DTYPE),
        )


def test_split_token_rows_refuses_negative_counts() -> None:
    with pytest.raises(ValueError):
        split_token_rows(to_column([1, 2], TOKEN_DTYPE), to_column([3, -1], COUNT_DTYPE))


@given(counts_lists, st.sampled_from([BatchTokenIDOutput, BatchStrOutput]), st.booleans())
def test_a_consistent_frame_reads_back_row_by_row(
    counts: list[int], kind: type, with_lists: bool
) -> None:
    n = len(counts)
    lists: dict[str, object] = {}
    if with_lists and n:
        lists = {
            "finished_reasons": [None] * (n - 1) + [FinishLength(length=1)],
            "request_stats": [RequestOutputStats()] + [None] * (n - 1),
        }
        if kind is BatchTokenIDOutput:
            lists["decode_options"] = [DecodeOptions()] * n
            zeros = to_column([0] * n, COUNT_DTYPE)
            lists["usage"] = UsageColumns(zeros, zeros, zeros, zeros, zeros)
    frame = _token_frame(counts, kind=kind, **lists)
    # Through the wire too: what a reader gets is what msgspec decodes.
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=kind)
    rows = read_token_rows(frame)
    assert rows.req_ids == list(range(100, 100 + n))
    assert rows.tokens == _reference_rows(counts)
    assert rows.completion_tokens == counts


_MISMATCHES = [
    "req_ids",
    "output_counts",
    "completion_tokens",
    "finished_reasons",
    "request_stats",
    "decode_options",
    "usage",
    "text_deltas",
]


@given(
    st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=12),
    st.sampled_from(_MISMATCHES),
    st.sampled_from([-1, 1]),
)
def test_a_column_of_the_wrong_length_refuses_the_whole_frame(
    counts: list[int], column: str, delta: int
) -> None:
    n = len(counts)
    wrong = n + delta
    kind: type = BatchStrOutput if column == "text_deltas" else BatchTokenIDOutput
    frame = _token_frame(counts, kind=kind)
    if column == "req_ids":
        frame.req_ids = to_column(range(wrong), REQ_ID_DTYPE)  # type: ignore[arg-type]
    elif column == "output_counts":
        # Counts that still sum to the token column, but for the wrong number of rows.
        frame.output_counts = to_column(
            counts + [0] if delta > 0 else ([sum(counts)] if n > 1 else []), COUNT_DTYPE
        )
        if n == 1 and delta < 0:
            frame.output_ids = b""
    elif column == "completion_tokens":
        frame.completion_tokens = to_column([1] * wrong, COUNT_DTYPE)
    elif column == "finished_reasons":
        frame.finished_reasons = [None] * wrong
    elif column == "request_stats":
        frame.request_stats = [None] * wrong
    elif column == "decode_options":
        frame.decode_options = [DecodeOptions()] * wrong  # type: ignore[union-attr]
    elif column == "usage":
        ok, bad = to_column([0] * n, COUNT_DTYPE), to_column([0] * wrong, COUNT_DTYPE)
        frame.usage = UsageColumns(ok, ok, bad, ok, ok)  # type: ignore[union-attr]
    else:
        frame.text_deltas = [""] * wrong  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        read_token_rows(frame)


def test_a_column_that_is_not_whole_values_is_refused() -> None:
    frame = _token_frame([1, 1])
    frame.completion_tokens = b"\x01\x00\x00"
    with pytest.raises(ValueError, match="completion_tokens"):
        read_token_rows(frame)


@settings(max_examples=50)
@given(
    st.integers(min_value=0, max_value=5),
    st.integers(min_value=0, max_value=4),
    st.sampled_from([None, "rows", "shape", "matrix", "stats", "finish"]),
)
def test_embedding_frames_are_checked(rows: int, dim: int, fault: str | None) -> None:
    matrix = np.arange(rows * dim, dtype=EMBEDDING_DTYPE).reshape(rows, dim)
    frame = BatchEmbeddingOutput(
        req_ids=to_column(range(rows), REQ_ID_DTYPE),  # type: ignore[arg-type]
        embeddings=matrix.tobytes(),
        shape=(rows, dim),
        request_stats=[RequestOutputStats()] * rows,
        finished_reasons=[None] * rows,
    )
    if fault == "rows":
        frame.req_ids = to_column(range(rows + 1), REQ_ID_DTYPE)  # type: ignore[arg-type]
    elif fault == "shape":
        frame.shape = (rows, dim + 1)
        if rows == 0:
            frame.shape = (1, dim)
    elif fault == "matrix":
        frame.embeddings += b"\x00\x00\x80\x3f"
    elif fault == "stats":
        frame.request_stats = [RequestOutputStats()] * (rows + 1)
    elif fault == "finish":
        frame.finished_reasons = [None] * (rows + 1)
    if fault is None:
        req_ids, got = read_embedding_rows(frame)
        assert req_ids == list(range(rows)) and np.array_equal(got, matrix)
    else:
        with pytest.raises(ValueError):
            read_embedding_rows(frame)


def test_detokenizer_refuses_a_frame_with_too_few_decode_options() -> None:
    """Two rows, one decode option: once an IndexError that ended the detokenizer process;
    now a ValueError its loop turns into a dropped frame, and its state is untouched."""
    detok = IncrementalDetokenizer(load_tokenizer(None).tokenizer)
    frame = _token_frame([1, 1], decode_options=[DecodeOptions()])
    with pytest.raises(ValueError, match="decode_options"):
        detokenize_frame(detok, frame)  # type: ignore[arg-type]
    assert detok.num_live == 0
