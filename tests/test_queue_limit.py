"""--max-queued-requests: the scheduler's waiting queue is bounded; a request that finds it
full is refused at once (503, Retry-After), and nothing admitted or queued is affected."""

from __future__ import annotations

import msgspec

from pipeline.config import ServerConfig
from pipeline.io_struct import REQ_ID_DTYPE, FinishAbort, FinishLength, from_column
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import QUEUE_FULL_RETRY_AFTER, Scheduler
from tests.test_scheduler_steps import PROMPT, run_to_end, submit

MAX_NEW = 12


def finishes(s: Scheduler) -> dict[int, object]:
    """One step's finish reasons by req_id, read back through the wire codec."""
    out: dict[int, object] = {}
    for frame in s.step():
        frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type(frame))
        for req_id, reason in zip(from_column(frame.req_ids, REQ_ID_DTYPE).tolist(), frame.finished_reasons or []):
            if reason is not None:
                out[req_id] = reason
    return out


def test_scheduler_refuses_the_request_beyond_the_queue_bound() -> None:
    s = build_scheduler(ServerConfig(max_total_tokens=4096, chunked_prefill_size=256, torch_threads=1, max_queued_requests=2))
    submit(s, 1, PROMPT[:40], MAX_NEW)
    submit(s, 2, PROMPT[40:80], MAX_NEW)
    submit(s, 3, PROMPT[80:120], MAX_NEW)  # the queue holds 2: refused before any step
    assert [r.req_id for r in s.waiting] == [1, 2] and s.num_waiting == 2 and 3 not in s.live
    refused = finishes(s)[3]
    assert isinstance(refused, FinishAbort)
    assert refused.status_code == 503 and refused.retry_after == QUEUE_FULL_RETRY_AFTER
    assert "waiting queue is full (2 requests wait" in refused.message
    # The queued ones were admitted by that step (its prefill gave their first token) and
    # run to the end: every other token follows.
    tokens, _ = run_to_end(s)
    assert {rid: len(ids) for rid, ids in tokens.items()} == {1: MAX_NEW - 1, 2: MAX_NEW - 1}


def test_scheduler_queue_room_frees_as_requests_are_admitted() -> None:
    s = build_scheduler(ServerConfig(max_total_tokens=4096, chunked_prefill_size=256, torch_threads=1, max_queued_requests=1))
    submit(s, 1, PROMPT[:40], MAX_NEW)
    reasons = finishes(s)  # admits 1: the queue is empty again
    assert not reasons and s.num_waiting == 0
    submit(s, 2, PROMPT[40:80], MAX_NEW)
    submit(s, 3, PROMPT[80:120], MAX_NEW)
    reasons = {}
    while s.has_work():
        reasons.update(finishes(s))
    assert isinstance(reasons[1], FinishLength) and isinstance(reasons[2], FinishLength)
    assert isinstance(reasons[3], FinishAbort) and reasons[3].retry_after is not None


def test_scheduler_without_a_bound_queues_everything() -> None:
    s = build_scheduler(ServerConfig(max_total_tokens=4096, chunked_prefill_size=256, torch_threads=1))
    for req_id in range(1, 9):
        submit(s, req_id, PROMPT[:40], 2)
    assert s.num_waiting == 8
