"""The n-gram proposer (scheduler_proc/speculative/ngram.py) drafts what a plain reading of
vLLM's rule gives: the longest suffix of at most ``max_n`` tokens that occurs earlier (ending
before the last token), its earliest occurrence, and up to k tokens after it. A brute-force
reference checks random sequences over small vocabularies, where matches are common; the edge
cases are spelled out. The batch is a table with the two columns the proposer reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pipeline.io_struct import TOKEN_DTYPE
from scheduler_proc.speculative.ngram import NgramProposer
from scheduler_proc.speculative.proposer import Proposer

GARBAGE = 7  # what the table holds past a row's tokens: a token the sequences use too


@dataclass
class Rows:
    tokens: np.ndarray
    seq_len: np.ndarray


def rows_of(seqs: list[list[int]], width: int = 0) -> Rows:
    width = max(width, max(len(s) for s in seqs) + 4)
    tokens = np.full((len(seqs), width), GARBAGE, dtype=TOKEN_DTYPE)
    for r, seq in enumerate(seqs):
        tokens[r, : len(seq)] = seq
    return Rows(tokens, np.array([len(s) for s in seqs], dtype=np.int64))


def reference(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule, one n and one start at a time: longest n first, then the earliest start."""
    size = len(seq)
    for n in range(max_n, min_n - 1, -1):
        suffix = seq[size - n :]
        for start in range(size - n):  # the occurrence ends at start + n - 1 <= size - 2
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def drafted(proposer: NgramProposer, batch: Rows, rows: list[int], k: int) -> list[list[int]]:
    drafts, counts = proposer.propose(batch, np.array(rows, dtype=np.int64), k)
    assert drafts.dtype == np.int64 and counts.dtype == np.int64
    assert drafts.shape == (len(rows), k) and counts.shape == (len(rows),)
    for i, count in enumerate(counts):
        assert 0 <= count <= k
        assert not drafts[i, count:].any(), "ids past a row's count are 0"
    return [drafts[i, :count].tolist() for i, count in enumerate(counts)]


def test_drafts_equal_the_reference_on_random_sequences() -> None:
    rng = np.random.default_rng(42)
    for _ in range(600):
        vocab = int(rng.integers(2, 7))
        seqs = [
            rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
            for _ in range(int(rng.integers(1, 9)))
        ]
        batch = rows_of(seqs, width=int(rng.integers(0, 60)))
        width = batch.tokens.shape[1]
        for r, seq in enumerate(seqs):  # garbage past each row, from the same vocabulary
            batch.tokens[r, len(seq) :] = rng.integers(0, vocab, width - len(seq))
        min_n = int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        k = int(rng.integers(1, 7))
        rows = rng.permutation(len(seqs))[: int(rng.integers(1, len(seqs) + 1))].tolist()
        before = batch.tokens.copy()
        got = drafted(NgramProposer(min_n, max_n), batch, rows, k)
        assert got == [reference(seqs[r], min_n, max_n, k) for r in rows], (seqs, rows)
        assert np.array_equal(batch.tokens, before), "the batch is not changed"


def test_no_earlier_occurrence_drafts_nothing() -> None:
    assert drafted(NgramProposer(1, 3), rows_of([[1, 2, 3, 4, 5]]), [0], 4) == [[]]


def test_a_match_near_the_end_drafts_fewer_than_k() -> None:
    assert drafted(NgramProposer(1, 2), rows_of([[5, 6, 8, 5, 6]]), [0], 5) == [[8, 5, 6]]


def test_a_sequence_of_min_n_tokens_or_fewer_drafts_nothing() -> None:
    batch = rows_of([[4, 4], [4]])
    assert drafted(NgramProposer(2, 3), batch, [0, 1], 4) == [[], []]
    # One more token and the n-gram [4, 4] occurs earlier, overlapping the suffix.
    assert drafted(NgramProposer(2, 3), rows_of([[4, 4, 4]]), [0], 4) == [[4]]


def test_the_longest_n_wins_over_an_earlier_shorter_match() -> None:
    seq = [7, 0, 9, 1, 2, 7, 8, 1, 2, 7]  # [7] first occurs at 0, [1, 2, 7] at 3
    assert drafted(NgramProposer(1, 3), rows_of([seq]), [0], 2) == [[8, 1]]
    assert drafted(NgramProposer(1, 1), rows_of([seq]), [0], 2) == [[0, 9]]


def test_the_earliest_occurrence_is_followed() -> None:
    seq = [1, 2, 10, 3, 1, 2, 20, 1, 2]
    assert drafted(NgramProposer(2, 2), rows_of([seq]), [0], 3) == [[10, 3, 1]]


def test_a_repeated_pattern_continues_its_period() -> None:
    batch = rows_of([[1, 2, 3] * 10 + [1], [5] * 12])
    assert drafted(NgramProposer(1, 4), batch, [0, 1], 5) == [[2, 3, 1, 2, 3], [5] * 5]


def test_min_n_above_the_longest_match_drafts_nothing() -> None:
    seq = [1, 2, 3, 9, 2, 3]  # [2, 3] occurs earlier, [9, 2, 3] does not
    assert drafted(NgramProposer(3, 4), rows_of([seq]), [0], 4) == [[]]
    assert drafted(NgramProposer(2, 4), rows_of([seq]), [0], 4) == [[9, 2, 3]]


def test_rows_come_back_in_the_order_asked() -> None:
    batch = rows_of([[1, 5, 1], [2, 6, 2], [3, 7, 3], [9]])
    proposer = NgramProposer(1, 2)
    assert drafted(proposer, batch, [2, 0, 3], 2) == [[7, 3], [5, 1], []]
    assert drafted(proposer, batch, [], 2) == []


def test_tokens_past_a_row_are_not_read() -> None:
    # Row 0's last two tokens [G, G] occur only where the row ends and past it, in the
    # table's garbage; its last token alone occurs at 0. Row 1 makes the block wider.
    seq = [GARBAGE, 3, GARBAGE, GARBAGE]
    batch = rows_of([seq, [3] * 9])
    assert drafted(NgramProposer(1, 3), batch, [0, 1], 2) == [[3, GARBAGE], [3, 3]]


def test_long_rows_follow_the_earliest_longest_match_across_row_ends() -> None:
    # Rows of a few hundred tokens, few of them alike: the deeper steps go place by place
    # over a flat view of the block, where row 1's first tokens sit right after row 0's
    # last, 6. Row 1's [5, 6] at its start must not grow into [6, 5, 6] across that edge.
    row_0 = [*range(1000, 1300), 6]
    row_1 = [5, 6, 11, 12, 6, 5, 6, 13, 14, *range(2000, 2100), 6, 5, 6, 15, 16]
    row_1 += [*range(2100, 2200), 6, 5, 6]
    batch = rows_of([row_0, row_1])  # the block is as wide as row 0, the longer
    assert drafted(NgramProposer(1, 3), batch, [0, 1], 2) == [[], [13, 14]]


def test_k_of_zero_drafts_nothing() -> None:
    drafts, counts = NgramProposer(1, 3).propose(rows_of([[1, 1, 1]]), np.array([0]), 0)
    assert drafts.shape == (1, 0) and counts.tolist() == [0]


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 3), (3, 2)])
def test_sizes_out_of_order_are_refused(min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(min_n, max_n)


def test_after_verify_changes_nothing() -> None:
    proposer = NgramProposer(1, 3)
    conforms: Proposer = proposer  # mypy checks that it keeps the Protocol
    batch = rows_of([[1, 2, 1, 2]])
    first = drafted(proposer, batch, [0], 3)
    proposer.after_verify(np.array([0]), np.array([4]), np.array([0]))
    assert drafted(proposer, batch, [0], 3) == first == [[1, 2]]
    assert conforms is proposer
