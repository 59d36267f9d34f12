"""Output-token logprobs (SPEC section 11), computed in a step's batched pass for the rows
that asked; each request keeps them (``Req.pending_logprobs``) until its row goes out.

Values are the model's raw distribution, ``log_softmax`` of the logits before bias,
penalties, temperature and cuts (vLLM's default). A step in which no row asked computes
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pipeline.io_struct import LogprobParams
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE, TokenLogprobs
from scheduler_proc.req import Req

if TYPE_CHECKING:
    from scheduler_proc.running_batch import RunningBatch


def step_logprobs(logits: torch.Tensor, rows: np.ndarray, tokens: np.ndarray, asks: Sequence[LogprobParams]) -> list[TokenLogprobs]:
    """The logprobs of this step's token for each of ``rows`` (indices into ``logits``,
    whose requests ask ``asks``): one log-softmax over those rows only, one gather of the
    chosen tokens, one top-k of the largest k asked, one gather of the asked ids. The
    per-request results are views of those batched arrays."""
    lp = torch.log_softmax(logits.index_select(0, torch.from_numpy(rows).to(logits.device)).float(), dim=-1)
    chosen = lp.gather(1, torch.from_numpy(tokens.astype(np.int64)).to(lp.device).unsqueeze(1)).squeeze(1)
    ks = [a.top_logprobs_num for a in asks]
    k = max(ks)
    if k:
        top_values, top_ids = lp.topk(k, dim=1)  # sorted, most likely first
        top_v, top_i = top_values.cpu().numpy(), top_ids.cpu().numpy().astype(LOGPROB_ID_DTYPE)
    else:
        top_v = np.empty((len(rows), 0), dtype=LOGPROB_DTYPE)
        top_i = np.empty((len(rows), 0), dtype=LOGPROB_ID_DTYPE)
    ms = [len(a.token_ids_logprob) for a in asks]
    m = max(ms)
    if m:
        ids = torch.tensor([list(a.token_ids_logprob) + [0] * (m - len(a.token_ids_logprob)) for a in asks], dtype=torch.long)
        ids_v = lp.gather(1, ids.to(lp.device)).cpu().numpy()
    else:
        ids_v = np.empty((len(rows), 0), dtype=LOGPROB_DTYPE)
    chosen_v = chosen.cpu().numpy()
    return [
        TokenLogprobs(chosen_v[i : i + 1], top_i[i : i + 1, : ks[i]], top_v[i : i + 1, : ks[i]], ids_v[i : i + 1, : ms[i]])
        for i in range(len(rows))
    ]


def keep_decode_logprobs(batch: RunningBatch, logits: torch.Tensor, rows: np.ndarray, new: np.ndarray) -> None:
    """The logprobs of a decode step's token for the running batch's ``rows`` that asked
    (``new``: the step's token of every row), kept until each row goes out."""
    reqs = [batch.reqs[i] for i in rows.tolist()]
    parts = step_logprobs(logits, rows, new[rows], [r.logprob for r in reqs])  # type: ignore[misc]
    for req, part in zip(reqs, parts):
        req.pending_logprobs.append(part)


def keep_prompt_logprobs(
    batch: Sequence[tuple[Req, list[int], torch.Tensor]], hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Prompt logprobs from a prefill pass's hidden states (``hidden``: every new token of
    ``batch`` in order): for each request still computing them, the positions of this chunk
    that predict a prompt token, all requests' rows through one ``logits_of`` and one
    ``step_logprobs``. A position computed before (a re-prefill after a retraction) is not
    computed again."""
    rows: list[int] = []
    targets: list[int] = []
    asks: list[LogprobParams] = []
    spans: list[tuple[Req, int, int]] = []  # (request, first of its rows, count)
    offset = 0
    for req, toks, _ in batch:
        start = req.num_computed  # before this chunk (the caller has not advanced it yet)
        nxt = req.prompt_logprobs_next
        if nxt is not None and req.logprob is not None:
            prompt = req.origin_input_ids
            first, end = max(nxt, start), min(start + len(toks), len(prompt) - 1)
            if first < end:
                spans.append((req, len(rows), end - first))
                rows.extend(offset + p - start for p in range(first, end))
                targets.extend(prompt[p + 1] for p in range(first, end))
                asks.extend([req.logprob] * (end - first))
                req.prompt_logprobs_next = None if end == len(prompt) - 1 else end
        offset += len(toks)
    if not rows:
        return
    index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
    logits = logits_of(hidden.index_select(0, index))
    parts = step_logprobs(logits, np.arange(len(rows)), np.array(targets, dtype=np.int64), asks)
    for req, first, count in spans:
        req.prompt_logprobs.append(TokenLogprobs.join(parts[first : first + count]))
