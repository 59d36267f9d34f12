"""When stats travel (docs/design.md section 3): ``take_request_stats_due`` on the Req, and
``update_request_stats`` / row dropping on the tokenizer manager side."""

from __future__ import annotations

import logging

import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    BatchStrOutput,
    BatchTokenIDOutput,
    FinishLength,
    RequestOutputStats,
    SamplingParams,
)
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.output_builder import build_token_output
from scheduler_proc.req import Req, StatsPending
from tokenizer_proc.request_edge.meta_info import build_meta_info
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager


# The requests of these in-process tests share one stats-pending set, as one scheduler's do.
PENDING = StatsPending()


def make_req(
    req_id: int = 1, *, stream: bool = True, interval: int = 1, metrics: bool = True
) -> Req:
    return Req(
        rid=f"r{req_id}",
        req_id=req_id,
        input_ids=[5, 6, 7],
        sampling=SamplingParams(max_new_tokens=100),
        stream=stream,
        stream_interval=interval,
        arrival_time=0.0,
        stats_pending=PENDING,
        collect_time_stats=metrics,
    )


def test_stats_due_on_first_output_then_not_again() -> None:
    req = make_req()
    first = req.take_request_stats_due()
    assert first is not None and first.prompt_tokens == 3
    for _ in range(5):
        assert req.take_request_stats_due() is None


def test_stats_resent_after_each_retraction_once() -> None:
    req = make_req()
    assert req.take_request_stats_due() is not None
    for n in (1, 2, 3):
        req.mark_retracted(now=float(n))
        stats = req.take_request_stats_due()
        assert stats is not None and stats.num_retractions == n
        assert req.request_stats_retraction_count == n
        assert req.take_request_stats_due() is None


def test_stats_due_on_finished_row_even_when_unchanged() -> None:
    req = make_req(metrics=False)
    assert req.take_request_stats_due() is not None
    assert req.take_request_stats_due() is None
    req.finish(FinishLength(length=3))
    assert req.take_request_stats_due() is not None


def test_epoch_bump_sends_exactly_once() -> None:
    req = make_req()
    req.take_request_stats_due()
    req.update_stats(cached_tokens=2)
    stats = req.take_request_stats_due()
    assert stats is not None and stats.cached_tokens == 2
    assert req.take_request_stats_due() is None


def test_changes_before_first_output_cost_no_extra_send() -> None:
    req = make_req()
    req.leave_waiting_queue(now=1.0)
    req.update_time_stats(prefill_finished_time=2.0)
    sends = [req.take_request_stats_due() for _ in range(4)]
    assert sends[0] is not None and sends[1:] == [None, None, None]
    assert sends[0].time_stats is not None and sends[0].time_stats.prefill_finished_time == 2.0


def test_sent_stats_object_never_changes_afterwards() -> None:
    req = make_req()
    sent = req.take_request_stats_due()
    req.mark_retracted(now=5.0)
    assert sent is not None and sent.num_retractions == 0


def test_queue_time_sums_every_stay() -> None:
    req = make_req()
    req.enter_waiting_queue(10.0)
    req.leave_waiting_queue(11.5)
    req.mark_retracted(20.0)
    req.leave_waiting_queue(22.0)
    assert req.stats.time_stats is not None and req.stats.time_stats.queue_time == pytest.approx(
        3.5
    )
    assert req.stats.time_stats.forward_entry_time == 11.5


def test_frame_rows_carry_stats_only_when_due() -> None:
    reqs = [make_req(i) for i in range(1, 4)]
    for r in reqs:
        r.output_ids.append(100 + r.req_id)
    frame = build_token_output(reqs, PENDING)
    assert frame.request_stats is not None and all(s is not None for s in frame.request_stats)
    for r in reqs:
        r.output_ids.append(200 + r.req_id)
    frame = build_token_output(reqs, PENDING)
    assert frame.request_stats is None and frame.finished_reasons is None
    reqs[1].mark_retracted(1.0)
    for r in reqs:
        r.output_ids.append(300 + r.req_id)
    frame = build_token_output(reqs, PENDING)
    assert frame.request_stats is not None
    assert [s is not None for s in frame.request_stats] == [False, True, False]
    # The frame survives the wire with its typed stats intact.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
    assert again.request_stats == frame.request_stats


def test_stream_interval_batches_tokens_into_one_row() -> None:
    req = make_req(interval=3)
    emitted = []
    for t in range(7):
        req.output_ids.append(t)
        if req.output_due():
            emitted.append(list(req.output_ids[req.num_sent_tokens :]))
            build_token_output([req], PENDING)
    assert emitted == [[0], [1, 2, 3], [4, 5, 6]]


# --- tokenizer manager side ------------------------------------------------------------


@pytest.fixture()
def manager() -> TokenizerManager:
    config = ServerConfig(scheduler_input="ipc:///unused", tokenizer_input="ipc:///unused")
    return TokenizerManager(config, load_tokenizer(None), context_length=2048)


def _state(tm: TokenizerManager, req_id: int) -> ReqState:
    state = ReqState(
        rid=f"r{req_id}", req_id=req_id, stream=True, sampling=SamplingParams(), created_time=0.0
    )
    tm.states[req_id] = state
    tm.rid_to_req_id[state.rid] = req_id
    return state


def _str_frame(reqs: list[Req]) -> BatchStrOutput:
    tok = build_token_output(reqs, PENDING)
    return BatchStrOutput(
        req_ids=tok.req_ids,
        text_deltas=["x"] * len(reqs),
        output_ids=tok.output_ids,
        output_counts=tok.output_counts,
        completion_tokens=tok.completion_tokens,
        finished_reasons=tok.finished_reasons,
        request_stats=tok.request_stats,
    )


def test_update_request_stats_keeps_latest(manager: TokenizerManager) -> None:
    state = _state(manager, 1)
    req = make_req(1)
    req.output_ids.append(9)
    manager.handle_output(_str_frame([req]))
    assert state.request_stats is not None and state.request_stats.num_retractions == 0
    req.output_ids.append(10)
    manager.handle_output(_str_frame([req]))  # no stats on this row: the old ones stay
    assert state.request_stats.num_retractions == 0
    req.mark_retracted(1.0)
    req.output_ids.append(11)
    manager.handle_output(_str_frame([req]))
    assert state.request_stats.num_retractions == 1
    assert state.completion_tokens == 3


def test_events_taken_together_each_show_their_own_rows_stats(manager: TokenizerManager) -> None:
    """Rows that pile up before the stream generator runs (a busy API process) become
    several events sent at once: each event's meta_info shows the stats of its own row, not
    the newest ones (a dLLM request's cached_tokens grows with each block)."""
    state = _state(manager, 4)
    req = make_req(4)
    for block in range(3):
        req.output_ids.append(100 + block)
        req.update_stats(cached_tokens=10 * (block + 1))
        manager.handle_output(_str_frame([req]))
    chunks = state.take_pending()
    assert [c.completion_tokens for c in chunks] == [1, 2, 3]
    assert [build_meta_info(state, c)["cached_tokens"] for c in chunks] == [10, 20, 30]
    assert build_meta_info(state)["cached_tokens"] == 30


def test_row_without_state_is_dropped_with_warning(
    manager: TokenizerManager, caplog: pytest.LogCaptureFixture
) -> None:
    live = _state(manager, 2)
    orphan, known = make_req(77), make_req(2)
    for r in (orphan, known):
        r.output_ids.append(1)
    with caplog.at_level(logging.WARNING, logger="tokenpipe.tokenizer_manager"):
        manager.handle_output(_str_frame([orphan, known]))
    assert "req_id 77" in caplog.text
    assert [c.text for c in live.pending] == ["x"] and live.completion_tokens == 1


def test_row_before_any_stats_is_dropped(
    manager: TokenizerManager, caplog: pytest.LogCaptureFixture
) -> None:
    state = _state(manager, 3)
    req = make_req(3)
    req.take_request_stats_due()  # stats "sent" on a frame this manager never saw
    req.output_ids.append(1)
    with caplog.at_level(logging.WARNING, logger="tokenpipe.tokenizer_manager"):
        manager.handle_output(_str_frame([req]))
    assert "no stats yet" in caplog.text and state.completion_tokens == 0


def test_request_output_stats_is_frozen() -> None:
    stats = RequestOutputStats(prompt_tokens=1)
    with pytest.raises(AttributeError):
        stats.prompt_tokens = 2  # type: ignore[misc]
