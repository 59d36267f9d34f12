"""``--enable-deterministic-inference`` through the real scheduler (model, KV pool, prefix
cache, running batch; no sockets): 50 seeded prompts at temperature 1.0 give the same tokens
and the same logprob bits run cold, served from the prefix cache, prefilled in chunks of 16,
beside 64 other requests (prefilled and decoded together), and retracted and recomputed."""

from __future__ import annotations

import random
import time

import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.columns import from_column, split_token_rows
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.logprob_columns import read_output_logprobs
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler

PROMPTS = 50
NEIGHBOURS = 64
MAX_NEW = 6
POOL = 400  # tokens: too few for the 50 prompts' answers at once
ASK = LogprobParams(top_logprobs_num=3)

# One answer: its tokens, and per token the chosen logprob and the top three (value, id).
Answer = tuple[list[int], list[tuple[float, list[tuple[float, int]]]]]
# The cold run's answers, the cached run's, and how many prompt tokens the cache held.
Runs = tuple[dict[int, Answer], dict[int, Answer], int]


def prompts(count: int, seed: int) -> list[list[int]]:
    """Distinct first tokens (so no two share a cached prefix) and lengths from 1 to 90:
    shorter and longer than a chunk of 16, and across the key blocks of attention."""
    rng = random.Random(seed)
    return [
        [100 + i] + [rng.randrange(60, 3900) for _ in range(rng.randrange(0, 90))]
        for i in range(count)
    ]


def make(chunk: int = 512, pool: int = 16384) -> Scheduler:
    config = ServerConfig(
        max_total_tokens=pool,
        chunked_prefill_size=chunk,
        torch_threads=1,
        enable_deterministic_inference=True,
    )
    return build_scheduler(config)


def submit(s: Scheduler, req_id: int, ids: list[int], seed: int) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=ids,
            sampling_params=SamplingParams(
                temperature=1.0, seed=seed, max_new_tokens=MAX_NEW, ignore_eos=True
            ),
            stream=True,
            arrival_time=time.time(),
            logprobs=ASK,
        )
    )


def run(s: Scheduler) -> dict[int, Answer]:
    """Every request's tokens and logprobs, read back from encoded frames."""
    answers: dict[int, Answer] = {}
    while s.has_work():
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            assert frame.logprobs is not None and frame.logprobs.output is not None
            per_row = read_output_logprobs(frame.logprobs.output, [len(r) for r in rows])
            for i, req_id in enumerate(from_column(frame.req_ids, REQ_ID_DTYPE).tolist()):
                tokens, logprobs = answers.setdefault(req_id, ([], []))
                tokens.extend(rows[i])
                logprobs.extend(zip(per_row[i].chosen, per_row[i].top))
    return answers


def one_by_one(s: Scheduler, asked: list[list[int]]) -> dict[int, Answer]:
    answers: dict[int, Answer] = {}
    for i, ids in enumerate(asked):
        submit(s, i, ids, seed=1000 + i)
        answers.update(run(s))
    return answers


@pytest.fixture(scope="module")
def asked() -> list[list[int]]:
    return prompts(PROMPTS, seed=0)


@pytest.fixture(scope="module")
def cold_and_cached(asked: list[list[int]]) -> Runs:
    """Each prompt alone in a fresh cache, then each again (its whole prompt but the last
    token now cached); and how many tokens the cache held before the second run."""
    s = make()
    cold = one_by_one(s, asked)
    cache_hits = s.cache.total_size
    cached = one_by_one(s, asked)
    return cold, cached, cache_hits


def test_the_answers_are_real(cold_and_cached: Runs) -> None:
    cold, _, cache_hits = cold_and_cached
    assert sorted(cold) == list(range(PROMPTS))
    assert all(len(tokens) == MAX_NEW == len(lps) for tokens, lps in cold.values())
    assert len({tuple(tokens) for tokens, _ in cold.values()}) == PROMPTS
    assert cache_hits >= sum(len(p) - 1 for p in prompts(PROMPTS, seed=0))


def test_served_from_the_prefix_cache(cold_and_cached: Runs) -> None:
    cold, cached, _ = cold_and_cached
    assert cached == cold


def test_prefilled_in_chunks_of_16(asked: list[list[int]], cold_and_cached: Runs) -> None:
    assert one_by_one(make(chunk=16), asked) == cold_and_cached[0]


def test_beside_64_other_requests(asked: list[list[int]], cold_and_cached: Runs) -> None:
    """All 114 requests arrive at once: their prompts are prefilled together over several
    passes, then decoded in one batch."""
    s = make()
    others = prompts(NEIGHBOURS, seed=1)
    for i, ids in enumerate(others):
        submit(s, PROMPTS + i, [ids[0] + PROMPTS, *ids[1:]], seed=7 + i)
    for i, ids in enumerate(asked):
        submit(s, i, ids, seed=1000 + i)
    together = run(s)
    assert {i: together[i] for i in range(PROMPTS)} == cold_and_cached[0]


def test_retracted_and_recomputed(asked: list[list[int]], cold_and_cached: Runs) -> None:
    """All 50 at once in a pool too small for them: requests are retracted mid-answer and
    prefill their prompt and output again (from the cache, as far as it still holds them)."""
    s = make(pool=POOL)
    for i, ids in enumerate(asked):
        submit(s, i, ids, seed=1000 + i)
    assert run(s) == cold_and_cached[0]
    assert s.num_retracted_total > 0, "the small pool forced no retraction"
