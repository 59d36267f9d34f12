"""Speculative decoding changes the speed and nothing else (scheduler_proc/speculative/): the
scheduler, driven step by step with --enable-deterministic-inference, gives every request the
same tokens, finish reasons and logprobs with n-gram drafts as without them, over a mixed run
(greedy and seeded rows, top_p, stop ids, min_new_tokens, max_new_tokens that end mid-draft,
logprobs, streaming, aborts, a pool small enough to retract, the overlap schedule on and off);
the pool gets every slot back; a batch over the size limit drafts nothing, and a step whose
drafts would not pay for their verify pass verifies none."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

from bench.copy_checkpoint import read_successors
from bench.copy_checkpoint import write as write_copy
from bench.serve_client import chain_prompt
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
from scheduler_proc.decode_mode import TokenDecode
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.speculative.verify import Speculation

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


@pytest.fixture(scope="module")
def copy_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[int]]:
    """bench/copy_checkpoint.py's checkpoint (greedy answers go round the cycles of sigma
    their prompt holds: prompt lookup's drafts are accepted) and sigma."""
    directory = tmp_path_factory.mktemp("copy")
    write_copy(directory)
    return str(directory), read_successors(directory)


def _chains(successors: list[int], count: int, max_new: int) -> list[TokenizedGenerateReqInput]:
    rng = random.Random(5)
    return [
        TokenizedGenerateReqInput(
            rid=f"c{i}",
            req_id=i,
            input_ids=chain_prompt(successors, rng, 40),
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0.0),
            stream=True,
            arrival_time=time.time(),
        )
        for i in range(count)
    ]


def _drafting_batch_sizes(s: Scheduler, reqs: list[TokenizedGenerateReqInput]) -> list[int]:
    """The running batch's size at each step that verified drafts."""
    for req in reqs:
        s.add_request(req)
    sizes = []
    while s.has_work():
        rows, before = len(s.running), s.mode.spec_counters.num_draft_tokens
        s.step()
        if s.mode.spec_counters.num_draft_tokens > before:
            sizes.append(rows)
    s.close()
    return sizes


def test_a_batch_over_the_limit_decodes_without_drafts(copy_model: tuple[str, list[int]]) -> None:
    path, successors = copy_model
    spec = NGRAM.replace('"disable_by_batch_size": 0', '"disable_by_batch_size": 4')
    config = msgspec.structs.replace(_config(spec, overlap=False, pool=4000), model_path=path)
    # Requests of different lengths: the batch shrinks from 8 rows as they finish.
    reqs = [
        msgspec.structs.replace(
            r, sampling_params=msgspec.structs.replace(r.sampling_params, max_new_tokens=8 * i)
        )
        for i, r in enumerate(_chains(successors, 8, 0), start=1)
    ]
    sizes = _drafting_batch_sizes(build_scheduler(config), reqs)
    assert sizes, "no step drafted"
    assert max(sizes) <= 4


@pytest.mark.parametrize("limit", [0, 32])
def test_drafts_that_do_not_pay_are_not_verified(
    copy_model: tuple[str, list[int]], limit: int
) -> None:
    """16 rows whose answers repeat their prompts (prompt lookup drafts for each): drafts
    are verified while the rows' acceptance is unknown or high, and not once it is low
    enough that the verify step would cost more than the drafts add (``_pays``), unless the
    batch-size limit is 0, which turns the step's cost check off too."""
    path, successors = copy_model
    spec = NGRAM.replace('"disable_by_batch_size": 0', f'"disable_by_batch_size": {limit}')
    config = msgspec.structs.replace(_config(spec, overlap=False, pool=8000), model_path=path)
    s = build_scheduler(config)
    for req in _chains(successors, 16, 48):
        s.add_request(req)
    s.step()  # the prefill: every request joins the running batch
    assert isinstance(s.mode, TokenDecode)
    batch, speculation = s.mode.running, s.mode._speculation
    assert isinstance(speculation, Speculation) and len(batch) == 16
    fresh = speculation.plan(batch)
    assert fresh is not None and fresh.num_drafts == 16 * 4
    speculation.cancel(batch, fresh)
    batch.spec.draft_tokens[:16], batch.spec.accepted[:16] = 100, 20  # a fifth accepted
    low = speculation.plan(batch)
    assert (low is None) == (limit != 0)
    batch.spec.accepted[:16] = 90
    assert speculation.plan(batch) is not None
    s.close()
