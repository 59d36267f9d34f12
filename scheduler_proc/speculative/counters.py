"""The scheduler's running totals of speculative decoding, as vLLM's spec_decode counters
count them; the stats report carries them (``SchedulerStatsReport.spec_*``)."""

from __future__ import annotations

import numpy as np


class SpecCounters:
    def __init__(self, k: int) -> None:
        self.k = k  # drafts per request per step, at most (0: speculation off)
        self.num_drafts = 0  # a request's drafts in one step count once
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = np.zeros(k, dtype=np.int64)  # index j: draft j+1 accepted

    def add(self, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """One verify pass: each drafting row's draft count and accepted count."""
        had = drafted > 0
        self.num_drafts += int(had.sum())
        self.num_draft_tokens += int(drafted.sum())
        self.num_accepted_tokens += int(accepted.sum())
        if self.k:
            self.accepted_per_pos += np.bincount(_positions(accepted), minlength=self.k)[: self.k]


def _positions(accepted: np.ndarray) -> np.ndarray:
    """The draft positions (0-based) of every accepted draft: a row that accepted a drafts
    accepted positions 0 .. a-1."""
    total = int(accepted.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(np.cumsum(accepted) - accepted, accepted)
    return np.arange(total) - starts
