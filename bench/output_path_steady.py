"""The output-path benchmark's steady decode step: requests that have all emitted before
(their stats and decode options already sent, so ``take_request_stats_due`` returns None for
every row), one new token each, held as the scheduler's running batch holds them."""

from __future__ import annotations

import random
import time
import uuid

import torch

from pipeline.io_struct import CachedTokensDetails, LogprobParams, MediaItem, SamplingParams
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.output_builder import build_token_output
from scheduler_proc.req import Req, StatsPending

TOP_K = 5  # the logprobs variants' top_logprobs_num
VOCAB = 32000
Timings = tuple[int, int, int, int]  # build, encode, decode (ns), message bytes


def make_steady_reqs(
    n: int,
    stats_pending: StatsPending,
    *,
    metrics: bool,
    seed: int = 0,
    logprob: LogprobParams | None = None,
) -> list[Req]:
    """``n`` running requests that have all emitted before: prefilled (with prefix-cache
    hits, a few media items, time stats when metrics are on), a few tokens generated and
    sent through the real ``build_token_output``, so stats and decode options are sent.
    ``stats_pending``: their scheduler's set. ``logprob``: what each of them asks for
    (their logprobs are kept from the next step)."""
    rng = random.Random(seed)
    now = time.time()
    reqs: list[Req] = []
    for i in range(n):
        prompt_len = rng.randint(64, 2048)
        media = (MediaItem(kind="image", num_tokens=256),) if i % 8 == 0 else ()
        req = Req(
            rid=uuid.UUID(int=rng.getrandbits(128), version=4).hex,
            req_id=(1 << 40)
            + i,  # worker index in the high bits, as with several tokenizer workers
            input_ids=[rng.randrange(32000) for _ in range(prompt_len)],
            sampling=SamplingParams(max_new_tokens=4096),
            stream=True,
            stream_interval=1,
            arrival_time=now - 1.0,
            stats_pending=stats_pending,
            media=media,
            collect_time_stats=metrics,
            logprob=logprob,
        )
        req.enter_waiting_queue(now - 0.9)
        req.leave_waiting_queue(now - 0.8)
        cached = rng.randrange(0, prompt_len, 16)
        req.update_stats(
            cached_tokens=cached, cached_tokens_details=CachedTokensDetails(device=cached, host=0)
        )
        req.update_time_stats(prefill_finished_time=now - 0.7)
        req.output_ids.extend(rng.randrange(32000) for _ in range(rng.randint(1, 16)))
        reqs.append(req)
    first = build_token_output(reqs, stats_pending)  # the first output: every row carries stats
    assert first.request_stats is not None and all(s is not None for s in first.request_stats)
    return reqs


def running_batch_of(reqs: list[Req]) -> RunningBatch:
    """The requests as the scheduler's running batch holds them after their first row."""
    longest = max(r.seq_len for r in reqs)
    batch = RunningBatch(context_length=longest + 4096, vocab_size=VOCAB)
    for req in reqs:
        req.num_computed = req.seq_len - 1
        req.kv_slots = torch.arange(req.num_computed)  # where the KV lives does not matter here
        batch.append(req)
    return batch


def step_logits(n: int, seed: int) -> torch.Tensor:
    """One decode step's ``[n, VOCAB]`` logits (the logprobs variants' source)."""
    return torch.randn((n, VOCAB), generator=torch.Generator().manual_seed(seed)) * 4
