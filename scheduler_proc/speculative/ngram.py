"""The n-gram (prompt lookup) proposer, as vLLM's ``ngram`` method and SGLang's ``NGRAM``:
a row's drafts are the tokens that followed an earlier occurrence of its last n tokens, the
longest n in ``[min_n, max_n]`` that occurs, looked up in its own prompt and output.

Cost: it runs every step for every drafting row, so the search is column work over the rows'
``[rows, longest seq_len]`` token block, one compare, AND and first-place ``argmax`` per n up
to ``max_n``; no Python per token. The proposer keeps no state between steps."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenRows(Protocol):
    """What the proposer reads of a batch (``RunningBatch`` has both): row r's tokens, prompt
    then output, are ``tokens[r, :seq_len[r]]``."""

    @property
    def tokens(self) -> np.ndarray: ...

    @property
    def seq_len(self) -> np.ndarray: ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(
                f"n-gram sizes must satisfy 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got min {min_n} and max {max_n}"
            )
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, batch: TokenRows, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for ``rows``: int64 ``[len(rows), k]`` ids (0 past a row's count) and int64
        ``[len(rows)]`` counts. A row's n-gram is its longest suffix of at most ``max_n``
        tokens that also ends earlier in its tokens (before its last token; the two may
        overlap); a row whose match is under ``min_n`` tokens drafts nothing. Of the
        occurrences, the earliest is followed, as vLLM's proposer does: the same drafts as the
        peer, the prompt (the text being quoted) before output that may have drifted from it,
        and the most tokens after the match, so the fewest drafts cut short by the sequence's
        end. Unlike vLLM's, k is not cut to the room left in the context: the caller knows
        that room."""
        rows = np.asarray(rows, dtype=np.int64)
        drafts = np.zeros((len(rows), max(k, 0)), dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int64)
        if not len(rows) or k <= 0:
            return drafts, counts
        lens = batch.seq_len[rows].astype(np.int64)
        width = int(lens.max())
        if width < self.min_n + 1:  # no row has an earlier place for an n-gram to occur
            return drafts, counts
        table = batch.tokens[rows, :width]
        length, end = _longest_matches(table, lens, self.max_n)
        found = length >= self.min_n
        start = end + 1  # the token that followed the occurrence
        counts[:] = np.where(found, np.minimum(k, lens - start), 0)
        offsets = np.arange(k)
        cols = np.minimum(start[:, None] + offsets, width - 1)
        taken = np.take_along_axis(table, cols, axis=1)
        drafts[:] = np.where(offsets < counts[:, None], taken, 0)
        return drafts, counts

    def after_verify(
        self, batch: TokenRows, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Nothing to learn: the next lookup reads the tokens the batch holds by then."""


def _longest_matches(
    table: np.ndarray, lens: np.ndarray, max_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the most of its last tokens (up to ``max_n``) that also occur ending before
    its last token, and the earliest place such an occurrence ends (0 and 0 when none).
    Step j compares every place with the j-th token from the end; ``alive`` keeps the
    places where all steps so far matched, so the deepest step with any alive place in a
    row gives its length, and that step's first alive place its end."""
    n_rows, width = table.shape
    ends = width - 1  # an occurrence ends before the row's last token
    alive = np.arange(ends, dtype=np.int32) < (lens - 1).astype(np.int32)[:, None]
    length = np.zeros(n_rows, dtype=np.int64)
    end = np.zeros(n_rows, dtype=np.int64)
    picks = np.arange(n_rows)
    for j in range(min(max_n, ends)):
        # A row of j tokens or fewer has no alive place at e >= j: any index will do.
        tail = table[picks, np.maximum(lens - 1 - j, 0)]
        if j:
            alive[:, j - 1] = False  # an occurrence ending there would start before token 0
        alive[:, j:] &= table[:, : ends - j] == tail[:, None]
        has = alive.any(axis=1)
        if not has.any():
            break
        length[has] = j + 1
        end[has] = alive.argmax(axis=1)[has]  # argmax takes the first: the earliest
    return length, end
