"""Sampling through the real scheduler (model, KV pool, running batch): a seeded request
draws the same tokens alone, in any mix of batch and after a retraction, and the penalties
and logit_bias kept in the running batch's columns give the tokens a plain reference loop
gives (full forward each token, penalties applied in Python)."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.io_struct import REQ_ID_DTYPE, SamplingParams, TokenizedGenerateReqInput
from pipeline.columns import from_column, split_token_rows
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler

MAX_NEW = 24
PROMPTS = [[(7 * i + 11 * j) % 3900 + 60 for i in range(12 + 5 * j)] for j in range(6)]

SAMPLED = [
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=0.7, top_p=0.9, seed=12),
    SamplingParams(temperature=1.0, top_k=20, seed=13),
    SamplingParams(temperature=1.2, min_p=0.2, seed=14),
    SamplingParams(
        temperature=0.9,
        frequency_penalty=1.5,
        presence_penalty=0.5,
        repetition_penalty=1.3,
        seed=15,
    ),
    SamplingParams(
        temperature=0.9, logit_bias=((77, 3.0), (1200, -100.0)), top_k=50, top_p=0.8, seed=16
    ),
]


def make(pool: int = 8192, **kw: object) -> Scheduler:
    config = ServerConfig(max_total_tokens=pool, torch_threads=1, **kw)  # type: ignore[arg-type]
    return build_scheduler(config)


def submit(
    s: Scheduler,
    req_id: int,
    ids: list[int],
    params: SamplingParams,
    stream_interval: int | None = None,
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=ids,
            sampling_params=msgspec.structs.replace(
                params, max_new_tokens=MAX_NEW, ignore_eos=True, stream_interval=stream_interval
            ),
            stream=True,
            arrival_time=time.time(),
        )
    )


def run(s: Scheduler) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    while s.has_work():
        for frame in s.step():
            ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()  # type: ignore[union-attr]
            rows = split_token_rows(
                frame.output_ids,  # type: ignore[union-attr]
                frame.output_counts,  # type: ignore[union-attr]
            )
            for req_id, row in zip(ids, rows):
                tokens.setdefault(req_id, []).extend(row)
    return tokens


@pytest.fixture(scope="module")
def alone() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for j, params in enumerate(SAMPLED):
        s = make()
        submit(s, j, PROMPTS[j], params)
        out.update(run(s))
    return out


def test_a_seed_draws_the_same_tokens_in_any_batch(alone: dict[int, list[int]]) -> None:
    assert all(len(t) == MAX_NEW for t in alone.values())
    assert len({tuple(t) for t in alone.values()}) == len(SAMPLED)
    together = make()
    for j, params in enumerate(SAMPLED):
        submit(together, j, PROMPTS[j], params)
    assert run(together) == alone
    # Reversed arrival, greedy neighbours, a stream interval that batches rows differently.
    mixed = make()
    for j in reversed(range(len(SAMPLED))):
        submit(mixed, 100 + j, PROMPTS[(j + 1) % len(PROMPTS)], SamplingParams(temperature=0.0))
        submit(mixed, j, PROMPTS[j], SAMPLED[j], stream_interval=3)
    got = run(mixed)
    assert {j: got[j] for j in range(len(SAMPLED))} == alone


def test_a_seed_draws_the_same_tokens_after_a_retraction(alone: dict[int, list[int]]) -> None:
    """A pool too small for all of them at once: requests are retracted, re-prefilled, and
    rejoin the running batch with their penalty state rebuilt; the tokens do not change."""
    small = make(pool=sum(len(p) for p in PROMPTS) + 40)
    for j, params in enumerate(SAMPLED):
        submit(small, j, PROMPTS[j], params)
    assert run(small) == alone
    assert small.num_retracted_total > 0, "the pool never forced a retraction"


def _reference(s: Scheduler, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy decoding with bias and penalties, the plain way: a full forward over the whole
    sequence for every token, then the penalties token by token in Python."""
    out: list[int] = []
    for _ in range(MAX_NEW):
        ids = prompt + out
        slots = s.kv.alloc(len(ids))
        assert slots is not None
        logits, _ = s.runner.extend([ids], [torch.empty(0, dtype=torch.long)], [slots])
        s.kv.free(slots)
        row = logits[0].float().tolist()
        for token, bias in p.logit_bias:
            row[token] += bias
        for token in set(out):
            row[token] -= p.frequency_penalty * out.count(token) + p.presence_penalty
        for token in set(ids):
            row[token] = (
                row[token] / p.repetition_penalty
                if row[token] > 0
                else row[token] * p.repetition_penalty
            )
        out.append(max(range(len(row)), key=lambda t: (row[t], -t)))
    return out


# A bias of +2 on token 500 makes plain greedy repeat it every step, so each penalty has
# something to act on; the baseline of each case is the same request without the penalty.
_REPEATS = ((500, 2.0),)


@pytest.mark.parametrize(
    ("params", "baseline"),
    [
        (
            SamplingParams(temperature=0.0, logit_bias=_REPEATS, frequency_penalty=1.0),
            SamplingParams(temperature=0.0, logit_bias=_REPEATS),
        ),
        (
            SamplingParams(temperature=0.0, logit_bias=_REPEATS, presence_penalty=2.0),
            SamplingParams(temperature=0.0, logit_bias=_REPEATS),
        ),
        (
            SamplingParams(temperature=0.0, logit_bias=_REPEATS, repetition_penalty=1.9),
            SamplingParams(temperature=0.0, logit_bias=_REPEATS),
        ),
        (
            SamplingParams(temperature=0.0, repetition_penalty=0.5, frequency_penalty=-0.5),
            SamplingParams(temperature=0.0),
        ),
        (
            SamplingParams(temperature=0.0, logit_bias=((300, 2.5), (301, -100.0))),
            SamplingParams(temperature=0.0),
        ),
    ],
    ids=["frequency", "presence", "repetition", "repetition<1+negative-frequency", "logit_bias"],
)
def test_penalties_in_the_running_batch_equal_a_reference_loop(
    params: SamplingParams, baseline: SamplingParams
) -> None:
    s = make()
    expected = _reference(s, PROMPTS[2], params)
    assert expected != _reference(s, PROMPTS[2], baseline), "the parameter changed nothing"
    # Beside a greedy neighbour without penalties and a sampled one with others, so the
    # batch's penalty tables hold rows that ask nothing and rows that ask other things.
    submit(s, 0, PROMPTS[2], params)
    submit(s, 1, PROMPTS[3], SamplingParams(temperature=0.0))
    submit(s, 2, PROMPTS[4], SAMPLED[4])
    assert run(s)[0] == expected


def test_logit_bias_plus_100_forces_its_token() -> None:
    s = make()
    submit(s, 0, PROMPTS[0], SamplingParams(temperature=1.0, seed=5, logit_bias=((1234, 100.0),)))
    submit(s, 1, PROMPTS[1], SamplingParams(temperature=0.0, logit_bias=((99, 100.0),)))
    got = run(s)
    assert got[0] == [1234] * MAX_NEW and got[1] == [99] * MAX_NEW


def test_a_steady_decode_step_asks_no_request_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once every request has emitted its first row, a decode step is column work: no
    request is synced, asked whether its row is due or its stats are due, or stop-checked
    one by one, until an event (here the finish) comes."""
    from scheduler_proc.req import Req
    from scheduler_proc.batch.running_batch import RunningBatch
    from scheduler_proc.stop_checker import StopChecker

    s = make()
    for j in range(6):
        submit(s, j, PROMPTS[j], SAMPLED[j] if j % 2 else SamplingParams(temperature=0.0))
    while len(s.running) < 6 or s.waiting or s.prefilling:
        s.step()
    s.step()  # the last to join emits its first row
    calls: list[str] = []
    for cls, name in (
        (Req, "output_due"),
        (Req, "take_request_stats_due"),
        (StopChecker, "check"),
        (RunningBatch, "sync"),
    ):
        original = getattr(cls, name)

        def counted(  # type: ignore[no-untyped-def]
            *args: object, _original=original, _name=name
        ) -> object:
            calls.append(_name)
            return _original(*args)

        monkeypatch.setattr(cls, name, counted)
    for _ in range(5):
        frames = s.step()
        assert len(frames) == 1 and frames[0].request_stats is None  # type: ignore[union-attr]
    assert calls == []
    run(s)
    assert calls.count("sync") >= 6  # the finish is an event: each request is synced as it leaves


def test_any_integer_is_a_seed() -> None:
    """A negative seed or one past 64 bits (both arrive from clients) is read by its low
    64 bits, never a crash: the fuzz test once found -1 killing the scheduler."""
    s = make()
    submit(s, 0, PROMPTS[0], SamplingParams(temperature=0.9, seed=-1))
    submit(s, 1, PROMPTS[0], SamplingParams(temperature=0.9, seed=(1 << 64) - 1))
    submit(s, 2, PROMPTS[0], SamplingParams(temperature=0.9, seed=(1 << 63) + 5))
    got = run(s)
    assert got[0] == got[1] and len(got[2]) == MAX_NEW
