"""Output-token logprobs (SPEC section 11), computed in a step's batched pass for the rows
that asked; each request keeps them (``Req.pending_logprobs``) until its row goes out.

Values are the model's raw distribution, ``log_softmax`` of the logits before bias,
penalties, temperature and cuts (vLLM's default). A step in which no row asked computes
nothing. ``step_logprobs`` serves one token per request (decode, a first token, prompt
positions), ``span_logprobs`` several (a dLLM pass's committed positions): one batched
computation either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pipeline.io_struct import LogprobParams
from pipeline.logprob_columns import LOGPROB_DTYPE, LOGPROB_ID_DTYPE, TokenLogprobs
from scheduler_proc.req import Req


def step_logprobs(logits: torch.Tensor, rows: np.ndarray, tokens: np.ndarray, asks: Sequence[LogprobParams]) -> list[TokenLogprobs]:
    """The logprobs of this step's token for each of ``rows`` (indices into ``logits``,
    whose requests ask ``asks``): one log-softmax over those rows only, one gather of the
    chosen tokens, one top-k of the largest k asked, one gather of the asked ids. The
    per-request results are views of those batched arrays."""
    chosen_v, top_i, top_v, ids_v = _batched(logits, rows, tokens, asks, None)
    ks = [a.top_logprobs_num for a in asks]
    ms = [len(a.token_ids_logprob) for a in asks]
    return [
        TokenLogprobs(chosen_v[i : i + 1], top_i[i : i + 1, : ks[i]], top_v[i : i + 1, : ks[i]], ids_v[i : i + 1, : ms[i]])
        for i in range(len(rows))
    ]


def span_logprobs(
    logits: torch.Tensor, rows: np.ndarray, tokens: np.ndarray, spans: Sequence[tuple[LogprobParams, int]]
) -> list[TokenLogprobs]:
    """As ``step_logprobs`` where a request has several tokens in one pass (a dLLM block's
    positions): ``spans`` are (ask, count) per request, its ``count`` rows consecutive in
    ``rows``. The same batched computation; one view per request, not per token."""
    asks = [a for a, _ in spans]
    counts = [n for _, n in spans]
    chosen_v, top_i, top_v, ids_v = _batched(logits, rows, tokens, asks, counts)
    out: list[TokenLogprobs] = []
    first = 0
    for ask, n in spans:
        k, m, last = ask.top_logprobs_num, len(ask.token_ids_logprob), first + n
        out.append(TokenLogprobs(chosen_v[first:last], top_i[first:last, :k], top_v[first:last, :k], ids_v[first:last, :m]))
        first = last
    return out


def _batched(
    logits: torch.Tensor, rows: np.ndarray, tokens: np.ndarray, asks: Sequence[LogprobParams], counts: Sequence[int] | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Chosen [R], top ids and values [R, k] and asked ids' values [R, m] for ``rows``, k
    and m the largest asked (a row's own are its first columns). ``asks[j]`` covers
    ``counts[j]`` consecutive rows (one each when ``counts`` is None)."""
    lp = torch.log_softmax(logits.index_select(0, torch.from_numpy(rows).to(logits.device)).float(), dim=-1)
    chosen = lp.gather(1, torch.from_numpy(tokens.astype(np.int64)).to(lp.device).unsqueeze(1)).squeeze(1)
    k = max(a.top_logprobs_num for a in asks)
    if k:
        top_values, top_ids = lp.topk(k, dim=1)  # sorted, most likely first
        top_v, top_i = top_values.cpu().numpy(), top_ids.cpu().numpy().astype(LOGPROB_ID_DTYPE)
    else:
        top_v = np.empty((len(rows), 0), dtype=LOGPROB_DTYPE)
        top_i = np.empty((len(rows), 0), dtype=LOGPROB_ID_DTYPE)
    m = max(len(a.token_ids_logprob) for a in asks)
    if m:
        ids = torch.tensor([list(a.token_ids_logprob) + [0] * (m - len(a.token_ids_logprob)) for a in asks], dtype=torch.long)
        if counts is not None:
            ids = ids.repeat_interleave(torch.tensor(counts, dtype=torch.long), dim=0)
        ids_v = lp.gather(1, ids.to(lp.device)).cpu().numpy()
    else:
        ids_v = np.empty((len(rows), 0), dtype=LOGPROB_DTYPE)
    return chosen.cpu().numpy(), top_i, top_v, ids_v


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
