"""Wire columns: a 1-D sequence packed into little-endian ``bytes``, viewed back as an array,
and the flat token column cut into one list per row. The dtypes are the wire's
(``pipeline.io_struct``)."""

from __future__ import annotations

import numpy as np

from pipeline.io_struct import COUNT_DTYPE, TOKEN_DTYPE


def to_column(values: np.ndarray | list[int], dtype: np.dtype) -> bytes:
    """Pack a 1-D sequence into a wire column."""
    return np.asarray(values, dtype=dtype).tobytes()


def from_column(column: bytes, dtype: np.dtype) -> np.ndarray:
    """View a wire column as an array (zero copy; read-only)."""
    return np.frombuffer(column, dtype=dtype)


def split_token_rows(output_ids: bytes, output_counts: bytes) -> list[list[int]]:
    """The flat token column cut into one list per row; ValueError when the columns
    disagree (a frame from a buggy or hostile peer must not index out of range)."""
    tokens = from_column(output_ids, TOKEN_DTYPE)
    counts = from_column(output_counts, COUNT_DTYPE)
    if not len(counts):
        if len(tokens):
            raise ValueError(f"a frame with no rows holds {len(tokens)} tokens")
        return []
    if counts.min() < 0 or int(counts.sum()) != len(tokens):
        raise ValueError(
            f"row counts sum to {int(counts.sum())} but the frame holds {len(tokens)} tokens"
        )
    # The steady decode step: one token per row. Equal lengths alone do not say so: counts
    # [2, 0] also sum to two tokens over two rows (an abort's empty row beside a long one).
    if len(counts) == len(tokens) and counts.max() == 1:
        return [[t] for t in tokens.tolist()]
    return [part.tolist() for part in np.split(tokens, np.cumsum(counts)[:-1])]
