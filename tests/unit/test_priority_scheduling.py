"""Priority scheduling (scheduler_proc/priority.py, scheduler_proc/waiting_queue.py): the
queue's order under each peer's flags, and the scheduler driven step by step (real model,
pool and cache): preemption for a running slot and for KV, no preemption between equal
priorities, displacement from a full queue."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest

from pipeline.columns import from_column, split_token_rows
from pipeline.config import SchedulingPolicy, ServerConfig
from pipeline.server_args import check_config
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    FinishAbort,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from scheduler_proc.admission import QUEUE_FULL_RETRY_AFTER, new_req
from scheduler_proc.main import build_scheduler
from scheduler_proc.priority import priority_order
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.waiting_queue import PriorityOrder, PriorityQueue

PROMPT = [(13 * i + 5) % 4000 + 50 for i in range(160)]
_ids = iter(range(1, 1_000_000))


def message(
    req_id: int, priority: int, prompt: list[int], max_new: int
) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=f"r{req_id}",
        req_id=req_id,
        input_ids=prompt,
        # Seeded sampling: the output depends on (seed, position) only, whatever the batch.
        sampling_params=SamplingParams(
            max_new_tokens=max_new, temperature=1.0, seed=req_id, ignore_eos=True
        ),
        stream=True,
        arrival_time=time.time(),
        priority=priority,
    )


def plain_req(priority: int) -> Req:
    msg = message(next(_ids), priority, PROMPT[:8], 4)
    return new_req(msg, stream_interval=1, stats_pending=StatsPending(), collect_time_stats=False)


@pytest.mark.parametrize("low_first", [True, False])
def test_queue_orders_by_priority_then_arrival_and_retracted_first_in_their_class(
    low_first: bool,
) -> None:
    q = PriorityQueue(PriorityOrder(low_first=low_first))
    a, b, c, d = plain_req(5), plain_req(1), plain_req(5), plain_req(9)
    for r in (a, b, c, d):
        q.append(r)
    retracted = [plain_req(5), plain_req(5)]
    for r in reversed(retracted):  # as retract_all puts them back: in the order they had
        q.appendleft(r)
    fives = [*retracted, a, c]
    expected = [b, *fives, d] if low_first else [d, *fives, b]
    assert list(q) == expected and q[0] is expected[0] and len(q) == 6
    q.remove(c)
    assert c not in q and a in q and q.popleft() is expected[0]


def test_each_peers_flags_give_their_order() -> None:
    def order(**flags: object) -> PriorityOrder | None:
        return priority_order(ServerConfig(**flags))  # type: ignore[arg-type]

    assert order() is None  # fcfs: a deque, no priorities
    assert order(scheduling_policy="priority") == PriorityOrder(low_first=True)  # vLLM
    assert order(enable_priority_scheduling=True) == PriorityOrder(low_first=False)  # SGLang
    assert order(
        enable_priority_scheduling=True, schedule_low_priority_values_first=True
    ) == PriorityOrder(low_first=True)


def scheduler(**flags: object) -> Scheduler:
    defaults: dict[str, object] = {"max_total_tokens": 4096, "chunked_prefill_size": 256}
    config = ServerConfig(
        torch_threads=1,
        scheduling_policy="priority",
        **{**defaults, **flags},  # type: ignore[arg-type]
    )
    return build_scheduler(config)


def steps(s: Scheduler) -> Iterator[tuple[int, list[int], object]]:
    """Runs ``s`` to the end: (step number, req_id's new tokens, finish reason) per row."""
    step = 0
    while s.has_work():
        step += 1
        for frame in s.step():
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type(frame))
            assert isinstance(frame, BatchTokenIDOutput)
            reasons = frame.finished_reasons or [None] * len(frame.output_counts)
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            for req_id, row, reason in zip(
                from_column(frame.req_ids, REQ_ID_DTYPE).tolist(), rows, reasons
            ):
                yield step, [req_id, *row], reason


def outputs(s: Scheduler) -> tuple[dict[int, list[int]], dict[int, int], dict[int, int]]:
    """Tokens, the step of the first token, and the step of the finish of each req_id."""
    tokens: dict[int, list[int]] = {}
    first: dict[int, int] = {}
    finished: dict[int, int] = {}
    for step, (req_id, *row), reason in steps(s):
        tokens.setdefault(req_id, []).extend(row)
        if row:
            first.setdefault(req_id, step)
        if reason is not None:
            assert not isinstance(reason, FinishAbort), reason
            finished[req_id] = step
    return tokens, first, finished


def solo(req_id: int, prompt: list[int], max_new: int) -> list[int]:
    s = scheduler()
    s.add_request(message(req_id, 10, prompt, max_new))
    return outputs(s)[0][req_id]


def test_a_higher_arrival_takes_the_slot_of_the_latest_lower_one_at_the_next_step() -> None:
    s = scheduler(max_running_requests=2)
    s.add_request(message(1, 10, PROMPT[:20], 40))
    s.add_request(message(2, 10, PROMPT[20:40], 40))
    s.step()
    for req_id in range(3, 7):  # four wait: equal priorities never preempt
        s.add_request(message(req_id, 10, PROMPT[40 + 5 * req_id : 50 + 5 * req_id], 4))
    s.step()
    assert s.num_retracted_total == 0 and [r.req_id for r in s.waiting] == [3, 4, 5, 6]
    s.add_request(message(7, 0, PROMPT[100:110], 4))
    s.step()  # the next step admits 7, retracting 2 (the later of the two)
    assert sorted(r.req_id for r in s.running) == [1, 7] and s.num_retracted_total == 1
    assert [r.req_id for r in s.waiting] == [2, 3, 4, 5, 6]  # 2 first in its class
    assert s.live[2].retraction_count == 1 and s.live[1].retraction_count == 0
    tokens, first, finished = outputs(s)
    # 7 finished before any of the four waiting produced a token; nothing else was retracted.
    assert all(first[w] > finished[7] for w in range(3, 7)), (first, finished)
    assert s.num_retracted_total == 1 and sorted(finished) == list(range(1, 8))
    # The victim's seeded output is its uninterrupted run's.
    # (Its tokens from here on: the first steps' frames went unread.)
    assert len(tokens[2]) > 30 and tokens[2] == solo(2, PROMPT[20:40], 40)[-len(tokens[2]) :]


def test_a_higher_arrival_that_finds_no_kv_retracts_a_lower_running_request() -> None:
    # 2 x (150 prompt + 60 output) nearly fill a 400-token pool: the third prompt does not fit.
    s = scheduler(max_running_requests=8, max_total_tokens=400)
    s.add_request(message(1, 5, PROMPT[:150], 60))
    s.add_request(message(2, 5, list(reversed(PROMPT[:150])), 60))
    s.step()
    s.step()
    s.add_request(message(3, 5, PROMPT[5:155], 4))  # equal: it waits for KV
    s.step()
    assert [r.req_id for r in s.waiting] == [3] and s.num_retracted_total == 0
    s.add_request(message(4, 1, PROMPT[10:160], 4))
    s.step()
    assert s.live[4] in s.running and s.live[2].retraction_count == 1
    assert s.num_retracted_total == 1
    assert [r.req_id for r in s.waiting] == [2, 3]  # back at the front of its class
    tokens, _, finished = outputs(s)
    # (2 may be retracted again for the pool, as any request: the usual retraction.)
    assert sorted(finished) == [1, 2, 3, 4]
    solo_run = solo(2, list(reversed(PROMPT[:150])), 60)
    assert len(tokens[2]) > 50 and tokens[2] == solo_run[-len(tokens[2]) :]


def test_a_full_queue_gives_its_lowest_waiting_request_up_to_a_higher_arrival_only() -> None:
    s = scheduler(max_running_requests=1, max_queued_requests=2)
    s.add_request(message(1, 5, PROMPT[:20], 30))
    s.step()
    s.add_request(message(2, 5, PROMPT[20:40], 4))
    s.add_request(message(3, 5, PROMPT[40:60], 4))
    s.add_request(message(4, 1, PROMPT[60:80], 4))  # displaces 3, the later of the lowest
    s.add_request(message(5, 1, PROMPT[80:100], 4))  # displaces 2
    s.add_request(message(6, 1, PROMPT[100:120], 4))  # equal to every waiting one: refused
    s.add_request(message(7, 9, PROMPT[120:140], 4))  # lower: refused
    assert [r.req_id for r in s.waiting] == [4, 5]
    reasons = {req_id: reason for _, (req_id, *_), reason in steps(s) if reason is not None}
    messages = {}
    for req_id in (2, 3, 6, 7):
        refused = reasons[req_id]
        assert isinstance(refused, FinishAbort) and refused.status_code == 503
        assert refused.retry_after == QUEUE_FULL_RETRY_AFTER
        messages[req_id] = refused.message
    assert "gave its place to one of higher priority" in messages[3]
    assert "the waiting queue is full (2 requests" in messages[6]
    assert not any(isinstance(reasons[r], FinishAbort) for r in (1, 4, 5))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_retraction_for_the_pool_takes_the_lowest_priority(policy: SchedulingPolicy) -> None:
    """Two requests outgrow the pool: FCFS retracts the later (fewest output tokens, its usual
    order); priority scheduling the lower priority, which joined first."""
    config = ServerConfig(
        max_total_tokens=300, chunked_prefill_size=256, torch_threads=1, scheduling_policy=policy
    )
    s = build_scheduler(config)
    lower, higher = (5, 1) if policy == "priority" else (0, 0)
    s.add_request(message(1, lower, PROMPT[:100], 90))
    s.step()
    s.add_request(message(2, higher, PROMPT[50:150], 90))  # fits: nothing preempted
    while s.num_retracted_total == 0:
        s.step()
    victim = 1 if policy == "priority" else 2
    assert s.live[victim].retraction_count == 1 and s.live[3 - victim].retraction_count == 0
    assert sorted(outputs(s)[2]) == [1, 2]


def test_the_two_peers_priority_orders_cannot_both_be_asked_for() -> None:
    both = ServerConfig(scheduling_policy="priority", enable_priority_scheduling=True)
    with pytest.raises(ValueError, match="give one"):
        check_config(both)
    check_config(
        ServerConfig(**{**msgspec.structs.asdict(both), "schedule_low_priority_values_first": True})
    )
