"""Thinking budgets (docs/design/sampling.md#thinking-budget), as SGLang's
ThinkingBudgetLogitProcessor and vLLM's thinking-token budget: a request with
``thinking_budget`` k whose output holds k tokens or more, and not yet the ``thinking_end``
ids, takes those ids next, in order (output positions k, k+1, ...). Once the end is in the
output (forced or the model's), nothing is forced. A row whose grammar applies (a matcher) is
never forced: its grammar decides every token.

Every answer here is a function of the output ids (the end found as the reasoning gate finds
``reasoning_end``), never of a counter, so a retracted, re-prefilled or PD-handed request
forces exactly the tokens it would have forced without that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pipeline.io_struct import SamplingParams
from scheduler_proc.sampling.reasoning_gate import after_end
from scheduler_proc.sampling.sampler import ForcedTokens

# A row's forcing start when it has no open budget: an output never reaches it.
NEVER = np.iinfo(np.int64).max


def budget_open(sampling: SamplingParams, output_ids: Sequence[int]) -> bool:
    """Whether the request has a budget whose end is not yet in ``output_ids``."""
    end = sampling.thinking_end
    if sampling.thinking_budget is None or not end:
        return False
    return after_end(output_ids, end) is None


def forced_id(sampling: SamplingParams, output_len: int) -> int | None:
    """The id forced as output token ``output_len`` of a request whose budget is open: its
    end's id at ``output_len - thinking_budget``; None before the budget is spent (and past
    the end's last id, which an open budget never reaches: the end is then in the output)."""
    budget, end = sampling.thinking_budget, sampling.thinking_end
    if budget is None or not budget <= output_len < budget + len(end):
        return None
    return end[output_len - budget]


def forced_rows(
    params: Sequence[SamplingParams], rows: Sequence[int], out_lens: Sequence[int]
) -> ForcedTokens | None:
    """The forced tokens of draws whose budget is open: row ``rows[i]`` draws output token
    ``out_lens[i]`` under ``params[i]``. None when no token is forced."""
    pairs = [(row, forced_id(s, n)) for s, row, n in zip(params, rows, out_lens)]
    forced = [(row, token) for row, token in pairs if token is not None]
    if not forced:
        return None
    table = np.array(forced, dtype=np.int64)
    return ForcedTokens(table[:, 0], table[:, 1])


class Req(Protocol):
    """What a first token's forcing reads of a request (``scheduler_proc.req.Req``)."""

    sampling: SamplingParams
    output_ids: list[int]

    @property
    def matcher(self) -> object | None: ...


def forced_first_tokens(reqs: Sequence[Req]) -> ForcedTokens | None:
    """The forced tokens of draws outside the running batch (a first token after a prefill
    or a re-prefill): row i draws ``reqs[i]``'s next token. Per-request work only for those
    with a budget; a constrained one (a matcher) is never forced."""
    rows = [
        i
        for i, r in enumerate(reqs)
        if r.sampling.thinking_budget is not None
        and r.matcher is None
        and budget_open(r.sampling, r.output_ids)
    ]
    out_lens = [len(reqs[i].output_ids) for i in rows]
    return forced_rows([reqs[i].sampling for i in rows], rows, out_lens)
