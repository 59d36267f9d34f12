"""Reading an output frame's columns, checked: every process that reads a frame goes
through these, so a frame whose columns disagree in length (a buggy or hostile peer) is
refused whole with a ValueError naming the column, before any row is touched. The reader
drops it with a warning and goes on (``FrameDecoder`` already drops what does not decode).

Cost: a length comparison per column; the columns themselves are viewed, not copied,
until they are turned into the per-row lists the reader needs anyway.
"""

from __future__ import annotations

from collections.abc import Sized
from dataclasses import dataclass

import numpy as np

from pipeline.io_struct import (
    COUNT_DTYPE,
    EMBEDDING_DTYPE,
    REQ_ID_DTYPE,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
)
from pipeline.columns import from_column, split_token_rows


@dataclass(frozen=True, slots=True)
class TokenRows:
    """A token frame's per-row columns, one entry per row each."""

    req_ids: list[int]
    tokens: list[list[int]]  # the new token ids of each row (possibly none)
    completion_tokens: list[int]


def _column(frame: object, name: str, dtype: np.dtype) -> np.ndarray:
    try:
        return from_column(getattr(frame, name), dtype)
    except ValueError as exc:  # a byte length that is not a whole number of values
        raise ValueError(f"column {name}: {exc}") from None


def _expect_rows(name: str, column: Sized | None, n: int) -> None:
    if column is not None and len(column) != n:
        raise ValueError(f"column {name} has {len(column)} entries for {n} rows")


def read_token_rows(frame: BatchTokenIDOutput | BatchStrOutput) -> TokenRows:
    """The rows of a ``BatchTokenIDOutput`` or ``BatchStrOutput``; ValueError when any
    column's length disagrees with the number of ``req_ids``."""
    req_ids = _column(frame, "req_ids", REQ_ID_DTYPE)
    _check_row_columns(frame, len(req_ids))
    completion = _column(frame, "completion_tokens", COUNT_DTYPE)
    tokens = split_token_rows(frame.output_ids, frame.output_counts)
    return TokenRows(req_ids=req_ids.tolist(), tokens=tokens, completion_tokens=completion.tolist())


def count_token_rows(frame: BatchTokenIDOutput | BatchStrOutput) -> int:
    """The number of rows of a token frame whose rows are passed on unread (the detokenizer
    under ``--skip-tokenizer-init``), with every per-row column checked against it as
    ``read_token_rows`` does; the flat token column is checked where the rows are read."""
    n = len(_column(frame, "req_ids", REQ_ID_DTYPE))
    _check_row_columns(frame, n)
    return n


def _check_row_columns(frame: BatchTokenIDOutput | BatchStrOutput, n: int) -> None:
    counts = _column(frame, "output_counts", COUNT_DTYPE)
    _expect_rows("output_counts", counts, n)
    completion = _column(frame, "completion_tokens", COUNT_DTYPE)
    _expect_rows("completion_tokens", completion, n)
    _expect_rows("finished_reasons", frame.finished_reasons, n)
    _expect_rows("request_stats", frame.request_stats, n)
    if isinstance(frame, BatchStrOutput):
        _expect_rows("text_deltas", frame.text_deltas, n)
    else:
        _expect_rows("decode_options", frame.decode_options, n)
        if frame.usage is not None:
            for name in frame.usage.__struct_fields__:
                _expect_rows(f"usage.{name}", _column(frame.usage, name, COUNT_DTYPE), n)


def read_embedding_rows(frame: BatchEmbeddingOutput) -> tuple[list[int], np.ndarray]:
    """The req_ids and the [rows, dim] matrix of an embedding frame; ValueError when the
    shape, the matrix or a column disagrees with the number of ``req_ids``."""
    req_ids = _column(frame, "req_ids", REQ_ID_DTYPE)
    rows, dim = frame.shape
    if rows != len(req_ids) or dim < 0:
        raise ValueError(
            f"embedding frame of shape {frame.shape} disagrees with its {len(req_ids)} req_ids"
        )
    _expect_rows("request_stats", frame.request_stats, rows)
    _expect_rows("finished_reasons", frame.finished_reasons, rows)
    matrix = _column(frame, "embeddings", EMBEDDING_DTYPE)
    if matrix.size != rows * dim:
        raise ValueError(f"column embeddings holds {matrix.size} values for shape {frame.shape}")
    return req_ids.tolist(), matrix.reshape(rows, dim)
