"""PD disaggregation between two in-process schedulers (real model, real pools, the real
ZeroMQ KV transfer over ipc): the decode side's output equals a unified scheduler's,
a decode-side retraction re-bootstraps with the prefill side's new cached tokens on the
next row, and a failed or silent peer fails the request instead of hanging it."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    FinishAbort,
    FrameLogprobs,
    KVFetch,
    KVTransferHeader,
    LogprobParams,
    RequestOutputStats,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import (
    TokenLogprobs,
    build_input_logprobs,
    build_output_logprobs,
    read_input_token_logprobs,
    read_token_logprobs,
)
from scheduler_proc.retraction import retract
from scheduler_proc.main import attach_pd, build_scheduler
from scheduler_proc.pd.decode import DecodeBootstrapper
from scheduler_proc.pd.prefill import PrefillKVSender
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.scheduler import Scheduler

PROMPTS = [[(7 * i + 3 * j) % 3000 + 60 for i in range(24 + 5 * j)] for j in range(4)]
MAX_NEW = 40


class Row(msgspec.Struct):
    tokens: list[int]
    stats: RequestOutputStats | None
    finished: object
    logprobs: TokenLogprobs | None = None  # of this row's tokens
    prompt_logprobs: TokenLogprobs | None = None


def make(
    mode: str, tmp: Path, *, pool: int = 4096, timeout: float = 10.0
) -> tuple[Scheduler, zmq.Context]:  # type: ignore[type-arg]
    config = ServerConfig(
        max_total_tokens=pool,
        chunked_prefill_size=64,
        torch_threads=1,
        disaggregation_mode=mode,  # type: ignore[arg-type]
        disaggregation_bootstrap_endpoint=f"ipc://{tmp / 'kv'}",
        disaggregation_bootstrap_timeout=timeout,
    )
    s = build_scheduler(config)
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    attach_pd(s, config, ctx, zmq.Poller())
    return s, ctx


def prefill_side(s: Scheduler) -> PrefillKVSender:
    assert isinstance(s.pd, PrefillKVSender)
    return s.pd


def decode_side(s: Scheduler) -> DecodeBootstrapper:
    assert isinstance(s.pd, DecodeBootstrapper)
    return s.pd


GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(
    max_new_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True
)


def submit(
    s: Scheduler,
    req_id: int,
    ids: list[int],
    *,
    room: int | None = None,
    endpoint: str | None = None,
    max_new: int = MAX_NEW,
    sampling: SamplingParams = GREEDY,
    logprobs: LogprobParams | None = None,
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=ids,
            sampling_params=msgspec.structs.replace(sampling, max_new_tokens=max_new),
            stream=True,
            arrival_time=time.time(),
            bootstrap_room=room,
            bootstrap_endpoint=endpoint,
            logprobs=logprobs,
        )
    )


def collect(frames: list[object], into: dict[int, list[Row]]) -> None:
    for frame in frames:
        assert isinstance(frame, BatchTokenIDOutput)
        frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
        ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
        rows = split_token_rows(frame.output_ids, frame.output_counts)
        lp = frame.logprobs
        output = (
            read_token_logprobs(lp.output, [len(r) for r in rows])
            if lp is not None and lp.output is not None
            else {}
        )
        prompt = (
            read_input_token_logprobs(lp.input, len(ids))
            if lp is not None and lp.input is not None
            else {}
        )
        for i, req_id in enumerate(ids):
            stats = frame.request_stats[i] if frame.request_stats is not None else None
            finished = frame.finished_reasons[i] if frame.finished_reasons is not None else None
            into.setdefault(req_id, []).append(
                Row(rows[i], stats, finished, output.get(i), prompt.get(i))
            )


def run(
    schedulers: list[Scheduler], out: dict[int, list[Row]], until: float = 60.0, on_step=None
) -> None:  # type: ignore[no-untyped-def]
    """Steps every scheduler until none has live requests (the KV travels over sockets, so
    an idle-looking decode side may still wait for a transfer)."""
    deadline = time.monotonic() + until
    while any(s.live for s in schedulers):
        assert time.monotonic() < deadline, "PD requests did not finish"
        for s in schedulers:
            frames = s.step()
            if isinstance(s.pd, DecodeBootstrapper):
                collect(frames, out)
        if on_step is not None:
            on_step()
        time.sleep(0.001)


def unified_outputs(sampling: SamplingParams = GREEDY) -> dict[int, list[int]]:
    s = build_scheduler(
        ServerConfig(max_total_tokens=4096, chunked_prefill_size=64, torch_threads=1)
    )
    for j, ids in enumerate(PROMPTS):
        submit(s, j + 1, ids, sampling=sampling)
    out: dict[int, list[Row]] = {}
    while s.has_work():
        collect(s.step(), out)
    return {req_id: [t for row in rows for t in row.tokens] for req_id, rows in out.items()}


@pytest.fixture(scope="module")
def expected() -> dict[int, list[int]]:
    return unified_outputs()


def test_decode_output_equals_unified_and_carries_prefill_stats(
    tmp_path: Path, expected: dict[int, list[int]]
) -> None:
    prefill, _ = make("prefill", tmp_path)
    decode, _ = make("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    out: dict[int, list[Row]] = {}
    # Same prompt twice on the prefill side: the second prefill is served from its cache.
    for j, ids in enumerate(PROMPTS + [PROMPTS[0]]):
        room = 1000 + j
        submit(prefill, j + 1, ids, room=room, max_new=1)
        submit(decode, j + 1, ids, room=room, endpoint=endpoint)
        run([prefill, decode], out)
    for j in range(len(PROMPTS)):
        rows = out[j + 1]
        assert [t for row in rows for t in row.tokens] == expected[j + 1]
        first = rows[0].stats
        assert first is not None and first.prompt_tokens == len(PROMPTS[j])
        ts = first.time_stats
        assert (
            ts is not None
            and ts.bootstrap_done_time is not None
            and ts.decode_prebuilt_finish_time is not None
        )
        assert ts.bootstrap_done_time <= ts.decode_prebuilt_finish_time
        assert all(row.stats is None for row in rows[1:-1]), "a steady decode row carried stats"
    again = out[len(PROMPTS) + 1]
    assert [t for row in again for t in row.tokens] == expected[1]
    assert out[1][0].stats.cached_tokens == 0  # type: ignore[union-attr]
    assert again[0].stats.cached_tokens == len(PROMPTS[0]) - 1  # type: ignore[union-attr]
    assert decode.kv.num_used == 0, "the decode side kept KV after its requests finished"
    assert prefill_side(prefill).num_held == 0


def test_seeded_sampling_through_pd_equals_unified(tmp_path: Path) -> None:
    """The prefill server draws the first token; the decode side draws the rest, each at
    its output index with the request's seed, so every token is the one a unified server
    draws."""
    expected = unified_outputs(SEEDED)
    prefill, _ = make("prefill", tmp_path)
    decode, _ = make("decode", tmp_path)
    out: dict[int, list[Row]] = {}
    for j, ids in enumerate(PROMPTS):
        submit(prefill, j + 1, ids, room=3000 + j, max_new=1, sampling=SEEDED)
        submit(
            decode, j + 1, ids, room=3000 + j, endpoint=f"ipc://{tmp_path / 'kv'}", sampling=SEEDED
        )
    run([prefill, decode], out)
    assert {k: [t for row in rows for t in row.tokens] for k, rows in out.items()} == expected
    assert expected != unified_outputs(GREEDY)  # the seed mattered


def fake_prefill_fetches(
    decode: Scheduler, peer: zmq.Socket, count: int, out: dict[int, list[Row]]
) -> Iterator[tuple[bytes, int]]:  # type: ignore[type-arg]
    """The first ``count`` KV fetches the decode scheduler sends, as a fake prefill peer
    (a ROUTER) receives them: (identity, room), for the caller to answer; the decode
    scheduler steps (its rows into ``out``) meanwhile, for at most 10 s."""
    answered = 0
    deadline = time.monotonic() + 10
    while answered < count and time.monotonic() < deadline:
        collect(decode.step(), out)
        try:
            identity, raw = peer.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            continue
        answered += 1
        yield identity, msgspec.msgpack.decode(raw)[1]


def retract_once(decode: Scheduler, forced: list[int]) -> None:
    """Once every request decodes, retracts the one with the most output, as a full pool
    would (once: ``forced`` records it)."""
    batch = decode.running
    assert isinstance(batch, RunningBatch)
    if not forced and len(batch) == len(PROMPTS) and batch.output_len().min() >= 5:
        victim = batch.reqs[int(batch.output_len().argmax())]
        batch.remove(victim)
        retract(decode, victim, time.time())
        forced.append(victim.req_id)


def test_forced_retraction_rebootstraps_and_finishes_the_same(
    tmp_path: Path, expected: dict[int, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    prefill, _ = make("prefill", tmp_path)
    decode, _ = make("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    out: dict[int, list[Row]] = {}
    for j, ids in enumerate(PROMPTS):
        submit(prefill, j + 1, ids, room=2000 + j, max_new=1)
        submit(decode, j + 1, ids, room=2000 + j, endpoint=endpoint)
    forced: list[int] = []
    with caplog.at_level(logging.WARNING, logger="tokenpipe.scheduler"):
        run([prefill, decode], out, on_step=lambda: retract_once(decode, forced))
    assert forced, "the retraction was never forced"
    victim = forced[0]
    for j in range(len(PROMPTS)):
        assert [t for row in out[j + 1] for t in row.tokens] == expected[j + 1]
    rows = out[victim]
    with_stats = [row.stats for row in rows if row.stats is not None]
    assert (
        with_stats[0].cached_tokens == 0  # type: ignore[union-attr]
        and with_stats[0].num_retractions == 0  # type: ignore[union-attr]
    )
    # The first row after the re-bootstrap carries the new count and the prefill side's
    # new cached tokens: the whole prompt is in its cache now.
    after = next(s for s in with_stats if s.num_retractions == 1)  # type: ignore[union-attr]
    assert after.cached_tokens == len(PROMPTS[victim - 1])
    assert (
        with_stats[-1] == after or with_stats[-1].num_retractions == 1  # type: ignore[union-attr]
    )
    assert any(
        "re-bootstrapping its KV" in r.getMessage() and f"req_id={victim}" in r.getMessage()
        for r in caplog.records
    )
    assert decode.kv.num_used == 0


ASKED = LogprobParams(top_logprobs_num=3, logprob_start_len=2, token_ids_logprob=(5, 77, 1000))


def joined_logprobs(rows: list[Row]) -> tuple[TokenLogprobs, TokenLogprobs]:
    """A request's output logprobs joined over its rows (each row's cover exactly its own
    tokens), and its prompt logprobs (on exactly one row: its first)."""
    for row in rows:
        assert (row.logprobs is None) == (not row.tokens), "a row's logprobs are its own tokens'"
        assert row.logprobs is None or len(row.logprobs.chosen) == len(row.tokens)
    prompts = [row.prompt_logprobs for row in rows if row.prompt_logprobs is not None]
    assert len(prompts) == 1 and rows[0].prompt_logprobs is not None, (
        "prompt logprobs are sent once, on the first row"
    )
    return TokenLogprobs.join([row.logprobs for row in rows if row.logprobs is not None]), prompts[
        0
    ]


def assert_same_logprobs(got: TokenLogprobs, want: TokenLogprobs) -> None:
    assert len(got.chosen) == len(want.chosen)
    # Prompt positions' ranks travel with the KV (output tokens carry none on either side).
    assert len(got.ranks) == len(want.ranks) and got.ranks.min(initial=1) >= 1
    assert got.top_ids.tolist() == want.top_ids.tolist()
    for column in ("chosen", "top_values", "ids_values"):
        assert getattr(got, column) == pytest.approx(getattr(want, column), abs=1e-4), column


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_logprobs_through_pd_equal_unified_across_a_rebootstrap(
    tmp_path: Path, sampling: SamplingParams
) -> None:
    """The prefill side computes the prompt's and the first token's logprobs and sends them
    with the KV; the decode side's first row carries them. A forced decode-side retraction
    re-bootstraps (attempt 1, no logprobs in its transfer): every request still lists one
    entry per token and its prompt once, equal to a unified scheduler's."""
    unified = build_scheduler(
        ServerConfig(max_total_tokens=4096, chunked_prefill_size=64, torch_threads=1)
    )
    for j, ids in enumerate(PROMPTS):
        submit(unified, j + 1, ids, sampling=sampling, logprobs=ASKED)
    want: dict[int, list[Row]] = {}
    while unified.has_work():
        collect(unified.step(), want)

    prefill, _ = make("prefill", tmp_path)
    decode, _ = make("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    for j, ids in enumerate(PROMPTS):
        submit(prefill, j + 1, ids, room=4000 + j, max_new=1, sampling=sampling, logprobs=ASKED)
        submit(
            decode, j + 1, ids, room=4000 + j, endpoint=endpoint, sampling=sampling, logprobs=ASKED
        )
    forced: list[int] = []
    got: dict[int, list[Row]] = {}
    run([prefill, decode], got, on_step=lambda: retract_once(decode, forced))
    assert forced, "the retraction was never forced"
    assert got[forced[0]][-1].stats.num_retractions == 1  # type: ignore[union-attr]
    for j, ids in enumerate(PROMPTS):
        assert [t for row in got[j + 1] for t in row.tokens] == [
            t for row in want[j + 1] for t in row.tokens
        ]
        (out, prompt), (want_out, want_prompt) = (
            joined_logprobs(got[j + 1]),
            joined_logprobs(want[j + 1]),
        )
        assert (
            len(out.chosen) == MAX_NEW and len(prompt.chosen) == len(ids) - ASKED.logprob_start_len
        )
        assert_same_logprobs(out, want_out)
        assert_same_logprobs(prompt, want_prompt)
    assert decode.kv.num_used == 0 and prefill_side(prefill).num_held == 0


def test_unreachable_silent_and_dying_peers_fail_the_request(tmp_path: Path) -> None:
    """Nothing listening: 502 after the connect grace. A peer that takes the fetch and never
    answers: 504 after the timeout. A peer that dies holding the fetch: 502 when the
    connection drops. A peer that comes up within the grace is reached."""
    decode, _ = make("decode", tmp_path, timeout=6.0)
    decode_side(decode).connect_grace = 2.0
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    silent = ctx.socket(zmq.ROUTER)
    silent.bind(f"ipc://{tmp_path / 'silent'}")
    dying = ctx.socket(zmq.ROUTER)
    dying.bind(f"ipc://{tmp_path / 'dying'}")
    out: dict[int, list[Row]] = {}
    finished_at: dict[int, float] = {}
    started = time.monotonic()
    submit(decode, 1, PROMPTS[0], room=1, endpoint=f"ipc://{tmp_path / 'nobody'}")
    submit(decode, 2, PROMPTS[0], room=2, endpoint=f"ipc://{tmp_path / 'silent'}")
    submit(decode, 3, PROMPTS[0], room=3, endpoint=f"ipc://{tmp_path / 'dying'}")
    submit(decode, 4, PROMPTS[0], room=4, endpoint=f"ipc://{tmp_path / 'late'}")
    late: list[zmq.Socket] = []  # type: ignore[type-arg]

    def kill_dying_peer_once_it_has_the_fetch() -> None:
        for req_id in out:
            finished_at.setdefault(req_id, time.monotonic() - started)
        if not dying.closed and dying.poll(0):
            dying.recv_multipart()
            dying.close(linger=0)
        if not late and time.monotonic() - started > 1.0:  # a restart that beats the grace
            late.append(ctx.socket(zmq.ROUTER))
            late[0].bind(f"ipc://{tmp_path / 'late'}")
        if late and late[0].poll(0):
            identity, _ = late[0].recv_multipart()
            refusal = KVTransferHeader(room=4, attempt=0, ok=False, error="late but alive")
            late[0].send_multipart([identity, msgspec.msgpack.encode(refusal)])

    run([decode], out, until=10, on_step=kill_dying_peer_once_it_has_the_fetch)
    reasons = {req_id: rows[-1].finished for req_id, rows in out.items()}
    assert all(isinstance(r, FinishAbort) for r in reasons.values()), reasons
    assert reasons[1].status_code == 502
    assert "cannot connect" in reasons[1].message  # type: ignore[union-attr]
    assert reasons[2].status_code == 504
    assert "timed out" in reasons[2].message  # type: ignore[union-attr]
    assert reasons[3].status_code == 502
    assert "was lost" in reasons[3].message  # type: ignore[union-attr]
    assert reasons[4].status_code == 502
    assert "late but alive" in reasons[4].message  # type: ignore[union-attr]
    assert 2.0 <= finished_at[1] < 4.0 and finished_at[3] < 1.5 and finished_at[2] >= 6.0, (
        finished_at
    )
    assert all(rows[-1].stats is not None for rows in out.values())
    assert not decode.live and decode.kv.num_used == 0
    ctx.destroy(linger=0)


def test_prefill_refusal_and_malformed_transfer_fail_with_502(tmp_path: Path) -> None:
    decode, _ = make("decode", tmp_path)
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    peer = ctx.socket(zmq.ROUTER)
    peer.bind(f"ipc://{tmp_path / 'hostile'}")
    endpoint = f"ipc://{tmp_path / 'hostile'}"
    out: dict[int, list[Row]] = {}
    submit(decode, 1, PROMPTS[0], room=7, endpoint=endpoint)
    submit(decode, 2, PROMPTS[1], room=8, endpoint=endpoint)
    submit(decode, 3, PROMPTS[2], room=8, endpoint=endpoint)  # a room already waiting: refused
    submit(decode, 4, PROMPTS[3], room=9, endpoint=endpoint)
    enc = msgspec.msgpack.Encoder()
    for identity, room in fake_prefill_fetches(decode, peer, 3, out):
        peer.send_multipart([identity, b"\xc1garbage"])  # dropped with a warning
        if room == 7:
            peer.send_multipart(
                [
                    identity,
                    enc.encode(
                        KVTransferHeader(room=7, attempt=0, ok=False, error="out of memory")
                    ),
                ]
            )
        elif room == 9:  # claims more cached tokens than the prompt has
            layout = decode_side(decode).layout
            header = KVTransferHeader(
                room=9,
                attempt=0,
                ok=True,
                num_tokens=len(PROMPTS[3]),
                layout=layout,
                first_token=5,
                cached_tokens=10**6,
            )
            size = layout.num_layers * len(PROMPTS[3]) * layout.num_kv_heads * layout.head_dim * 4
            peer.send_multipart([identity, enc.encode(header), bytes(size), bytes(size)])
        else:  # says 24 tokens, sends 3 bytes
            header = KVTransferHeader(
                room=8,
                attempt=0,
                ok=True,
                num_tokens=len(PROMPTS[1]),
                layout=decode_side(decode).layout,
                first_token=5,
            )
            peer.send_multipart([identity, enc.encode(header), b"abc", b"def"])
    run([decode], out, until=10)
    first, second = out[1][-1].finished, out[2][-1].finished
    assert (
        isinstance(first, FinishAbort)
        and first.status_code == 502
        and "out of memory" in first.message
    )
    assert (
        isinstance(second, FinishAbort)
        and second.status_code == 502
        and "do not hold" in second.message
    )
    fourth = out[4][-1].finished
    assert (
        isinstance(fourth, FinishAbort)
        and fourth.status_code == 502
        and "cached_tokens" in fourth.message
    )
    third = out[3][-1].finished
    assert (
        isinstance(third, FinishAbort)
        and third.status_code == 400
        and "already in use" in third.message
    )
    assert decode.kv.num_used == 0
    ctx.destroy(linger=0)


def test_missing_or_malformed_logprobs_in_a_transfer_fail_with_502(tmp_path: Path) -> None:
    """A request that asked for logprobs: a first transfer without them, with columns that
    do not add up, or with other counts than asked fails it with a 502 (never a crash, never
    fewer entries than tokens); a well-formed one is served."""
    decode, _ = make("decode", tmp_path)
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    peer = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path / 'hostile'}"
    peer.bind(endpoint)
    asked = LogprobParams(top_logprobs_num=2)
    ids = PROMPTS[0]
    first = TokenLogprobs(
        np.array([-1.0], np.float32),
        np.array([[5, 6]], np.int32),
        np.array([[-1.0, -2.0]], np.float32),
        np.zeros((1, 0), np.float32),
    )
    good = FrameLogprobs(output=build_output_logprobs([0], [first]))
    three_top = build_output_logprobs(
        [0],
        [
            TokenLogprobs(
                first.chosen,
                np.array([[5, 6, 7]], np.int32),
                np.zeros((1, 3), np.float32),
                first.ids_values,
            )
        ],
    )
    short = msgspec.structs.replace(good.output, token_logprobs=b"")  # type: ignore[type-var]
    answers = {
        20: good,
        21: None,
        22: FrameLogprobs(output=short),
        23: FrameLogprobs(output=three_top),
        24: FrameLogprobs(
            output=good.output, input=build_input_logprobs([0], [first])
        ),  # no prompt logprobs were asked
    }
    for room in answers:
        submit(decode, room, ids, room=room, endpoint=endpoint, max_new=3, logprobs=asked)
    enc = msgspec.msgpack.Encoder()
    layout = decode_side(decode).layout
    size = layout.num_layers * len(ids) * layout.num_kv_heads * layout.head_dim * 4
    out: dict[int, list[Row]] = {}
    for identity, room in fake_prefill_fetches(decode, peer, len(answers), out):
        header = KVTransferHeader(
            room=room,
            attempt=0,
            ok=True,
            num_tokens=len(ids),
            layout=layout,
            first_token=5,
            logprobs=answers[room],
        )
        peer.send_multipart([identity, enc.encode(header), bytes(size), bytes(size)])
    run([decode], out, until=10)
    ctx.destroy(linger=0)
    served = out[20]
    assert served[-1].finished is not None and not isinstance(served[-1].finished, FinishAbort)
    assert served[0].logprobs is not None and served[0].logprobs.top_ids.tolist()[0] == [
        5,
        6,
    ]  # the prefill side's, as sent
    for room, why in (
        (21, "carries none"),
        (22, "malformed"),
        (23, "2 top logprobs"),
        (24, "0 prompt positions"),
    ):
        finished = out[room][-1].finished
        assert (
            isinstance(finished, FinishAbort)
            and finished.status_code == 502
            and why in finished.message
        ), (room, finished)
    assert decode.kv.num_used == 0


def test_prefill_side_survives_malformed_and_hostile_fetches(
    tmp_path: Path, expected: dict[int, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """Junk on the prefill server's KV endpoint is dropped with a warning; well-formed but
    wrong fetches get an error header; a real PD request still works after them."""
    prefill, _ = make("prefill", tmp_path)
    decode, _ = make("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    ctx: zmq.Context = zmq.Context()  # type: ignore[type-arg]
    hostile = ctx.socket(zmq.DEALER)
    hostile.connect(endpoint)
    enc = msgspec.msgpack.Encoder()
    layout = prefill_side(prefill).layout
    rng = random.Random(5)
    for _ in range(300):
        hostile.send(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))))
    hostile.send_multipart([b"two", b"frames"])
    bad_fetches = [
        KVFetch(
            room=1,
            attempt=0,
            token_ids=[1, 2],
            prompt_tokens=2,
            layout=msgspec.structs.replace(layout, num_layers=99),
        ),
        KVFetch(
            room=2, attempt=1, token_ids=[10**6, 3], prompt_tokens=2, layout=layout
        ),  # outside the vocabulary
        KVFetch(room=3, attempt=1, token_ids=[], prompt_tokens=0, layout=layout),
    ]
    for fetch in bad_fetches:
        hostile.send(enc.encode(fetch))
    with caplog.at_level(logging.WARNING):
        errors: dict[int, str] = {}
        deadline = time.monotonic() + 10
        while len(errors) < len(bad_fetches) and time.monotonic() < deadline:
            prefill.step()
            while hostile.poll(0):
                header = msgspec.msgpack.decode(hostile.recv_multipart()[0], type=KVTransferHeader)
                assert not header.ok
                errors[header.room] = header.error
    assert "layout" in errors[1] and "vocabulary" in errors[2] and "no tokens" in errors[3], errors
    assert any("malformed KV fetch" in r.getMessage() for r in caplog.records)
    assert any("KV fetch of 2 frames" in r.getMessage() for r in caplog.records)
    out: dict[int, list[Row]] = {}
    submit(prefill, 1, PROMPTS[0], room=4000, max_new=1)
    submit(decode, 1, PROMPTS[0], room=4000, endpoint=endpoint)
    run([prefill, decode], out)
    assert [t for row in out[1] for t in row.tokens] == expected[1]
    ctx.destroy(linger=0)


def test_unfetched_kv_is_capped_oldest_first(
    tmp_path: Path, expected: dict[int, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """KV that no decode server fetches is kept within a byte limit, dropping the oldest:
    a decode server that never comes cannot make the prefill server grow without bound."""
    prefill, _ = make("prefill", tmp_path)
    sender = prefill_side(prefill)
    per_token = 2 * prefill.kv.k[:, 0].numel() * prefill.kv.k.element_size()
    sender.stash_limit_bytes = per_token * (
        len(PROMPTS[0]) + len(PROMPTS[1]) + len(PROMPTS[2]) // 2
    )
    with caplog.at_level(logging.WARNING):
        for j in range(3):
            submit(prefill, j + 1, PROMPTS[j], room=5000 + j, max_new=1)
            run([prefill], {})
    assert sender.num_held == 2
    assert any(
        "dropped the unfetched KV of bootstrap room 5000" in r.getMessage() for r in caplog.records
    )
    decode, _ = make("decode", tmp_path)
    out: dict[int, list[Row]] = {}
    submit(decode, 3, PROMPTS[2], room=5002, endpoint=f"ipc://{tmp_path / 'kv'}")
    run([prefill, decode], out)
    assert [t for row in out[3] for t in row.tokens] == expected[3]
    assert sender.num_held == 1
