"""Speculative decoding's state of each running-batch row: the request's counts so far
(verify passes with drafts, draft tokens, accepted tokens; ``RequestOutputStats.spec_*``)
and what per-request adaptivity reads (the acceptance of its recent drafts, and how many
more steps it drafts nothing after that acceptance stayed low). Columns that follow the
batch's rows as ``PendingLogprobs``'s do; the request's stats take the counts when it
leaves the batch, so its finished row carries them."""

from __future__ import annotations

import numpy as np

from scheduler_proc.batch.pending_logprobs import grown
from scheduler_proc.req import Req

# Per-request adaptivity: after WINDOW draft tokens, a request whose drafts were accepted
# less than MIN_ACCEPTANCE of the time drafts nothing for its next BACKOFF steps (a draft
# rejected at once costs verify work for nothing); then it tries again.
WINDOW = 16
MIN_ACCEPTANCE = 0.25
BACKOFF = 16


class SpecRows:
    def __init__(self, cap: int) -> None:
        self.verify_ct = np.zeros(cap, dtype=np.int64)
        self.draft_tokens = np.zeros(cap, dtype=np.int64)
        self.accepted = np.zeros(cap, dtype=np.int64)
        self.window_drafted = np.zeros(cap, dtype=np.int64)
        self.window_accepted = np.zeros(cap, dtype=np.int64)
        self.skip = np.zeros(cap, dtype=np.int64)  # steps left without drafts

    _NAMES = ("verify_ct", "draft_tokens", "accepted", "window_drafted", "window_accepted", "skip")

    def columns(self) -> tuple[np.ndarray, ...]:
        return tuple(getattr(self, name) for name in self._NAMES)

    def grow(self, cap: int) -> None:
        for name in self._NAMES:
            setattr(self, name, grown(getattr(self, name), cap))

    def set_row(self, row: int, req: Req) -> None:
        stats = req.stats
        self.verify_ct[row] = stats.spec_verify_ct
        self.draft_tokens[row] = stats.spec_draft_tokens
        self.accepted[row] = stats.spec_accepted_tokens
        self.window_drafted[row] = self.window_accepted[row] = self.skip[row] = 0

    def hand_over(self, row: int, req: Req) -> None:
        """The row's counts become the request's stats (only when they changed: a change
        makes its next row carry stats)."""
        stats = req.stats
        verify_ct, drafted = int(self.verify_ct[row]), int(self.draft_tokens[row])
        if verify_ct != stats.spec_verify_ct or drafted != stats.spec_draft_tokens:
            req.update_stats(
                spec_verify_ct=verify_ct,
                spec_draft_tokens=drafted,
                spec_accepted_tokens=int(self.accepted[row]),
            )

    def drafting(self, n: int) -> np.ndarray:
        """The rows (of the first ``n``) that draft this step; the others count a step down."""
        skip = self.skip[:n]
        waiting = skip > 0
        skip[waiting] -= 1
        return np.flatnonzero(~waiting)

    def add(self, rows: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> None:
        """One verify pass: ``rows`` had ``drafted`` drafts each, ``accepted`` accepted."""
        had = drafted > 0
        self.verify_ct[rows] += had
        self.draft_tokens[rows] += drafted
        self.accepted[rows] += accepted
        self.window_drafted[rows] += drafted
        self.window_accepted[rows] += accepted
        full = rows[self.window_drafted[rows] >= WINDOW]
        if full.size:
            low = self.window_accepted[full] < MIN_ACCEPTANCE * self.window_drafted[full]
            self.skip[full[low]] = BACKOFF
            self.window_drafted[full] = 0
            self.window_accepted[full] = 0
