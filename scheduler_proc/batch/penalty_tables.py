"""The running batch's ``[rows, vocab]`` penalty state, made when the first request that
needs each table joins: how often each token was generated (frequency and presence
penalties), whether it occurs in the prompt or the output (repetition penalty), and the
dense logit bias. Rows follow ``RunningBatch``'s rows: set on a join, moved by its
swap-remove, grown with it."""

from __future__ import annotations

import numpy as np
import torch

from scheduler_proc.req import Req

_TABLES = ("output_counts", "seen", "logit_bias")


class PenaltyTables:
    def __init__(self, vocab_size: int) -> None:
        self._vocab_size = vocab_size
        self.output_counts: torch.Tensor | None = None  # float32: times each token was drawn
        self.seen: torch.Tensor | None = None  # bool: in the prompt or the output
        self.logit_bias: torch.Tensor | None = None  # float32, dense

    def _made(self, name: str, cap: int, dtype: torch.dtype) -> torch.Tensor:
        table = getattr(self, name)
        if table is None:
            table = torch.zeros((cap, self._vocab_size), dtype=dtype)
            setattr(self, name, table)
        return table

    def set_row(self, row: int, cap: int, req: Req, tokens: np.ndarray) -> None:
        """Row ``row`` (of a batch of ``cap`` rows) takes ``req``'s state; ``tokens``: its
        prompt then output."""
        s = req.sampling
        if s.frequency_penalty or s.presence_penalty:
            counts = np.bincount(req.output_ids, minlength=self._vocab_size)
            table = self._made("output_counts", cap, torch.float32)
            table[row] = torch.from_numpy(counts.astype(np.float32))
        elif self.output_counts is not None:
            self.output_counts[row] = 0
        if s.repetition_penalty != 1.0:
            seen = self._made("seen", cap, torch.bool)
            seen[row] = False
            seen[row, torch.from_numpy(tokens.astype(np.int64))] = True
        elif self.seen is not None:
            self.seen[row] = False
        if s.logit_bias:
            bias = self._made("logit_bias", cap, torch.float32)
            bias[row] = 0
            ids, values = zip(*s.logit_bias)
            bias[row, list(ids)] = torch.tensor(values, dtype=torch.float32)
        elif self.logit_bias is not None:
            self.logit_bias[row] = 0

    def move_row(self, to: int, source: int) -> None:
        for name in _TABLES:
            table = getattr(self, name)
            if table is not None:
                table[to] = table[source]

    def grow(self, cap: int) -> None:
        for name in _TABLES:
            old = getattr(self, name)
            if old is not None:
                new = old.new_zeros((cap, *old.shape[1:]))
                new[: len(old)] = old
                setattr(self, name, new)

    def append(self, rows: np.ndarray, new: np.ndarray) -> None:
        """Each of ``rows`` drew its token in ``new``."""
        if self.output_counts is None and self.seen is None:
            return
        index = (torch.from_numpy(rows), torch.from_numpy(new.astype(np.int64)))
        if self.output_counts is not None:
            self.output_counts.index_put_(index, torch.ones(len(rows)), accumulate=True)
        if self.seen is not None:
            self.seen[index] = True

    @staticmethod
    def rows_of(
        table: torch.Tensor | None, rows: slice | np.ndarray, used: bool
    ) -> torch.Tensor | None:
        """``rows`` of a table; None when no row uses it."""
        if table is None or not used:
            return None
        return table[rows] if isinstance(rows, slice) else table[torch.from_numpy(rows)]
