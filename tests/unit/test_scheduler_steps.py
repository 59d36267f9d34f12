"""The scheduler driven step by step in-process (real model, real KV pool, real cache)."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from pipeline.config import ServerConfig
from pipeline.control_frames import AbortResult
from pipeline.io_struct import (
    EMBEDDING_DTYPE,
    REQ_ID_DTYPE,
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    FinishAbort,
    FinishLength,
    FinishReason,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.request_limits import MAX_STOP_TOKEN_IDS
from pipeline.worker_ids import WORKER_SHIFT
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler

PROMPT = [(13 * i + 5) % 4000 + 50 for i in range(160)]


def make(chunk: int, pool: int = 4096) -> Scheduler:
    return build_scheduler(
        ServerConfig(max_total_tokens=pool, chunked_prefill_size=chunk, torch_threads=1)
    )


def submit(
    s: Scheduler, req_id: int, ids: list[int], max_new: int = 12, stream: bool = True
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=ids,
            sampling_params=SamplingParams(
                max_new_tokens=max_new, temperature=0.0, ignore_eos=True
            ),
            stream=stream,
            arrival_time=time.time(),
        )
    )


def run_to_end(s: Scheduler) -> tuple[dict[int, list[int]], list[int]]:
    """Tokens per req_id, and the step numbers at which each row was emitted."""
    tokens: dict[int, list[int]] = {}
    emitted_at: list[int] = []
    step = 0
    while s.has_work():
        step += 1
        for frame in s.step():
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=type(frame))
            for rid, row in zip(
                from_column(frame.req_ids, REQ_ID_DTYPE).tolist(),
                split_token_rows(frame.output_ids, frame.output_counts),
            ):
                tokens.setdefault(rid, []).extend(row)
                emitted_at.append(step)
    return tokens, emitted_at


def assert_no_kv_leak(s: Scheduler) -> None:
    assert s.kv.num_used == s.cache.total_size, "a request's KV slots outlived it"
    assert s.cache.protected_size == 0 and not s.live


def test_chunked_prefill_equals_unchunked() -> None:
    chunked, whole = make(chunk=32), make(chunk=-1)
    submit(chunked, 1, PROMPT)
    submit(whole, 1, PROMPT)
    out_chunked, emitted = run_to_end(chunked)
    out_whole, _ = run_to_end(whole)
    assert out_chunked == out_whole and len(out_chunked[1]) == 12
    # 160 tokens in chunks of 32: no row until the fifth prefill step.
    assert emitted[0] == 5
    assert_no_kv_leak(chunked)


def test_chunked_prefill_interleaves_with_decode() -> None:
    s = make(chunk=32)
    submit(s, 1, PROMPT[:8], max_new=20)
    s.step()  # request 1 is decoding now
    submit(s, 2, PROMPT)
    decoding_rows = 0
    while True:
        frames = s.step()
        rows = from_column(frames[0].req_ids, REQ_ID_DTYPE).tolist() if frames else []
        decoding_rows += rows.count(1)
        if any(r.req_id == 2 for r in s.prefilling):
            assert 2 not in rows, "a request mid-prefill emitted a row"
        else:
            assert 2 in rows, "the step that completes the prefill emits the first token"
            break
    assert decoding_rows >= 4, (
        "decode of request 1 should continue while request 2 prefills in chunks"
    )
    run_to_end(s)
    assert_no_kv_leak(s)


def test_abort_mid_chunk_frees_its_kv() -> None:
    s = make(chunk=32)
    submit(s, 1, PROMPT)
    s.step()
    assert s.prefilling and s.kv.num_used > 0
    s.abort(AbortReq(req_id=1, reason="test"))
    frames = s.step()
    assert frames and isinstance(frames[0].finished_reasons[0], FinishAbort)  # type: ignore[index]
    assert frames[0].request_stats is not None and frames[0].request_stats[0] is not None
    assert not s.has_work()
    assert_no_kv_leak(s)


def test_retraction_under_pressure_leaves_no_leak() -> None:
    s = make(chunk=64, pool=600)
    for i in range(8):
        submit(s, i + 1, [100 + i] * 20 + PROMPT[:20], max_new=60)
    out, _ = run_to_end(s)
    assert s.num_retracted_total > 0
    assert all(len(v) == 60 for v in out.values()) and len(out) == 8
    assert_no_kv_leak(s)


def embed(s: Scheduler, req_id: int, ids: list[int]) -> tuple[np.ndarray, object]:
    s.add_request(
        TokenizedEmbeddingReqInput(
            rid=f"e{req_id}", req_id=req_id, input_ids=ids, arrival_time=time.time()
        )
    )
    frames = []
    while s.has_work():
        frames += [f for f in s.step() if isinstance(f, BatchEmbeddingOutput)]
    assert len(frames) == 1
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frames[0]), type=BatchEmbeddingOutput)
    return from_column(frame.embeddings, EMBEDDING_DTYPE).reshape(frame.shape)[
        0
    ], frame.request_stats[0]


def test_embedding_pools_the_same_chunked_or_not() -> None:
    chunked, whole = make(chunk=32), make(chunk=-1)
    a, stats = embed(chunked, 1, PROMPT)
    b, _ = embed(whole, 1, PROMPT)
    assert np.allclose(a, b, atol=1e-5)
    assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5
    assert (
        stats is not None
        and stats.prompt_tokens == len(PROMPT)  # type: ignore[attr-defined]
        and stats.cached_tokens == 0  # type: ignore[attr-defined]
    )
    c, _ = embed(whole, 2, PROMPT[:80])
    assert not np.allclose(a, c, atol=1e-3), "different inputs should embed differently"
    assert_no_kv_leak(whole)


def _finished_stats(s: Scheduler) -> dict[int, object]:
    out = {}
    while s.has_work():
        for frame in s.step():
            if frame.request_stats is None or frame.finished_reasons is None:
                continue
            for rid, st, reason in zip(
                from_column(frame.req_ids, REQ_ID_DTYPE).tolist(),
                frame.request_stats,
                frame.finished_reasons,
            ):
                if reason is not None:
                    out[rid] = st
    return out


def test_a_request_aborted_while_it_waits_keeps_its_queue_time() -> None:
    """With one running slot, B waits behind A; aborted in the queue, its stats still count
    the stay (once 0.0: the abort never closed the open stay)."""
    s = build_scheduler(
        ServerConfig(max_total_tokens=4096, max_running_requests=1, torch_threads=1)
    )
    submit(s, 1, PROMPT[:20], max_new=40)
    submit(s, 2, PROMPT[20:40])
    entered = time.time()
    for _ in range(3):
        s.step()
    time.sleep(0.05)
    s.abort(AbortReq(req_id=2))
    waited = time.time() - entered
    stats = _finished_stats(s)
    ts = stats[2].time_stats  # type: ignore[attr-defined]
    assert 0.05 <= ts.queue_time <= waited + 0.01
    assert ts.forward_entry_time is None, "it never left the queue for a forward pass"


def test_abort_by_rid_and_by_worker_stop_only_what_they_name() -> None:
    """--api-workers: a worker aborts another worker's request by rid (with an answer), and
    a restarting worker aborts only its own requests."""
    s = make(chunk=64)
    w0, w1 = 7, (1 << WORKER_SHIFT) + 7  # the same counter value in workers 0 and 1
    for req_id in (w0, w0 + 1, w1, w1 + 1):
        submit(s, req_id, PROMPT[:20], max_new=50)
    s.step()

    answer = s.abort(AbortReq(rid=f"r{w1}", reason="by rid", control_id=(1 << WORKER_SHIFT) + 3))
    assert answer == AbortResult(control_id=(1 << WORKER_SHIFT) + 3, aborted=1)
    assert s.abort(AbortReq(rid="no-such-rid", control_id=9)) == AbortResult(
        control_id=9, aborted=0
    )
    assert s.abort(AbortReq(abort_all=True, worker=0, reason="restart")) is None
    assert sorted(s.live) == [w1 + 1]

    finished: dict[int, str] = {}
    for frame in s.step():
        reasons = frame.finished_reasons or []
        for req_id, reason in zip(from_column(frame.req_ids, REQ_ID_DTYPE).tolist(), reasons):
            if isinstance(reason, FinishAbort):
                finished[req_id] = reason.message
    assert finished == {w1: "by rid", w0: "restart", w0 + 1: "restart"}
    s.abort(AbortReq(abort_all=True))
    s.step()
    assert not s.has_work()
    assert_no_kv_leak(s)


def _finishes(frames: list[BatchTokenIDOutput | BatchEmbeddingOutput]) -> dict[int, FinishReason]:
    out: dict[int, FinishReason] = {}
    for frame in frames:
        if isinstance(frame, BatchTokenIDOutput):
            for req_id, reason in zip(
                from_column(frame.req_ids, REQ_ID_DTYPE).tolist(), frame.finished_reasons or []
            ):
                if reason is not None:
                    out[req_id] = reason
    return out


def submit_sampling(
    s: Scheduler, req_id: int, sampling: SamplingParams, rid: str | None = None
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=rid if rid is not None else f"r{req_id}",
            req_id=req_id,
            input_ids=PROMPT[:20],
            sampling_params=sampling,
            stream=True,
            arrival_time=time.time(),
        )
    )


def test_the_stop_table_narrows_when_its_widest_request_leaves() -> None:
    """One request with many stop ids widens the running batch's stop table for its stay
    only: once it leaves, every stop check reads no more than the others need. (Ids past
    the vocabulary: never drawn, so no request stops on one.)"""
    s = make(chunk=64)
    submit_sampling(
        s,
        1,
        SamplingParams(
            max_new_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=(5000, 5001, 5002)
        ),
    )
    wide = tuple(range(6000, 6000 + MAX_STOP_TOKEN_IDS))
    submit_sampling(
        s,
        2,
        SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True, stop_token_ids=wide),
    )
    s.step()
    assert isinstance(s.running, RunningBatch) and len(s.running) == 2
    assert s.running.stop_ids.shape[1] == MAX_STOP_TOKEN_IDS
    while 2 not in _finishes(s.step()):
        pass
    assert [r.req_id for r in s.running] == [1]
    assert s.running.stop_ids.shape[1] == 3
    assert s.running.stop_ids[0, :3].tolist() == [5000, 5001, 5002]
    run_to_end(s)
    assert_no_kv_leak(s)


def test_more_stop_ids_than_the_limit_are_refused_with_a_400() -> None:
    s = make(chunk=64)
    too_many = tuple(range(MAX_STOP_TOKEN_IDS + 1))
    submit_sampling(s, 1, SamplingParams(max_new_tokens=4, stop_token_ids=too_many))
    reason = _finishes(s.step())[1]
    assert (
        isinstance(reason, FinishAbort)
        and reason.status_code == 400
        and "stop_token_ids" in reason.message
    ), reason
    assert not s.has_work()


def test_a_duplicate_live_rid_is_refused_with_a_400_naming_it() -> None:
    """--api-workers: each worker checks only its own rids, so two workers may send the
    same live rid; the scheduler sees them all. A refused duplicate leaves the live one
    (and its rid) alone, and once that one is gone the rid is free again."""
    s = make(chunk=64)
    other_worker = (1 << WORKER_SHIFT) + 1
    submit_sampling(
        s, 1, SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True), rid="same"
    )
    s.step()
    for req_id in (other_worker, 2):  # from another worker, then from the same one
        submit_sampling(s, req_id, SamplingParams(max_new_tokens=20), rid="same")
        finished = _finishes(s.step())
        reason = finished[req_id]
        assert isinstance(reason, FinishAbort) and reason.status_code == 400, reason
        assert (
            reason.message
            == "Duplicate request ID detected: same (a request with rid 'same' is already running)"
        )
        assert 1 not in finished and 1 in s.live
    rest: dict[int, FinishReason] = {}
    while s.has_work():
        rest |= _finishes(s.step())
    assert rest == {1: FinishLength(length=20)}
    submit_sampling(
        s, 3, SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True), rid="same"
    )
    tokens, _ = run_to_end(s)
    assert len(tokens[3]) == 2 and not s.live_rids
    assert_no_kv_leak(s)
