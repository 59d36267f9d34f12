"""Output-token logprobs (docs/design.md section 11), computed in a step's batched pass for the rows
that asked, and kept until each row goes out: by the running batch for its rows, as columns
(``RunningBatch.keep_logprobs``), so a decode step does no per-row work for them; by the
request itself (``Req.pending_logprobs``) otherwise (a first token after a prefill).

Values are the model's raw distribution, ``log_softmax`` of the logits before bias,
penalties, temperature and cuts (vLLM's default). A step in which no row asked computes
nothing. ``step_logprobs`` serves one token per request (decode, a first token, prompt
positions), ``span_logprobs`` several (a dLLM pass's committed positions): one batched
computation either way. Prompt positions also get each token's rank (``token_ranks``), which
vLLM's ``prompt_logprobs`` show; no API shows an output token's, so none is computed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from pipeline.io_struct import LogprobParams
from pipeline.logprob_columns import (
    LOGPROB_DTYPE,
    LOGPROB_ID_DTYPE,
    RANK_DTYPE,
    TokenLogprobs,
    no_ranks,
)
from scheduler_proc.req import Req

# chosen [r], top ids, top values [r, k], ids values [r, m]
StepLogprobs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class LogprobRows(Protocol):
    """What a decode step's logprobs read and write of the running batch
    (``RunningBatch``): the batch hands itself over, this module does not import it."""

    def logprob_asks(self, rows: np.ndarray) -> tuple[int, np.ndarray]: ...

    def keep_logprobs(self, rows: np.ndarray, step: StepLogprobs) -> None: ...


def batched_logprobs(
    logits: torch.Tensor, rows: np.ndarray, tokens: np.ndarray, k: int, ids: np.ndarray
) -> StepLogprobs:
    """The logprobs of ``tokens`` at ``rows`` (indices into ``logits``, in any order): one
    log-softmax over those rows only, one gather of the chosen tokens, one top-``k`` (sorted,
    most likely first), one gather of ``ids`` (``[rows, m]``, padded with 0)."""
    return gathered_logprobs(rows_log_softmax(logits, rows), tokens, k, ids)


def rows_log_softmax(logits: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """The log-softmax of ``logits``' ``rows`` (in that order), in float32."""
    if (
        len(rows) == logits.shape[0] and (rows == np.arange(len(rows))).all()
    ):  # every row in order: no copy
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(
        logits.index_select(0, torch.from_numpy(rows).to(logits.device)).float(), dim=-1
    )


def gathered_logprobs(
    lp: torch.Tensor, tokens: np.ndarray, k: int, ids: np.ndarray
) -> StepLogprobs:
    """``batched_logprobs``' columns from the rows' log-softmax ``lp``."""
    chosen = lp.gather(
        1, torch.from_numpy(tokens.astype(np.int64)).to(lp.device).unsqueeze(1)
    ).squeeze(1)
    if k:
        top_values, top_ids = lp.topk(k, dim=1)
        top_v, top_i = top_values.cpu().numpy(), top_ids.cpu().numpy().astype(LOGPROB_ID_DTYPE)
    else:
        top_v = np.empty((lp.shape[0], 0), dtype=LOGPROB_DTYPE)
        top_i = np.empty((lp.shape[0], 0), dtype=LOGPROB_ID_DTYPE)
    if ids.shape[1]:
        ids_v = lp.gather(1, torch.from_numpy(ids.astype(np.int64)).to(lp.device)).cpu().numpy()
    else:
        ids_v = np.empty((lp.shape[0], 0), dtype=LOGPROB_DTYPE)
    return chosen.cpu().numpy(), top_i, top_v, ids_v


def token_ranks(lp: torch.Tensor, tokens: np.ndarray) -> np.ndarray:
    """vLLM's rank of each row's token in ``lp``: how many of the row's values are at or
    above the token's own, itself included (vLLM v1's ``batched_count_greater_than``), so the
    most likely token is 1 and tied tokens all take the largest rank among them. One
    comparison and one sum over the rows, int32 as on the wire. On the CPU numpy counts the
    comparison's booleans about four times as fast as torch sums them."""
    own = lp.gather(1, torch.from_numpy(tokens.astype(np.int64)).to(lp.device).unsqueeze(1))
    if lp.device.type == "cpu":
        return (lp.numpy() >= own.numpy()).sum(axis=1, dtype=RANK_DTYPE)
    return (lp >= own).sum(dim=1, dtype=torch.int32).cpu().numpy().astype(RANK_DTYPE, copy=False)


def step_logprobs(
    logits: torch.Tensor,
    rows: np.ndarray,
    tokens: np.ndarray,
    asks: Sequence[LogprobParams],
    ranked: bool = False,
) -> list[TokenLogprobs]:
    """The logprobs of this step's token for each of ``rows`` (indices into ``logits``,
    whose requests ask ``asks``), from one batched computation over the largest k and all
    the asked ids, and with ``ranked`` the tokens' ranks (prompt positions); the
    per-request results are views of those batched arrays."""
    ks = [a.top_logprobs_num for a in asks]
    ms = [len(a.token_ids_logprob) for a in asks]
    m = max(ms)
    ids = np.array(
        [list(a.token_ids_logprob) + [0] * (m - len(a.token_ids_logprob)) for a in asks],
        dtype=np.int64,
    )
    lp = rows_log_softmax(logits, rows)
    chosen_v, top_i, top_v, ids_v = gathered_logprobs(
        lp, tokens, max(ks), ids.reshape(len(asks), m)
    )
    ranks = token_ranks(lp, tokens) if ranked else no_ranks()  # a slice of none is none
    return [
        TokenLogprobs(
            chosen_v[i : i + 1],
            top_i[i : i + 1, : ks[i]],
            top_v[i : i + 1, : ks[i]],
            ids_v[i : i + 1, : ms[i]],
            ranks[i : i + 1],
        )
        for i in range(len(rows))
    ]


def span_logprobs(
    logits: torch.Tensor,
    rows: np.ndarray,
    tokens: np.ndarray,
    spans: Sequence[tuple[LogprobParams, int]],
) -> list[TokenLogprobs]:
    """As ``step_logprobs`` where a request has several tokens in one pass (a dLLM block's
    positions): ``spans`` are (ask, count) per request, its ``count`` rows consecutive in
    ``rows``. The same batched computation; one view per request, not per token."""
    asks = [a for a, _ in spans]
    counts = [n for _, n in spans]
    m = max(len(a.token_ids_logprob) for a in asks)
    ids = np.array(
        [list(a.token_ids_logprob) + [0] * (m - len(a.token_ids_logprob)) for a in asks],
        dtype=np.int64,
    )
    ids = np.repeat(ids.reshape(len(asks), m), counts, axis=0)
    chosen_v, top_i, top_v, ids_v = batched_logprobs(
        logits, rows, tokens, max(a.top_logprobs_num for a in asks), ids
    )
    out: list[TokenLogprobs] = []
    first = 0
    for ask, n in spans:
        k, m, last = ask.top_logprobs_num, len(ask.token_ids_logprob), first + n
        out.append(
            TokenLogprobs(
                chosen_v[first:last],
                top_i[first:last, :k],
                top_v[first:last, :k],
                ids_v[first:last, :m],
            )
        )
        first = last
    return out


def keep_decode_logprobs(
    batch: LogprobRows,
    logits: torch.Tensor,
    rows: np.ndarray,
    new: np.ndarray,
    batch_rows: np.ndarray | None = None,
) -> None:
    """The logprobs of a decode step's token for the rows that asked (``rows``: indices into
    ``logits`` and ``new``, the step's token of every row drawn), kept in the batch's columns
    until each row goes out: what the rows ask is read from the batch's columns too, so no
    ``Req`` is read. ``batch_rows``: the rows' places in the batch when the draw was over some
    rows only (a speculative step's position); None: the same as ``rows``."""
    at = rows if batch_rows is None else batch_rows
    k, ids = batch.logprob_asks(at)
    batch.keep_logprobs(at, batched_logprobs(logits, rows, new[rows], k, ids))


def keep_prompt_logprobs(
    batch: Sequence[tuple[Req, list[int], torch.Tensor]],
    hidden: torch.Tensor,
    logits_of: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Prompt logprobs from a prefill pass's hidden states (``hidden``: every new token of
    ``batch`` in order): for each request still computing them, the positions of this chunk
    that predict a prompt token, all requests' rows through one ``logits_of`` and one
    ``step_logprobs``, ranks included. A position computed before (a re-prefill after a
    retraction) is not computed again."""
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
    parts = step_logprobs(
        logits, np.arange(len(rows)), np.array(targets, dtype=np.int64), asks, ranked=True
    )
    for req, first, count in spans:
        req.prompt_logprobs.append(TokenLogprobs.join(parts[first : first + count]))
