"""A frame's logprob columns (``OutputLogprobs``, docs/design/logprobs.md): laid out from each
row's logprobs by the scheduler, read back per row by the tokenizer manager (and, one row
of a PD KV header, by a decode server's scheduler)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.io_struct import InputLogprobs, OutputLogprobs

LOGPROB_DTYPE = np.dtype("<f4")
LOGPROB_ID_DTYPE = np.dtype("<i4")
RANK_DTYPE = np.dtype("<i4")


def no_ranks() -> np.ndarray:
    """The ranks of tokens that carry none (output tokens: no API shows their rank)."""
    return np.zeros(0, dtype=RANK_DTYPE)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The logprobs of consecutive tokens of one request, one entry per token. Prompt
    positions carry their tokens' ranks (vLLM's ``prompt_logprobs`` show them); output
    tokens none."""

    chosen: np.ndarray  # float32 [t]
    top_ids: np.ndarray  # int32 [t, k]
    top_values: np.ndarray  # float32 [t, k]
    ids_values: np.ndarray  # float32 [t, m]
    ranks: np.ndarray = field(default_factory=no_ranks)  # int32 [t], or [0]: none

    @staticmethod
    def join(parts: Sequence[TokenLogprobs]) -> TokenLogprobs:
        if len(parts) == 1:
            return parts[0]
        return TokenLogprobs(
            np.concatenate([p.chosen for p in parts]),
            np.concatenate([p.top_ids for p in parts]),
            np.concatenate([p.top_values for p in parts]),
            np.concatenate([p.ids_values for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


@dataclass(frozen=True, slots=True)
class LogprobBlock:
    """The output logprobs of some of a frame's rows as arrays (``OutputLogprobs`` before it
    is bytes): ``rows`` index those rows (ascending), ``top_k`` and ``ids_count`` are per
    row, ``chosen`` and ``ranks`` (a prompt block's; empty otherwise) per token, and the flat
    ``top_ids`` / ``top_values`` / ``ids_values`` blocks are laid out row by row, token by
    token, as on the wire."""

    rows: np.ndarray
    chosen: np.ndarray
    top_k: np.ndarray
    top_ids: np.ndarray
    top_values: np.ndarray
    ids_count: np.ndarray
    ids_values: np.ndarray
    ranks: np.ndarray = field(default_factory=no_ranks)

    @staticmethod
    def of_parts(rows: Sequence[int], parts: Sequence[TokenLogprobs]) -> LogprobBlock:
        """From per-request parts (the per-request rows' ``Req.take_pending_logprobs``)."""
        return LogprobBlock(
            rows=np.asarray(rows, dtype=np.int32),
            chosen=np.concatenate([p.chosen for p in parts]),
            top_k=np.array([p.top_ids.shape[1] for p in parts], dtype=np.int32),
            top_ids=np.concatenate([p.top_ids.reshape(-1) for p in parts]),
            top_values=np.concatenate([p.top_values.reshape(-1) for p in parts]),
            ids_count=np.array([p.ids_values.shape[1] for p in parts], dtype=np.int32),
            ids_values=np.concatenate([p.ids_values.reshape(-1) for p in parts]),
            ranks=np.concatenate([p.ranks for p in parts]),
        )

    def then(self, later: LogprobBlock, offset: int) -> LogprobBlock:
        """These rows, then ``later``'s, whose row indices start at ``offset``."""
        return LogprobBlock(
            *(
                np.concatenate((a, b))
                for a, b in zip(self._arrays(), later.shifted(offset)._arrays())
            )
        )

    def shifted(self, offset: int) -> LogprobBlock:
        if not offset:
            return self
        return LogprobBlock(self.rows + offset, *self._arrays()[1:])

    def _arrays(self) -> tuple[np.ndarray, ...]:
        return (
            self.rows,
            self.chosen,
            self.top_k,
            self.top_ids,
            self.top_values,
            self.ids_count,
            self.ids_values,
            self.ranks,
        )

    def columns(self) -> OutputLogprobs:
        return OutputLogprobs(
            rows=self.rows.astype(np.int32, copy=False).tobytes(),
            token_logprobs=self.chosen.astype(LOGPROB_DTYPE, copy=False).tobytes(),
            top_k=self.top_k.astype(np.int32, copy=False).tobytes(),
            top_ids=self.top_ids.astype(LOGPROB_ID_DTYPE, copy=False).tobytes(),
            top_logprobs=self.top_values.astype(LOGPROB_DTYPE, copy=False).tobytes(),
            ids_count=self.ids_count.astype(np.int32, copy=False).tobytes(),
            ids_logprobs=self.ids_values.astype(LOGPROB_DTYPE, copy=False).tobytes(),
            ranks=self.ranks.astype(RANK_DTYPE, copy=False).tobytes(),
        )


def build_output_logprobs(
    rows: Sequence[int], parts: Sequence[TokenLogprobs]
) -> OutputLogprobs | None:
    """The frame's logprob columns: ``rows`` are frame row indices (ascending), ``parts``
    each row's logprobs for exactly the tokens it carries."""
    return LogprobBlock.of_parts(rows, parts).columns() if rows else None


@dataclass(frozen=True, slots=True)
class RowLogprobs:
    """One frame row's logprobs read back from ``OutputLogprobs`` (the API's view)."""

    chosen: list[float]
    top: list[list[tuple[float, int]]]  # per token: (logprob, id), most likely first
    ids: list[list[float]]  # per token: one value per asked id
    ranks: list[int]  # per token (prompt positions); empty when the block carries none


def read_output_logprobs(lp: OutputLogprobs, counts: Sequence[int]) -> dict[int, RowLogprobs]:
    """Frame row index -> its logprobs; ``counts`` are the frame's output counts per row.
    Raises ValueError when the columns do not add up (a malformed frame). Each column
    becomes a list once, and the rows are slices of those lists (the API process reads
    every frame: no per-row numpy calls)."""
    block = checked_logprobs(lp, counts)
    chosen, top_ids, top_values, ids_values, ranks = (
        a.tolist()
        for a in (block.chosen, block.top_ids, block.top_values, block.ids_values, block.ranks)
    )
    out: dict[int, RowLogprobs] = {}
    c = t = v = 0
    for row, n, k, m in block.per_row():
        top = list(zip(top_values[t : t + n * k], top_ids[t : t + n * k]))
        out[row] = RowLogprobs(
            chosen=chosen[c : c + n],
            top=[top] if n == 1 else [top[j * k : (j + 1) * k] for j in range(n)],
            ids=[ids_values[v + j * m : v + (j + 1) * m] for j in range(n)],
            ranks=ranks[c : c + n],
        )
        c, t, v = c + n, t + n * k, v + n * m
    return out


def read_token_logprobs(lp: OutputLogprobs, counts: Sequence[int]) -> dict[int, TokenLogprobs]:
    """Frame row index -> its logprobs as arrays (views of the frame's bytes, read-only):
    the checked read that a PD decode server takes the prefill server's first-token
    logprobs with. Raises ValueError when the columns do not add up (a malformed frame)."""
    block = checked_logprobs(lp, counts)
    out: dict[int, TokenLogprobs] = {}
    c = t = v = 0
    for row, n, k, m in block.per_row():
        top = slice(t, t + n * k)
        out[row] = TokenLogprobs(
            block.chosen[c : c + n],
            block.top_ids[top].reshape(n, k),
            block.top_values[top].reshape(n, k),
            block.ids_values[v : v + n * m].reshape(n, m),
            block.ranks[c : c + n],
        )
        c, t, v = c + n, t + n * k, v + n * m
    return out


@dataclass(frozen=True, slots=True)
class LogprobArrays:
    """A logprob block's columns as arrays (views of the frame's bytes), checked against the
    frame's rows: ``rows`` are the listed frame rows, ``tokens`` / ``top_k`` / ``ids_count``
    are per listed row, and ``top_sizes`` / ``ids_sizes`` are the entries each listed row
    holds in the flat ``top_ids`` and ``ids_values`` columns (``chosen`` holds ``tokens``, and
    so does ``ranks`` unless it is empty)."""

    rows: np.ndarray  # int32
    tokens: np.ndarray  # int64
    top_k: np.ndarray
    ids_count: np.ndarray
    chosen: np.ndarray
    top_ids: np.ndarray
    top_values: np.ndarray
    ids_values: np.ndarray
    top_sizes: np.ndarray  # int64: tokens * top_k
    ids_sizes: np.ndarray  # int64: tokens * ids_count
    ranks: np.ndarray  # int32: one per token, or none

    def per_row(self) -> Iterator[tuple[int, int, int, int]]:
        """(frame row, tokens, k, m) of each listed row, in order."""
        return zip(
            self.rows.tolist(), self.tokens.tolist(), self.top_k.tolist(), self.ids_count.tolist()
        )

    def select(self, keep: np.ndarray, rows: np.ndarray) -> OutputLogprobs:
        """The ``keep`` listed rows (a bool each) as a block of their own, listed as ``rows``
        (e.g. renumbered to a part of the frame): each flat column keeps those rows'
        entries, found by repeating ``keep`` over each row's entries."""
        chosen, top, ids = (
            np.repeat(keep, size) for size in (self.tokens, self.top_sizes, self.ids_sizes)
        )
        return OutputLogprobs(
            rows=rows.astype(np.int32, copy=False).tobytes(),
            token_logprobs=self.chosen[chosen].tobytes(),
            top_k=self.top_k[keep].tobytes(),
            top_ids=self.top_ids[top].tobytes(),
            top_logprobs=self.top_values[top].tobytes(),
            ids_count=self.ids_count[keep].tobytes(),
            ids_logprobs=self.ids_values[ids].tobytes(),
            ranks=self.ranks[chosen].tobytes() if len(self.ranks) else b"",
        )


def checked_logprobs(lp: OutputLogprobs, counts: Sequence[int] | np.ndarray) -> LogprobArrays:
    """An output block's arrays; ``counts`` are the tokens of every frame row. Raises
    ValueError when the columns do not add up (a malformed frame)."""
    rows = _listed_rows(lp, len(counts))
    return _checked(lp, rows, np.asarray(counts, dtype=np.int64)[rows])


def checked_prompt_logprobs(lp: InputLogprobs, num_rows: int) -> LogprobArrays:
    """A prompt block's arrays: each listed row carries its own ``counts`` positions.
    Raises ValueError when the columns do not add up (a malformed frame)."""
    rows, counts = _prompt_rows(lp, num_rows)
    return _checked(lp.logprobs, rows, counts.astype(np.int64))


def _listed_rows(lp: OutputLogprobs, num_rows: int) -> np.ndarray:
    # Checked before anything is indexed by them: a hostile peer must not index out of range.
    rows = np.frombuffer(lp.rows, dtype=np.int32)
    if len(rows) and (rows.min() < 0 or rows.max() >= num_rows):
        raise ValueError("logprob columns name a row outside the frame")
    return rows


def _checked(lp: OutputLogprobs, rows: np.ndarray, tokens: np.ndarray) -> LogprobArrays:
    """``rows``: the listed rows (in range); ``tokens``: int64, the tokens of each."""
    top_k = np.frombuffer(lp.top_k, dtype=np.int32)
    ids_count = np.frombuffer(lp.ids_count, dtype=np.int32)
    if not len(rows) == len(top_k) == len(ids_count):
        raise ValueError("logprob columns do not match the frame's rows")
    if len(rows) and (top_k.min() < 0 or ids_count.min() < 0):
        raise ValueError("logprob columns give a negative top_k or ids_count")
    chosen = np.frombuffer(lp.token_logprobs, dtype=LOGPROB_DTYPE)
    top_ids = np.frombuffer(lp.top_ids, dtype=LOGPROB_ID_DTYPE)
    top_values = np.frombuffer(lp.top_logprobs, dtype=LOGPROB_DTYPE)
    ids_values = np.frombuffer(lp.ids_logprobs, dtype=LOGPROB_DTYPE)
    top_sizes, ids_sizes = tokens * top_k, tokens * ids_count
    if (
        len(chosen) != tokens.sum()
        or len(top_ids) != len(top_values)
        or len(top_ids) != top_sizes.sum()
    ):
        raise ValueError("logprob columns do not match the frame's token counts")
    if len(ids_values) != ids_sizes.sum():
        raise ValueError("token_ids_logprob columns do not match the frame's token counts")
    ranks = np.frombuffer(lp.ranks, dtype=RANK_DTYPE)
    if len(ranks) and len(ranks) != len(chosen):  # empty: a block without ranks
        raise ValueError("logprob rank column does not match the frame's token counts")
    return LogprobArrays(
        rows,
        tokens,
        top_k,
        ids_count,
        chosen,
        top_ids,
        top_values,
        ids_values,
        top_sizes,
        ids_sizes,
        ranks,
    )


def build_input_logprobs(
    rows: Sequence[int], parts: Sequence[TokenLogprobs]
) -> InputLogprobs | None:
    block = build_output_logprobs(rows, parts)
    if block is None:
        return None
    return InputLogprobs(
        counts=np.array([len(p.chosen) for p in parts], dtype=np.int32).tobytes(), logprobs=block
    )


def read_input_logprobs(lp: InputLogprobs, num_rows: int) -> dict[int, RowLogprobs]:
    """Frame row index -> its prompt logprobs. Raises ValueError on a malformed frame."""
    return read_output_logprobs(lp.logprobs, _prompt_counts(lp, num_rows))


def read_input_token_logprobs(lp: InputLogprobs, num_rows: int) -> dict[int, TokenLogprobs]:
    """Frame row index -> its prompt logprobs as arrays (``read_token_logprobs``'s view).
    Raises ValueError on a malformed frame."""
    return read_token_logprobs(lp.logprobs, _prompt_counts(lp, num_rows))


def _prompt_counts(lp: InputLogprobs, num_rows: int) -> list[int]:
    """The prompt positions of each frame row (0 for the rows not listed), the readers'
    ``counts``. A row listed twice (a malformed block) gets its last listing's count for
    both listings, as the readers always did; ``checked_prompt_logprobs`` (the worker
    split) sizes each listing by its own count, as the split always did."""
    per_row = [0] * num_rows
    for row, count in zip(*(a.tolist() for a in _prompt_rows(lp, num_rows))):
        per_row[row] = count
    return per_row


def _prompt_rows(lp: InputLogprobs, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A prompt block's listed rows and their positions (``counts``), checked."""
    rows = _listed_rows(lp.logprobs, num_rows)
    counts = np.frombuffer(lp.counts, dtype=np.int32)
    if len(counts) != len(rows) or (len(counts) and counts.min() < 0):
        raise ValueError("prompt logprob columns do not match the frame's rows")
    return rows, counts
