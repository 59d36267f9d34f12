"""Output frames split by API worker (``pipeline.worker_frames``, docs/design.md section 2).

Frames come from the real scheduler (rows of three workers' requests interleaved, with
output and prompt logprobs, token texts, stream intervals, a retraction, an abort and
embeddings) through the real detokenizer. Each part must hold exactly its worker's rows in
order, survive the socket's encode and typed decode, and, fed to that worker's
``TokenizerManager``, leave every request's state exactly as the unsplit frame leaves it
in one manager that holds every request. A worker's token-text cache must answer every
logprob token its rows show from what its parts brought (it cannot decode)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import numpy as np
import pytest

from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.logprob_texts import logprob_text_ids
from detokenizer_proc.main import detokenize_frame
from pipeline.config import ServerConfig
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    DetokenizerInput,
    FrameLogprobs,
    LogprobParams,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenizerManagerInput,
    TokenTexts,
)
from pipeline.columns import from_column
from pipeline.worker_ids import WORKER_SHIFT, worker_of
from pipeline.token_texts import TokenTextCache
from pipeline.tokenizer_loader import load_tokenizer
from pipeline.worker_frames import split_embedding_output, split_str_output, workers_of
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager

TOKENIZER = load_tokenizer(None)
ENCODER = msgspec.msgpack.Encoder()
TO_DETOKENIZER = msgspec.msgpack.Decoder(DetokenizerInput)
TO_MANAGER = msgspec.msgpack.Decoder(TokenizerManagerInput)
WORKERS = 3
NOW = 1_000_000.0
PROMPTS = [[(7 * i + 11 * j) % 3900 + 70 for i in range(6 + 3 * j)] for j in range(5)]
SHOWN = LogprobParams(
    top_logprobs_num=3, logprob_start_len=1, token_ids_logprob=(5, 900), return_text=True
)
HIDDEN = LogprobParams(top_logprobs_num=2, logprob_start_len=0)
OUTPUT_ONLY = LogprobParams(top_logprobs_num=4, return_text=True)


@dataclass(frozen=True)
class Ask:
    """One request of the scenario: the worker that takes it and what it asks."""

    worker: int
    stream: bool = True
    interval: int | None = None
    logprobs: LogprobParams | None = None
    max_new: int = 8
    stop: tuple[str, ...] = ()
    embedding: bool = False


# Workers interleaved, so most frames hold rows of several, in mixed order.
SCENARIO = [
    Ask(0, logprobs=SHOWN),
    Ask(2, interval=2, logprobs=HIDDEN),
    Ask(1, stream=False, logprobs=OUTPUT_ONLY),
    Ask(2),
    Ask(0, embedding=True),
    Ask(1, interval=3, logprobs=SHOWN, stop=("e", " the")),
    Ask(0, stream=False),
    Ask(2, logprobs=OUTPUT_ONLY, max_new=12),
    Ask(1, embedding=True),
    Ask(2, embedding=True),
    Ask(0, interval=2, logprobs=HIDDEN, max_new=5),
    Ask(1, logprobs=SHOWN, max_new=3),
]


class NoDecode:
    """A tokenizer whose texts cannot be decoded: a worker's cache answers only from what
    its frames brought, so a text missing from a part fails the test."""

    def __init__(self, real: Any) -> None:
        self.decoder = real.decoder
        self._real = real

    def id_to_token(self, token: int) -> str | None:
        return self._real.id_to_token(token)

    def decode_batch(self, ids: Any, skip_special_tokens: bool = False) -> list[str]:
        raise AssertionError(f"a worker had to decode {ids}: its frames did not bring their texts")


def manager(worker: int | None = None) -> TokenizerManager:
    config = ServerConfig(
        scheduler_input="ipc:///unused", tokenizer_input="ipc:///unused", enable_metrics=False
    )
    tm = TokenizerManager(
        config,
        TOKENIZER,
        context_length=2048,
        worker_index=worker or 0,
        clock=lambda: NOW,
        req_id_base=1,
    )
    if worker is not None:
        tm.token_texts = TokenTextCache(NoDecode(TOKENIZER.tokenizer))  # type: ignore[arg-type]
    return tm


def mirror(state: ReqState) -> ReqState:
    """The same request, registered on its own in the manager that holds every request."""
    return ReqState(
        rid=state.rid,
        req_id=state.req_id,
        stream=state.stream,
        sampling=state.sampling,
        created_time=state.created_time,
        tokenized_time=state.tokenized_time,
        logprob=state.logprob,
        prompt_ids=list(state.prompt_ids),
        operation=state.operation,
    )


def snapshot(state: ReqState) -> dict[str, Any]:
    """Everything a request's state holds, comparable with ``==``."""
    out = {
        f.name: getattr(state, f.name)
        for f in fields(state)
        if f.name not in ("event", "embedding")
    }
    out["embedding"] = None if state.embedding is None else state.embedding.tolist()
    return out


@dataclass
class Run:
    """Three worker managers fed the parts, one manager fed every frame whole."""

    scheduler: Scheduler
    workers: list[TokenizerManager]
    whole: TokenizerManager
    split: dict[int, ReqState]  # req_id -> its state at its worker
    joined: dict[int, ReqState]  # req_id -> its state at the whole-frame manager
    shown: set[int]  # req_ids whose logprob entries show token texts


def start(asks: list[Ask], pool: int = 8192) -> Run:
    s = build_scheduler(ServerConfig(max_total_tokens=pool, torch_threads=1))
    run = Run(s, [manager(w) for w in range(WORKERS)], manager(), {}, {}, set())
    for n, ask in enumerate(asks):
        sampling = (
            SamplingParams(max_new_tokens=0)
            if ask.embedding
            else SamplingParams(
                temperature=0.8,
                seed=n,
                max_new_tokens=ask.max_new,
                stream_interval=ask.interval,
                stop=ask.stop,
            )
        )
        state = run.workers[ask.worker].open_state(
            sampling=sampling, stream=ask.stream and not ask.embedding, rid=f"r{n}"
        )
        prompt = PROMPTS[n % len(PROMPTS)]
        state.logprob = ask.logprobs
        if ask.logprobs is not None and ask.logprobs.logprob_start_len >= 0:
            state.prompt_ids = prompt
        if ask.logprobs is not None and ask.logprobs.return_text:
            run.shown.add(state.req_id)
        if ask.embedding:
            state.operation = "embeddings"
            s.add_request(
                TokenizedEmbeddingReqInput(
                    rid=state.rid, req_id=state.req_id, input_ids=prompt, arrival_time=time.time()
                )
            )
        else:
            s.add_request(
                TokenizedGenerateReqInput(
                    rid=state.rid,
                    req_id=state.req_id,
                    input_ids=prompt,
                    sampling_params=sampling,
                    stream=ask.stream,
                    arrival_time=time.time(),
                    logprobs=ask.logprobs,
                )
            )
        assert worker_of(state.req_id) == ask.worker
        run.split[state.req_id] = state
        run.joined[state.req_id] = run.whole.states[state.req_id] = mirror(state)
        run.whole.rid_to_req_id[state.rid] = state.req_id
    return run


def str_frames(
    run: Run, abort_after: int | None = None
) -> Iterator[BatchStrOutput | BatchEmbeddingOutput]:
    """The frames as the detokenizer sends them on (before any split): token frames through
    the real detokenizer, embedding frames as they came. ``abort_after``: steps before the
    first request still running is aborted (its row carries no tokens)."""
    detok = IncrementalDetokenizer(TOKENIZER.tokenizer)
    texts = TokenTextCache(TOKENIZER.tokenizer)
    for step in itertools.count():
        if not run.scheduler.has_work():
            return
        if step == abort_after:
            live = sorted(run.scheduler.live)
            if live:
                run.scheduler.abort(AbortReq(req_id=live[len(live) // 2]))
        for frame in run.scheduler.step():
            wire = TO_DETOKENIZER.decode(ENCODER.encode(frame))
            yield (
                wire
                if isinstance(wire, BatchEmbeddingOutput)
                else detokenize_frame(detok, wire, texts)
            )  # type: ignore[arg-type]


def req_ids(frame: BatchStrOutput | BatchEmbeddingOutput) -> list[int]:
    return from_column(frame.req_ids, REQ_ID_DTYPE).tolist()


def split(frame: BatchStrOutput | BatchEmbeddingOutput, workers: int = WORKERS) -> Any:
    return (
        split_embedding_output(frame, workers)
        if isinstance(frame, BatchEmbeddingOutput)
        else split_str_output(frame, workers)
    )


def check_texts(run: Run, worker: int, part: BatchStrOutput) -> None:
    """Every token text the part's rows show is in the worker's cache (which cannot
    decode), and each text the part carries is the frame's, for a token of the part."""
    if part.logprobs is None:
        assert part.token_texts is None
        return
    ids = from_column(part.output_ids, TOKEN_DTYPE)
    counts = from_column(part.output_counts, COUNT_DTYPE)
    shows = np.array([r in run.shown for r in req_ids(part)], dtype=bool)
    needed = np.unique(logprob_text_ids(part.logprobs, ids, counts, shows)).tolist()
    cache = run.workers[worker].token_texts
    assert cache is not None
    for token in needed:
        assert cache(token) == TOKENIZER.tokenizer.decode([token], skip_special_tokens=False)
    if part.token_texts is not None:
        assert part.token_texts.texts, "no texts for this part: one nil, not an empty column"
        every = set(ids.tolist())
        for block in (
            part.logprobs.output,
            part.logprobs.input.logprobs if part.logprobs.input is not None else None,
        ):
            if block is not None:
                every.update(np.frombuffer(block.top_ids, dtype=np.int32).tolist())
        assert set(np.frombuffer(part.token_texts.ids, dtype=np.int32).tolist()) <= every


def keeps_the_nil_rule(part: BatchStrOutput | BatchEmbeddingOutput) -> None:
    """A part is a frame like any other: a list column no row of it has an entry in is
    one nil, and so is a logprob block that lists none of its rows."""
    assert part.finished_reasons is None or any(x is not None for x in part.finished_reasons)
    if isinstance(part, BatchEmbeddingOutput):
        return
    assert part.request_stats is None or any(x is not None for x in part.request_stats)
    lp = part.logprobs
    if lp is not None:
        assert lp.output is not None or lp.input is not None
        for block in (lp.output, lp.input.logprobs if lp.input is not None else None):
            assert block is None or len(block.rows) > 0


def drive(run: Run, abort_after: int | None = None) -> dict[str, int]:
    """Feeds every frame split to the workers and whole to the joined manager; after each
    frame every request of the frame has the same state on both sides. Returns counts of
    what the frames held, so the caller can check that the scenario exercised it all."""
    seen = dict(
        frames=0, several=0, whole=0, prompt=0, output=0, texts=0, finished=0, stats=0, embedding=0
    )
    for frame in str_frames(run, abort_after):
        ids = req_ids(frame)
        result = split(frame)
        assert result.stray == []
        # (a) each part holds exactly its worker's rows, in order, and only workers with rows get
        # one
        assert [w for w, _ in result.parts] == sorted({worker_of(r) for r in ids})
        for w, part in result.parts:
            assert req_ids(part) == [r for r in ids if worker_of(r) == w]
            keeps_the_nil_rule(part)
        if len(result.parts) == 1:
            assert result.parts[0][1] is frame  # (c) one worker's rows: the frame itself
            seen["whole"] += 1
        seen["several"] += len(result.parts) > 1
        # (d) through the socket, as the detokenizer sends each worker its part
        for w, part in result.parts:
            received = TO_MANAGER.decode(ENCODER.encode(part))
            assert type(received) is type(part) and ENCODER.encode(received) == ENCODER.encode(part)
            run.workers[w].handle_output(received)
            if isinstance(received, BatchStrOutput):
                check_texts(run, w, received)
        run.whole.handle_output(TO_MANAGER.decode(ENCODER.encode(frame)))
        # (b) every request of the frame: the same state, whichever way its rows came
        for r in ids:
            assert snapshot(run.split[r]) == snapshot(run.joined[r]), (
                f"req_id {r:#x} differs after a split frame"
            )
        seen["frames"] += 1
        seen["embedding"] += isinstance(frame, BatchEmbeddingOutput)
        if isinstance(frame, BatchStrOutput):
            lp = frame.logprobs or FrameLogprobs()
            seen["prompt"] += lp.input is not None and len(result.parts) > 1
            seen["output"] += lp.output is not None and len(result.parts) > 1
            seen["texts"] += frame.token_texts is not None and len(result.parts) > 1
            seen["stats"] += frame.request_stats is not None and len(result.parts) > 1
        seen["finished"] += frame.finished_reasons is not None and any(
            x is not None for x in frame.finished_reasons
        )
    for w, tm in enumerate(run.workers):
        assert tm._dropped_rows.total == 0, f"worker {w} got a row that is not its own"
    return seen


@pytest.mark.parametrize("pool", [8192, 80], ids=["roomy", "retracting"])
def test_each_worker_gets_its_rows_and_ends_where_the_whole_frame_leads(pool: int) -> None:
    run = start(SCENARIO, pool)
    seen = drive(run, abort_after=4)
    assert (
        seen["several"] > 5
        and seen["prompt"]
        and seen["output"] > 3
        and seen["texts"] > 3
        and seen["stats"] > 3
    )
    assert seen["finished"] and seen["embedding"] and seen["whole"]
    if pool < 8192:
        assert run.scheduler.num_retracted_total > 0, "the small pool forced no retraction"
    for req_id, state in run.split.items():
        assert state.finished, f"req_id {req_id:#x} never finished"
        assert snapshot(state) == snapshot(run.joined[req_id])
    aborted = [
        s
        for s in run.split.values()
        if s.finished_reason is not None and type(s.finished_reason).__name__ == "FinishAbort"
    ]
    assert aborted, "the scenario's abort never reached its worker"
    # The states asked for what they got: output entries on every token of an asking request,
    # and a rank for every prompt position (the prompt block's rank column, split too).
    for state in run.split.values():
        if state.logprob is not None and not state.stream:
            assert len(state.logprobs.chosen) == len(state.output_ids) > 0
        prompt = state.prompt_logprobs
        assert len(prompt.ranks) == len(prompt.chosen) and min(prompt.ranks, default=1) >= 1
    assert any(state.prompt_logprobs.ranks for state in run.split.values())


def test_a_frame_of_one_worker_goes_on_whole() -> None:
    run = start([Ask(0, logprobs=SHOWN), Ask(0, interval=2), Ask(0, embedding=True)])
    frames = list(str_frames(run))
    assert len(frames) > 3
    for frame in frames:
        for workers in (1, WORKERS):
            result = split(frame, workers)
            assert (
                result.parts == [(0, frame)] and result.parts[0][1] is frame and result.stray == []
            )
    late = start([Ask(2, logprobs=HIDDEN)])
    for frame in str_frames(late):
        assert split(frame).parts[0][1] is frame and split(frame).parts[0][0] == 2


def multi_worker_frame() -> BatchStrOutput:
    """A real frame with rows of every worker, first rows (stats, prompt logprobs) and
    token texts."""
    run = start([Ask(0, logprobs=SHOWN), Ask(1, logprobs=SHOWN), Ask(2, logprobs=HIDDEN), Ask(1)])
    for frame in str_frames(run):
        if (
            isinstance(frame, BatchStrOutput)
            and frame.token_texts is not None
            and frame.logprobs
            and frame.logprobs.input
        ):
            if len({worker_of(r) for r in req_ids(frame)}) == WORKERS:
                return frame
    raise AssertionError("no frame with rows of every worker, prompt logprobs and token texts")


def corrupt(frame: BatchStrOutput, **columns: Any) -> BatchStrOutput:
    return msgspec.structs.replace(frame, **columns)


def test_a_frame_whose_columns_disagree_is_refused_whole() -> None:
    frame = multi_worker_frame()
    assert len(split_str_output(frame, WORKERS).parts) == WORKERS
    lp = frame.logprobs
    assert (
        lp is not None
        and lp.output is not None
        and lp.input is not None
        and frame.token_texts is not None
    )
    out, inp = lp.output, lp.input
    bad = [
        corrupt(frame, text_deltas=frame.text_deltas[:-1]),
        corrupt(frame, output_counts=frame.output_counts[:-4]),
        corrupt(frame, completion_tokens=frame.completion_tokens + b"\0\0\0\0"),
        corrupt(frame, output_ids=frame.output_ids[:-4]),  # counts no longer add up
        corrupt(frame, output_ids=frame.output_ids[:-1]),  # not a whole number of tokens
        corrupt(frame, request_stats=[None]),
        corrupt(frame, finished_reasons=[None] * 99),
        corrupt(
            frame,
            logprobs=FrameLogprobs(
                msgspec.structs.replace(out, rows=np.array([99], np.int32).tobytes()), inp
            ),
        ),
        corrupt(
            frame,
            logprobs=FrameLogprobs(
                msgspec.structs.replace(out, token_logprobs=out.token_logprobs[:-4]), inp
            ),
        ),
        corrupt(
            frame,
            logprobs=FrameLogprobs(
                msgspec.structs.replace(out, top_logprobs=out.top_logprobs[:-4]), inp
            ),
        ),
        corrupt(
            frame,
            logprobs=FrameLogprobs(
                msgspec.structs.replace(out, top_k=out.top_k + b"\1\0\0\0"), inp
            ),
        ),
        corrupt(
            frame, logprobs=FrameLogprobs(out, msgspec.structs.replace(inp, counts=inp.counts[:-4]))
        ),
        corrupt(
            frame,
            logprobs=FrameLogprobs(
                out,
                msgspec.structs.replace(
                    inp, logprobs=msgspec.structs.replace(inp.logprobs, ids_logprobs=b"")
                ),
            ),
        ),
        corrupt(
            frame,
            token_texts=TokenTexts(ids=frame.token_texts.ids, texts=frame.token_texts.texts[1:]),
        ),
    ]
    for wrong in bad:
        with pytest.raises(ValueError):
            split_str_output(wrong, WORKERS)
        with pytest.raises(ValueError):  # what the split refuses, the unsplit reader refuses too
            manager().handle_output(wrong)


def test_an_inconsistent_embedding_frame_is_refused() -> None:
    run = start([Ask(0, embedding=True), Ask(1, embedding=True), Ask(2, embedding=True)])
    frame = next(f for f in str_frames(run) if isinstance(f, BatchEmbeddingOutput))
    assert len(split_embedding_output(frame, WORKERS).parts) == WORKERS
    for bad in (
        msgspec.structs.replace(frame, shape=(frame.shape[0] + 1, frame.shape[1])),
        msgspec.structs.replace(frame, embeddings=frame.embeddings[:-4]),
        msgspec.structs.replace(frame, request_stats=frame.request_stats[:-1]),
    ):
        with pytest.raises(ValueError):
            split_embedding_output(bad, WORKERS)


def test_a_single_worker_frame_goes_on_unchecked_and_its_reader_refuses_it() -> None:
    run = start([Ask(1, logprobs=SHOWN), Ask(1)])
    frame = next(f for f in str_frames(run) if isinstance(f, BatchStrOutput))
    bad = corrupt(frame, text_deltas=[])
    assert split_str_output(bad, WORKERS).parts == [(1, bad)]
    with pytest.raises(ValueError):
        manager(1).handle_output(bad)


def test_rows_of_a_worker_that_does_not_exist_are_returned_apart() -> None:
    frame = multi_worker_frame()
    ids = np.array(req_ids(frame), dtype=np.int64)
    ghost, negative = (7 << WORKER_SHIFT) + 5, -3
    ids[0], ids[-1] = ghost, negative
    renamed = corrupt(frame, req_ids=ids.tobytes())
    result = split_str_output(renamed, WORKERS)
    assert sorted(result.stray) == sorted([ghost, negative])
    kept = [r for r in ids.tolist() if r not in (ghost, negative)]
    assert sorted(r for _, part in result.parts for r in req_ids(part)) == sorted(kept)
    for w, part in result.parts:
        assert req_ids(part) == [r for r in ids.tolist() if worker_of(r) == w]
        TO_MANAGER.decode(ENCODER.encode(part))
    # Only workers 0 and 1 exist: worker 2's rows are strays too.
    two = split_str_output(frame, 2)
    assert sorted(two.stray) == [r for r in req_ids(frame) if worker_of(r) == 2]
    assert [w for w, _ in two.parts] == [0, 1]


def test_worker_index_arithmetic() -> None:
    ids = [(w << WORKER_SHIFT) + k for w in (0, 1, 2, 126) for k in (0, 1, (1 << WORKER_SHIFT) - 1)]
    assert (
        [worker_of(i) for i in ids]
        == workers_of(np.array(ids, dtype=np.int64)).tolist()
        == [w for w in (0, 1, 2, 126) for _ in range(3)]
    )
    assert worker_of((2 << WORKER_SHIFT) + 17) == 2 and worker_of(17) == 0  # control_ids alike
    assert worker_of(-1) < 0 and workers_of(np.array([-1], dtype=np.int64)).tolist() == [-1]
    tm = manager(2)
    assert worker_of(tm.open_state(sampling=SamplingParams(), stream=False, rid="x").req_id) == 2
    assert worker_of(next(tm.controls._next_control_id)) == 2


def test_an_empty_frame_has_no_parts() -> None:
    empty = BatchStrOutput(
        req_ids=b"", text_deltas=[], output_ids=b"", output_counts=b"", completion_tokens=b""
    )
    assert split_str_output(empty, WORKERS) == ([], [])
