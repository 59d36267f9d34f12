"""Which token texts a frame's logprob entries show: the ids in the logprob columns of
the rows whose requests asked for texts (``DecodeOptions.logprob_texts``), found with
column operations over the whole frame."""

from __future__ import annotations

import numpy as np

from pipeline.io_struct import FrameLogprobs, OutputLogprobs
from pipeline.logprob_columns import LOGPROB_ID_DTYPE


def logprob_text_ids(
    logprobs: FrameLogprobs,
    output_ids: np.ndarray,
    output_counts: np.ndarray,
    shows_text: np.ndarray,
) -> np.ndarray:
    """The ids (with repeats) whose texts the frame's answers show. ``output_ids`` and
    ``output_counts`` are the frame's token columns; ``shows_text`` is a bool per frame row.
    The chosen output tokens and the top ids of the rows that show texts; a prompt's own
    tokens are not in the frame (the tokenizer manager has them). Raises ValueError when
    the columns disagree."""
    parts = [np.empty(0, dtype=LOGPROB_ID_DTYPE)]
    if logprobs.output is not None:
        rows = _rows(logprobs.output, len(shows_text))
        listed = np.zeros(len(shows_text), dtype=bool)
        listed[rows] = True
        parts.append(output_ids[np.repeat(listed & shows_text, output_counts)])
        parts.append(_top_ids(logprobs.output, rows, output_counts[rows], shows_text))
    if logprobs.input is not None:
        rows = _rows(logprobs.input.logprobs, len(shows_text))
        counts = np.frombuffer(logprobs.input.counts, dtype=np.int32)
        if len(counts) != len(rows):
            raise ValueError("prompt logprob columns do not match the frame's rows")
        parts.append(_top_ids(logprobs.input.logprobs, rows, counts, shows_text))
    return np.concatenate(parts)


def _rows(block: OutputLogprobs, num_rows: int) -> np.ndarray:
    rows = np.frombuffer(block.rows, dtype=np.int32)
    if len(rows) and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError("logprob columns name a row outside the frame")
    return rows


def _top_ids(
    block: OutputLogprobs, rows: np.ndarray, tokens: np.ndarray, shows_text: np.ndarray
) -> np.ndarray:
    """The top ids of the listed rows that show texts (the block holds ``tokens[i] *
    top_k[i]`` ids for listed row i, row after row)."""
    top_k = np.frombuffer(block.top_k, dtype=np.int32)
    top_ids = np.frombuffer(block.top_ids, dtype=LOGPROB_ID_DTYPE)
    if len(top_k) != len(rows) or (top_k < 0).any():
        raise ValueError("logprob columns do not match the frame's rows")
    sizes = tokens.astype(np.int64) * top_k
    if sizes.sum() != len(top_ids):
        raise ValueError("logprob columns do not match the frame's token counts")
    return top_ids[np.repeat(shows_text[rows], sizes)]
