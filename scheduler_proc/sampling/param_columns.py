"""Where each field of ``SamplingParams`` goes on the scheduler's side, declared once.

``PARAM_COLUMNS``: the fields a running request keeps as a column of the running batch,
under the field's own name. ``RunningBatch`` allocates, fills, moves and grows them from this
table, and the sampler's ``SamplingColumns`` is built from its sampler columns on both paths
(the batch's slices, ``SamplingColumns.from_requests``). ``CARRIED_OTHERWISE``: every other
field, with where it goes. tests/unit/test_sampling_declaration.py holds each field to one of
the two, each neutral value to the wire's default, and each dialect's request body to the
fields it spells; docs/design/adding-a-sampling-parameter.md lists what stays by hand.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class ParamColumn:
    """A ``SamplingParams`` field kept per row of the running batch, as ``dtype``."""

    field: str
    dtype: type[np.generic]
    # The value that changes nothing (the sampler or the stop checks treat the row as if the
    # field did not exist): what a request that leaves the field out must get, so it equals
    # ``SamplingParams``' default. None: the field has no such value (a limit every request
    # has).
    neutral: float | int | bool | None
    sampler: bool  # read by the sampler (a field of SamplingColumns); else by the stop checks

    @property
    def fill(self) -> float | int | bool:
        """A fresh row's value before a request's is written."""
        return 0 if self.neutral is None else self.neutral


PARAM_COLUMNS: tuple[ParamColumn, ...] = (
    ParamColumn("max_new_tokens", np.int64, None, sampler=False),
    ParamColumn("min_new_tokens", np.int64, 0, sampler=False),
    ParamColumn("ignore_eos", np.bool_, False, sampler=False),
    ParamColumn("temperature", np.float32, 1.0, sampler=True),  # <= GREEDY_EPS: greedy
    ParamColumn("top_k", np.int64, -1, sampler=True),  # <= 0 or >= vocab: no cut
    ParamColumn("top_p", np.float32, 1.0, sampler=True),
    ParamColumn("min_p", np.float32, 0.0, sampler=True),
    ParamColumn("frequency_penalty", np.float32, 0.0, sampler=True),
    ParamColumn("presence_penalty", np.float32, 0.0, sampler=True),
    ParamColumn("repetition_penalty", np.float32, 1.0, sampler=True),
)

SAMPLER_COLUMNS: tuple[ParamColumn, ...] = tuple(c for c in PARAM_COLUMNS if c.sampler)

# The fields that are not a plain column of their own, and where each goes instead.
CARRIED_OTHERWISE: dict[str, str] = {
    "seed": "Req.seed (the request's, or one drawn for it): RunningBatch.seed, for the sampler",
    "stream_interval": "Req.stream_interval (the request's or the server's): RunningBatch.interval",
    "stop_token_ids": "RunningBatch.stop_ids and stop_count: a table as wide as the longest list",
    "stop": "RunningBatch.has_stop_strings; the strings are checked on the request (StopChecker)",
    "logit_bias": "RunningBatch.has_bias and its dense [rows, vocab] logit_bias table",
    "skip_special_tokens": "not in the batch: the detokenizer's",
    "no_stop_trim": "not in the batch: the detokenizer's",
    "thinking_budget": "RunningBatch.force_from while the end is not out (thinking_budget.py)",
    "thinking_end": "RunningBatch.think_last; the ids, forced, read on the request's sampling",
}


def uncarried_fields(fields: Iterable[str]) -> list[str]:
    """Those of ``fields`` (a ``SamplingParams``' field names) that neither a column nor
    ``CARRIED_OTHERWISE`` takes: a field declared on the wire that the scheduler drops."""
    carried = {c.field for c in PARAM_COLUMNS} | set(CARRIED_OTHERWISE)
    return [name for name in fields if name not in carried]
