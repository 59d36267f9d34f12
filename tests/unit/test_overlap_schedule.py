"""The overlap schedule (scheduler_proc/model/forward_worker.py) changes where a decode
forward runs and when it starts, never what a step decides: a mixed run of 1,000 requests
(greedy and seeded rows with every cut, logprobs, stop tokens, shared prefixes, a pool
small enough to retract, aborts mid-run) gives the same frames, byte for byte, with the
overlap on and off."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    AbortReq,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from scheduler_proc.decode_mode import TokenDecode
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.scheduler import Scheduler

REQUESTS = 1000


def _workload(seed: int) -> list[tuple[int, TokenizedGenerateReqInput | AbortReq]]:
    """(arrival step, message): requests arriving a few per step, every fifth sharing one
    of three prefixes; a sixth greedy, the rest seeded with top_p, top_k or min_p; a
    quarter asking for top-3 logprobs; one in 40 aborted a few steps after it arrives."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(60, 3900) for _ in range(24)] for _ in range(3)]
    out: list[tuple[int, TokenizedGenerateReqInput | AbortReq]] = []
    for i in range(REQUESTS):
        step = i // 6
        tail = [rng.randrange(60, 3900) for _ in range(rng.randrange(1, 40))]
        prompt = rng.choice(prefixes) + tail if i % 5 == 0 else tail
        kind = i % 6
        sampling = SamplingParams(
            max_new_tokens=rng.randrange(1, 30),
            temperature=0.0 if kind == 0 else rng.choice([0.5, 0.8, 1.2]),
            top_p=0.9 if kind in (1, 4) else 1.0,
            top_k=20 if kind == 2 else -1,
            min_p=0.05 if kind == 3 else 0.0,
            seed=i,
            stop_token_ids=[rng.randrange(60, 3900) for _ in range(3)] if i % 7 == 0 else [],
            ignore_eos=i % 3 != 0,
        )
        msg = TokenizedGenerateReqInput(
            rid=f"r{i}",
            req_id=i,
            input_ids=prompt,
            sampling_params=sampling,
            stream=i % 2 == 0,
            arrival_time=time.time(),
            logprobs=LogprobParams(top_logprobs_num=3) if i % 4 == 0 else None,
        )
        out.append((step, msg))
        if i % 40 == 7:
            out.append((step + rng.randrange(1, 6), AbortReq(req_id=i, reason="client left")))
    out.sort(key=lambda item: item[0])  # stable: arrival order within a step is kept
    return out


def _run(s: Scheduler, workload: list[tuple[int, Any]]) -> list[bytes]:
    """Every frame the scheduler emits over the run, encoded."""
    pending = list(workload)
    frames: list[bytes] = []
    step = 0
    encoder = msgspec.msgpack.Encoder()
    while pending or s.has_work():
        while pending and pending[0][0] <= step:
            _, msg = pending.pop(0)
            if isinstance(msg, AbortReq):
                s.abort(msg)
            else:
                s.add_request(msg)
        step += 1
        frames.extend(encoder.encode(frame) for frame in s.step())
    s.close()
    return frames


def _spy(
    monkeypatch: pytest.MonkeyPatch, owner: type, name: str, seen: Callable[[Any], None]
) -> None:
    original = getattr(owner, name)

    def spy(self: Any, *args: Any) -> Any:
        seen(self)
        return original(self, *args)

    monkeypatch.setattr(owner, name, spy)


def test_a_mixed_run_gives_the_same_frames_with_the_overlap_on_and_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    workload = _workload(seed=41)

    def build(overlap: bool) -> Scheduler:
        # No time stats (they hold wall-clock times), so equal runs encode equal bytes.
        return build_scheduler(
            ServerConfig(
                max_total_tokens=1200,
                torch_threads=1,
                enable_metrics=False,
                disable_overlap_schedule=not overlap,
            )
        )

    off = _run(build(overlap=False), workload)
    threads: set[int] = set()
    early: list[bool] = []  # per decode pass: whether its forward began before the prefill
    _spy(monkeypatch, ModelRunner, "decode", lambda _: threads.add(threading.get_ident()))
    _spy(monkeypatch, TokenDecode, "step", lambda mode: early.append(mode._started is not None))
    on = build(overlap=True)
    retractions_before = on.num_retracted_total
    got = _run(on, workload)
    # The run exercised what the overlap changes: forwards on their own thread, decode
    # forwards started before the step's prefill, and retractions.
    assert threading.get_ident() not in threads and len(threads) == 1
    assert sum(early) > 50
    assert on.num_retracted_total > retractions_before
    assert len(got) == len(off)
    for step, (a, b) in enumerate(zip(off, got)):
        assert a == b, f"frame {step} differs"
