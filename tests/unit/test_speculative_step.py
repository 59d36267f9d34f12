"""Speculative decoding changes the speed and nothing else (scheduler_proc/speculative/): the
scheduler, driven step by step with --enable-deterministic-inference, gives every request the
same tokens, finish reasons and logprobs with n-gram drafts as without them, over a mixed run
(greedy and seeded rows, top_p, stop ids, min_new_tokens, max_new_tokens that end mid-draft,
logprobs, streaming, aborts, a pool small enough to retract, the overlap schedule on and off);
the pool gets every slot back; adaptivity drafts nothing for a large batch."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import numpy as np
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    AbortReq,
    BatchTokenIDOutput,
    FinishReason,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.logprob_columns import read_output_logprobs
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, '
    '"prompt_lookup_max": 3, "disable_by_batch_size": 0}'
)
Message = TokenizedGenerateReqInput | AbortReq


def _workload(seed: int, count: int) -> list[tuple[int, Message]]:
    """(arrival step, message): prompts that repeat a short pattern (so n-gram lookup
    drafts), a quarter greedy, the rest seeded at temperature 1.0 with top_p 0.9 or none."""
    rng = random.Random(seed)
    out: list[tuple[int, Message]] = []
    for i in range(count):
        pattern = [rng.randrange(60, 3900) for _ in range(rng.randrange(2, 8))]
        prompt = (pattern * 12)[: rng.randrange(4, 60)] + [rng.randrange(60, 3900)] * (i % 3)
        kind = i % 4
        sampling = SamplingParams(
            max_new_tokens=rng.randrange(1, 70),
            temperature=0.0 if kind < 2 else 1.0,
            top_p=0.9 if kind == 2 else 1.0,
            seed=i,
            ignore_eos=i % 5 != 0,
            stop_token_ids=tuple(rng.randrange(60, 3900) for _ in range(3)) if i % 7 == 0 else (),
            min_new_tokens=6 if i % 9 == 0 else 0,
        )
        msg = TokenizedGenerateReqInput(
            rid=f"r{i}",
            req_id=i,
            input_ids=prompt,
            sampling_params=sampling,
            stream=i % 2 == 0,
            arrival_time=time.time(),
            logprobs=LogprobParams(top_logprobs_num=3) if i % 5 == 0 else None,
        )
        out.append((i // 8, msg))
        if i % 37 == 5:
            out.append((i // 8 + rng.randrange(2, 9), AbortReq(req_id=i, reason="client left")))
    out.sort(key=lambda item: item[0])
    return out


@dataclass
class Outcome:
    tokens: dict[int, list[int]] = field(default_factory=dict)
    finished: dict[int, FinishReason] = field(default_factory=dict)
    logprobs: dict[int, list[tuple[float, list[tuple[float, int]]]]] = field(default_factory=dict)

    def take(self, frame: BatchTokenIDOutput) -> None:
        ids = np.frombuffer(frame.req_ids, REQ_ID_DTYPE).tolist()
        toks = np.frombuffer(frame.output_ids, TOKEN_DTYPE).tolist()
        counts = np.frombuffer(frame.output_counts, COUNT_DTYPE).tolist()
        at = 0
        for row, (req_id, count) in enumerate(zip(ids, counts)):
            self.tokens.setdefault(req_id, []).extend(toks[at : at + count])
            at += count
            reason = frame.finished_reasons[row] if frame.finished_reasons is not None else None
            if reason is not None:
                self.finished[req_id] = reason
        if frame.logprobs is not None and frame.logprobs.output is not None:
            for row, lp in read_output_logprobs(frame.logprobs.output, counts).items():
                kept = self.logprobs.setdefault(ids[row], [])
                kept.extend(zip(lp.chosen, lp.top))


def _config(spec: str | None, overlap: bool, pool: int) -> ServerConfig:
    return ServerConfig(
        max_total_tokens=pool,
        torch_threads=1,
        enable_metrics=False,
        enable_deterministic_inference=True,
        disable_overlap_schedule=not overlap,
        speculative_config=spec,
    )


def _run(s: Scheduler, workload: list[tuple[int, Message]]) -> Outcome:
    pending = list(workload)
    outcome = Outcome()
    step = 0
    while pending or s.has_work():
        while pending and pending[0][0] <= step:
            _, msg = pending.pop(0)
            if isinstance(msg, AbortReq):
                s.abort(msg)
            else:
                s.add_request(msg)
        step += 1
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            outcome.take(frame)
    s.close()
    return outcome


@pytest.mark.parametrize("overlap", [True, False])
def test_drafts_change_no_token_logprob_or_finish(overlap: bool) -> None:
    workload = _workload(seed=7, count=160)
    plain = _run(build_scheduler(_config(None, overlap, 1500)), workload)
    speculating = build_scheduler(_config(NGRAM, overlap, 1500))
    got = _run(speculating, workload)
    counters = speculating.mode.spec_counters
    # The run exercised what speculation changes: accepted drafts, several positions deep,
    # and retractions (the pool is small).
    assert counters.num_accepted_tokens > 30
    assert counters.accepted_per_pos[3] > 0
    assert speculating.num_retracted_total > 0
    assert set(got.tokens) == set(plain.tokens)
    for req_id, tokens in plain.tokens.items():
        assert got.tokens[req_id] == tokens, f"request {req_id}"
        assert got.finished.get(req_id) == plain.finished.get(req_id), f"request {req_id}"
    assert got.logprobs.keys() == plain.logprobs.keys()
    for req_id, kept in plain.logprobs.items():
        assert got.logprobs[req_id] == kept, f"logprobs of request {req_id}"
    # Every slot came back: nothing is held once every request is done.
    assert speculating.kv_tokens_held_by_requests == 0


def test_a_batch_over_the_limit_decodes_without_drafts() -> None:
    spec = NGRAM.replace('"disable_by_batch_size": 0', '"disable_by_batch_size": 4')
    s = build_scheduler(_config(spec, overlap=False, pool=4000))
    for _, msg in _workload(seed=3, count=6):
        if isinstance(msg, TokenizedGenerateReqInput):
            s.add_request(msg)
    drafted_at: list[tuple[int, int]] = []  # (running rows, draft tokens so far)
    while s.has_work():
        rows = len(s.running)
        s.step()
        drafted_at.append((rows, s.mode.spec_counters.num_draft_tokens))
    grew = [
        rows for (rows, total), (_, before) in zip(drafted_at[1:], drafted_at) if total > before
    ]
    assert grew, "no step drafted"
    assert max(grew) <= 4
    s.close()
