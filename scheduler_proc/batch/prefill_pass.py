"""One batched prefill pass: each admitted request computes its next chunk of tokens
(the rest of its prompt, or a chunk of it, after its cached prefix), and the requests
whose prompt completed draw their first token.

The scheduler chooses the chunks (admission, the token budget, the pool) and decides what
a completed request does next; this module runs the model over them and keeps what the
pass computed on each request: its KV slots, its prompt logprobs, its embedding's hidden
states, and the logprobs of its first token.
"""

from __future__ import annotations

import numpy as np
import torch

from scheduler_proc.embedding import accumulate_hidden
from scheduler_proc.grammar_queue import accept_appended
from scheduler_proc.sampling.logprobs import keep_prompt_logprobs, step_logprobs
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.req import Req
from scheduler_proc.sampling.grammar import GrammarMask, GrammarRows, StepMasks
from scheduler_proc.sampling.reasoning_gate import open_if_ended
from scheduler_proc.sampling.sampler import SamplingColumns, draw_counter
from scheduler_proc.sampling.thinking_budget import forced_first_tokens
from scheduler_proc.stop_checker import StopChecker

# A request, the tokens it computes in this pass, and the pool slots of their KV.
Chunk = tuple[Req, list[int], torch.Tensor]

_EMPTY_SLOTS = torch.empty(0, dtype=torch.long)


def forward_chunks(
    runner: ModelRunner, batch: list[Chunk]
) -> tuple[torch.Tensor, list[int], list[Req]]:
    """Runs the pass and records each chunk on its request. Returns the last-token logits
    of every chunk, the rows whose request has now computed all its tokens, and the other
    requests (mid-chunk), in batch order."""
    embeds = any(req.is_embedding for req, _, _ in batch)
    prompt_logprobs = any(req.prompt_logprobs_next is not None for req, _, _ in batch)
    logits, hidden = runner.extend(
        [toks for _, toks, _ in batch],
        [req.kv_slots if req.kv_slots is not None else _EMPTY_SLOTS for req, _, _ in batch],
        [slots for _, _, slots in batch],
        return_hidden=embeds or prompt_logprobs,
        lora_slots=_lora_slots(batch),
    )
    if hidden is not None:  # asked for: embeds or prompt_logprobs
        if embeds:
            accumulate_hidden(batch, hidden)
        if prompt_logprobs:
            keep_prompt_logprobs(batch, hidden, runner.logits)
    done_rows: list[int] = []
    mid_chunk: list[Req] = []
    for i, (req, toks, slots) in enumerate(batch):
        req.kv_slots = slots if req.kv_slots is None else torch.cat((req.kv_slots, slots))
        req.num_computed += len(toks)
        if req.num_computed == req.seq_len:
            done_rows.append(i)
        else:
            mid_chunk.append(req)
    return logits, done_rows, mid_chunk


def _lora_slots(batch: list[Chunk]) -> list[int] | None:
    """Each chunk's adapter slot (-1: the base model); None when no chunk has an adapter."""
    slots = [req.lora_slot for req, _, _ in batch]
    return slots if max(slots) >= 0 else None


def sample_first_tokens(
    runner: ModelRunner,
    logits: torch.Tensor,
    reqs: list[Req],
    stop_checker: StopChecker,
    masks: StepMasks,
) -> list[int]:
    """The next token of each of these requests (not in the running batch: a first token
    after a prefill), each drawn at its output index, never a stop token while the output
    is short of min_new_tokens, within its grammar when it has one (its matcher takes
    the token when it is appended: ``Scheduler.append_tokens``), and the next id of its
    thinking end when its budget is spent (``thinking_budget.py``); the logprobs of the
    requests that asked are kept on them until their rows go out (one batched
    computation)."""
    params = [r.sampling for r in reqs]
    out_lens = [len(r.output_ids) for r in reqs]
    columns = SamplingColumns.from_requests(
        params,
        [r.seed for r in reqs],
        [draw_counter(n) for n in out_lens],
        [r.origin_input_ids for r in reqs],
        [r.output_ids for r in reqs],
        logits.shape[-1],
        logits.device,
        stop_checker.min_new_bans_of(params, out_lens),
        _grammar_mask(reqs, masks),
        forced_first_tokens(reqs),
    )
    tokens = runner.sample(logits, columns)
    asking = [i for i, r in enumerate(reqs) if r.logprob is not None]
    if asking:
        rows = np.array(asking)
        asks = [ask for ask in (reqs[i].logprob for i in asking) if ask is not None]
        for i, part in zip(asking, step_logprobs(logits, rows, tokens[rows], asks)):
            reqs[i].pending_logprobs.append(part)
    first: list[int] = tokens.tolist()
    return first


def _grammar_mask(reqs: list[Req], masks: StepMasks) -> GrammarMask | None:
    rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
    if not rows:
        return None
    matchers = [m for m in (r.matcher for r in reqs) if m is not None]
    return masks.fill(GrammarRows(np.array(rows, dtype=np.int64), rows, matchers), len(reqs))


def append_first_tokens(
    reqs: list[Req], tokens: list[int], stop_checker: StopChecker, rows: list[Req]
) -> list[Req]:
    """Appends one sampled token to each request (not in the running batch: a first
    token), checks its grammar and stops, queues the due rows in ``rows``; returns the
    requests that keep running."""
    still_running: list[Req] = []
    for req, token in zip(reqs, tokens):
        req.output_ids.append(token)
        reason = None
        if req.matcher is not None:
            reason = accept_appended(req, token)
        else:
            open_if_ended(req)  # a grammar waiting for the end of the reasoning
        if reason is None:
            reason = stop_checker.check(req)
        if reason is not None:
            req.finish(reason)
        else:
            still_running.append(req)
        if req.output_due():
            rows.append(req)
    return still_running
