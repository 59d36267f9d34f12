"""What a drafter does for the speculative step (``verify.py``): propose up to k tokens for
some running rows, then learn how many were accepted. ``ngram.py`` looks them up in the
row's own tokens; ``draft_model.py`` runs a smaller model with its own KV."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from pipeline.speculative_config import SpeculativeConfig
from scheduler_proc.batch.running_batch import RunningBatch


class Proposer(Protocol):
    def propose(
        self, batch: RunningBatch, rows: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for ``rows`` of ``batch`` (indices into its first ``len(batch)`` rows):
        int64 ``[len(rows), k]`` token ids and int64 ``[len(rows)]`` counts (0 to k; ids past
        a row's count are ignored). Row r's drafts continue its tokens
        ``batch.tokens[r, :batch.seq_len[r]]``; the batch is not changed."""

    def after_verify(
        self, req_ids: np.ndarray, drafted_at: np.ndarray, accepted: np.ndarray
    ) -> None:
        """After the verify pass of the rows ``propose`` was last given (or in its place, when
        their drafts go unverified): request ``req_ids[i]`` held ``drafted_at[i]`` tokens when
        its drafts were made, and its first ``accepted[i]`` drafts were accepted (its target
        then added one token of its own)."""


@dataclass(frozen=True, slots=True)
class Drafter:
    """Speculation's settings and the proposer they chose (``proposers.build_drafter``)."""

    config: SpeculativeConfig
    proposer: Proposer
