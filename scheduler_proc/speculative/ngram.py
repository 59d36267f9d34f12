"""The n-gram (prompt lookup) proposer, vLLM's ``ngram`` method (SGLang's ``NGRAM`` flag picks
it too, though SGLang's own searches a trie of earlier requests' tokens): a row's drafts are
the tokens that followed an earlier occurrence of its last n tokens, the longest n in
``[min_n, max_n]`` that occurs, looked up in its own prompt and output.

Cost: it runs every step for every drafting row, so the search is column work over the rows'
``[rows, longest seq_len]`` token block (a compare per n while many places match, then work
on the matching places only); no Python per token. The proposer keeps no state between steps."""

from __future__ import annotations

from typing import Protocol

import numpy as np


_FEW_ALIVE = 1 / 16  # share of the block's places alive under which steps go place by place


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
        self, req_ids: np.ndarray, drafted_at: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Nothing to learn: the next lookup reads the tokens the batch holds by then."""


def _longest_matches(
    table: np.ndarray, lens: np.ndarray, max_n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the most of its last tokens (up to ``max_n``) that also occur ending before
    its last token, and the earliest place such an occurrence ends (0 and 0 when none).
    Step j compares the places still alive (all steps so far matched) with the j-th token
    from the end, so the deepest step that leaves a row any place gives its length, and that
    step's first place its end. Steps compare the whole block while many places live (the
    first always does), then only the live places, so a long ``max_n`` costs little more."""
    n_rows, width = table.shape
    length = np.zeros(n_rows, dtype=np.int64)
    end = np.zeros(n_rows, dtype=np.int64)
    alive = np.arange(width - 1, dtype=np.int32) < (lens - 1).astype(np.int32)[:, None]
    steps = min(max_n, width - 1)
    j = 0
    while j < steps and np.count_nonzero(alive) > alive.size * _FEW_ALIVE:
        if j:
            alive[:, j - 1] = False  # an occurrence ending there would start before token 0
        # A row of j tokens or fewer has no place alive at e >= j: any index will do.
        tail = table[np.arange(n_rows), np.maximum(lens - 1 - j, 0)]
        alive[:, j:] &= table[:, : width - 1 - j] == tail[:, None]
        has = alive.any(axis=1)
        length[has] = j + 1
        end[has] = alive.argmax(axis=1)[has]  # argmax takes the first: the earliest
        j += 1
    if j < steps:
        _follow_live_places(table, lens, alive, range(j, steps), length, end)
    return length, end


def _follow_live_places(
    table: np.ndarray,
    lens: np.ndarray,
    alive: np.ndarray,
    steps: range,
    length: np.ndarray,
    end: np.ndarray,
) -> None:
    """``_longest_matches``' remaining steps over the few live places, as flat indices into
    the block (1-D gathers are the fast ones); ``row_at`` is each place's row's first index.
    Writes each row's deeper matches into ``length`` and ``end``."""
    width = table.shape[1]
    flat = table.reshape(-1)
    live = np.flatnonzero(alive)  # row by row, each row's places in order
    row = live // (width - 1)
    row_at = row * width
    place = live - row * (width - 1) + row_at
    last = lens[row] - 1 + row_at  # each place's row's last token
    for j in steps:
        if not len(place):
            return
        # A place under j would start before its row's first token.
        keep = (place - j >= row_at) & (flat[place - j] == flat[last - j])
        row_at, place, last = row_at[keep], place[keep], last[keep]
        first = np.ones(len(place), dtype=bool)  # each row's first place: its earliest
        first[1:] = row_at[1:] != row_at[:-1]
        rows = row_at[first] // width
        length[rows] = j + 1
        end[rows] = place[first] - row_at[first]
