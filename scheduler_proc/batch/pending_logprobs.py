"""The output logprobs of the running batch's rows, as columns: what each row asks for (a
top-k, token ids) and the logprobs of its tokens not yet sent, a pending table ``[rows,
tokens, k]`` widened when a row needs more room. A steady decode step keeps and takes them
with one write and one gather per column, no per-row work.

Invariant: a request in the batch has its pending output logprobs in its row, none in
``Req.pending_logprobs``: they move into the row when it joins, and back to the request
(``hand_over``) when its row goes out the per-request way or it leaves.
"""

from __future__ import annotations

import numpy as np

from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE, LogprobBlock, TokenLogprobs
from scheduler_proc.req import Req

FIRST_PENDING = 4  # tokens of pending logprobs a row holds at first; doubled when one needs more

# The columns with one entry (or one block) per row, in the order a swap-remove moves them.
_COLUMNS = (
    "wants",
    "top_k_asked",
    "ids_asked",
    "ids_count",
    "count",
    "chosen",
    "top_ids",
    "top_values",
    "ids_values",
)


class PendingLogprobs:
    def __init__(self, cap: int) -> None:
        self.wants = np.zeros(cap, dtype=bool)  # the row asked for logprobs
        # int32 as on the wire, so the frame's columns need no conversion.
        self.top_k_asked = np.zeros(cap, dtype=np.int32)  # top_logprobs_num
        self.ids_asked = np.zeros((cap, 0), dtype=np.int64)  # token_ids_logprob, padded with 0
        self.ids_count = np.zeros(cap, dtype=np.int32)
        # Pending logprobs: of each row's first ``count`` unsent tokens, in order.
        self.count = np.zeros(cap, dtype=np.int64)
        self.chosen = np.zeros((cap, FIRST_PENDING), dtype=LOGPROB_DTYPE)
        self.top_ids = np.zeros((cap, FIRST_PENDING, 0), dtype=LOGPROB_ID_DTYPE)
        self.top_values = np.zeros((cap, FIRST_PENDING, 0), dtype=LOGPROB_DTYPE)
        self.ids_values = np.zeros((cap, FIRST_PENDING, 0), dtype=LOGPROB_DTYPE)

    def columns(self) -> tuple[np.ndarray, ...]:
        """Every per-row column (they are replaced when widened: fetch them each time)."""
        return tuple(getattr(self, name) for name in _COLUMNS)

    def grow(self, cap: int) -> None:
        """Room for ``cap`` rows, the present ones kept."""
        for name in _COLUMNS:
            setattr(self, name, grown(getattr(self, name), cap))

    def set_row(self, row: int, req: Req) -> None:
        """What the request asks, and its pending logprobs (a first token not sent yet,
        tokens left unsent at a retraction) moved into the row."""
        asked = req.logprob
        self.wants[row] = asked is not None
        self.count[row] = 0
        if asked is None:
            return
        ids = asked.token_ids_logprob
        self._widen(k=asked.top_logprobs_num, m=len(ids))
        self.top_k_asked[row] = asked.top_logprobs_num
        self.ids_count[row] = len(ids)
        self.ids_asked[row] = 0
        self.ids_asked[row, : len(ids)] = ids
        part = req.take_pending_logprobs()
        if part is not None:
            t, k, m = len(part.chosen), part.top_ids.shape[1], part.ids_values.shape[1]
            self._widen(t=t)
            self.chosen[row, :t] = part.chosen
            self.top_ids[row, :t, :k] = part.top_ids
            self.top_values[row, :t, :k] = part.top_values
            self.ids_values[row, :t, :m] = part.ids_values
            self.count[row] = t

    def _widen(self, *, t: int = 0, k: int = 0, m: int = 0) -> None:
        """Room for ``t`` pending tokens a row (doubling), ``k`` top entries and ``m``
        asked ids a token; the columns only grow."""
        have_t = self.chosen.shape[1]
        have_k = self.top_ids.shape[2]
        have_m = self.ids_values.shape[2]
        if t <= have_t and k <= have_k and m <= have_m:
            return
        new_t = max(have_t, 1) if t <= have_t else max(t, 2 * have_t)
        new_k, new_m = max(k, have_k), max(m, have_m)
        cap = len(self.count)
        for name, shape in (
            ("chosen", (cap, new_t)),
            ("top_ids", (cap, new_t, new_k)),
            ("top_values", (cap, new_t, new_k)),
            ("ids_values", (cap, new_t, new_m)),
            ("ids_asked", (cap, new_m)),
        ):
            old = getattr(self, name)
            new = np.zeros(shape, dtype=old.dtype)
            new[tuple(slice(0, d) for d in old.shape)] = old
            setattr(self, name, new)

    def shrink(self) -> None:
        """The pending table back to its first width: called when the batch empties, so
        that long unsent runs (non-streaming requests) give their room back."""
        if self.chosen.shape[1] <= FIRST_PENDING:
            return
        cap, k, m = len(self.count), self.top_ids.shape[2], self.ids_values.shape[2]
        self.chosen = np.zeros((cap, FIRST_PENDING), dtype=LOGPROB_DTYPE)
        self.top_ids = np.zeros((cap, FIRST_PENDING, k), dtype=LOGPROB_ID_DTYPE)
        self.top_values = np.zeros((cap, FIRST_PENDING, k), dtype=LOGPROB_DTYPE)
        self.ids_values = np.zeros((cap, FIRST_PENDING, m), dtype=LOGPROB_DTYPE)

    def hand_over(self, row: int, req: Req) -> None:
        """The row's pending logprobs go back to the request (``Req.pending_logprobs``)."""
        t = int(self.count[row])
        if not t:
            return
        k, m = int(self.top_k_asked[row]), int(self.ids_count[row])
        req.pending_logprobs.append(
            TokenLogprobs(
                self.chosen[row, :t].copy(),
                self.top_ids[row, :t, :k].copy(),
                self.top_values[row, :t, :k].copy(),
                self.ids_values[row, :t, :m].copy(),
            )
        )
        self.count[row] = 0

    def asks(self, rows: np.ndarray) -> tuple[int, np.ndarray]:
        """What these rows ask for: the largest top-k, and the asked ids (``[rows, m]``,
        padded with 0, m the most any of them asks)."""
        if not rows.size:
            return 0, self.ids_asked[rows, :0]
        most_ids = int(self.ids_count[rows].max())
        return int(self.top_k_asked[rows].max()), self.ids_asked[rows, :most_ids]

    def keep(
        self, rows: np.ndarray, step: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
    ) -> None:
        """One new token's logprobs for each of ``rows`` (chosen ``[r]``, top ids and values
        ``[r, k]``, ids values ``[r, m]``, as ``logprobs.batched_logprobs`` makes them),
        appended to their pending ones: one write per column."""
        chosen, top_ids, top_values, ids_values = step
        at = self.count[rows]
        if at.size and int(at.max()) >= self.chosen.shape[1]:
            self._widen(t=int(at.max()) + 1)
        k, m = top_ids.shape[1], ids_values.shape[1]
        self.chosen[rows, at] = chosen
        if k:
            self.top_ids[rows, at, :k] = top_ids
            self.top_values[rows, at, :k] = top_values
        if m:
            self.ids_values[rows, at, :m] = ids_values
        self.count[rows] = at + 1

    def take(self, rows: np.ndarray) -> LogprobBlock | None:
        """The pending logprobs of those of ``rows`` that have some, as frame columns (one
        gather per column), and marks them sent. Cold caches after the step's forward make
        each numpy call cost microseconds, so the common case (every row holds one token,
        no ids asked) takes the fewest."""
        counts = self.count[rows]
        most = int(counts.max()) if counts.size else 0
        if not most:
            return None
        held: np.ndarray  # positions among ``rows`` that hold entries
        if int(counts.min()):
            held, r = np.arange(len(rows), dtype=np.int32), rows
        else:  # rows that asked nothing (or hold nothing) carry no entry
            held = np.flatnonzero(counts)
            r, counts = rows[held], counts[held]
        self.count[r] = 0
        k, m = self.top_k_asked[r], self.ids_count[r]
        at: np.ndarray | int
        if most == 1:  # one token each (the steady case): column 0
            at, per_token, token_k, token_m = 0, r, k, m
        else:
            at = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
            per_token = np.repeat(r, counts)
            token_k, token_m = np.repeat(k, counts), np.repeat(m, counts)
        top_ids, top_values = _ragged(token_k, self.top_ids, self.top_values, per_token, at)
        if self.ids_values.shape[2]:
            ids_values = _ragged(token_m, self.ids_values, None, per_token, at)[0]
        else:  # no running request ever asked for ids
            ids_values = self.ids_values[:0, 0, :0].reshape(0)
        chosen = self.chosen[per_token, at]
        return LogprobBlock(held, chosen, k, top_ids, top_values, m, ids_values)


def _ragged(
    width: np.ndarray, a: np.ndarray, b: np.ndarray | None, rows: np.ndarray, at: np.ndarray | int
) -> tuple[np.ndarray, np.ndarray]:
    """The first ``width[i]`` entries of ``a[rows[i], at[i]]`` (and of ``b``'s), flat, row
    after row: one gather, then a mask only where widths differ."""
    most = int(width.max())
    block_a = a[rows, at, :most]
    block_b = b[rows, at, :most] if b is not None else block_a
    if int(width.min()) == most:
        return block_a.reshape(-1), block_b.reshape(-1)
    keep = np.arange(most) < width[:, None]
    return block_a[keep], block_b[keep]


def grown(old: np.ndarray, cap: int) -> np.ndarray:
    """``old`` with room for ``cap`` rows, its rows kept."""
    new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
    new[: len(old)] = old
    return new
