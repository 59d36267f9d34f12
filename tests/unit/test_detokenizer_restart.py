"""A detokenizer that restarts under running requests (docs/design.md section 5): the rows
of a request whose first row it never saw fail that request with a 503, never pass on as
output without their text, and the tokenizer manager stops the request in the scheduler.

The frames take the real path: the scheduler's frame as it comes off the wire, the real
``detokenize_frame`` (a fresh ``IncrementalDetokenizer`` is a restarted process), msgpack
both ways, and the real ``TokenizerManager.handle_output`` on real sockets."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import zmq

from detokenizer_proc.incremental import IncrementalDetokenizer
from detokenizer_proc.main import detokenize_frame
from pipeline.config import ServerConfig
from pipeline.io_struct import (
    COUNT_DTYPE,
    REQ_ID_DTYPE,
    TOKEN_DTYPE,
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    DecodeOptions,
    DetokenizerInput,
    FinishReason,
    RequestOutputStats,
    SamplingParams,
    SchedulerInput,
    TokenizedGenerateReqInput,
    TokenizerManagerInput,
)
from pipeline.columns import to_column
from pipeline.finish_reasons import DETOKENIZER_LOST_TEXT
from pipeline.sockets import FrameDecoder, make_encoder
from pipeline.tokenizer_loader import load_tokenizer
from tokenizer_proc.req_state import StreamChunk
from tokenizer_proc.tokenizer_manager import TokenizerManager

TOK = load_tokenizer(None)
ENCODER = make_encoder()
LOG = logging.getLogger("test")
TO_DETOKENIZER: FrameDecoder[DetokenizerInput] = FrameDecoder(
    DetokenizerInput, LOG, "to detokenizer"
)
TO_MANAGER: FrameDecoder[TokenizerManagerInput] = FrameDecoder(
    TokenizerManagerInput, LOG, "to manager"
)
TO_SCHEDULER: FrameDecoder[SchedulerInput] = FrameDecoder(SchedulerInput, LOG, "to scheduler")


def token_frame(
    req_ids: list[int],
    rows: list[list[int]],
    completion: list[int],
    *,
    options: list[DecodeOptions | None] | None = None,
    stats: list[RequestOutputStats | None] | None = None,
    finished: list[FinishReason | None] | None = None,
) -> BatchTokenIDOutput:
    return BatchTokenIDOutput(
        req_ids=to_column(req_ids, REQ_ID_DTYPE),
        output_ids=to_column([t for r in rows for t in r], TOKEN_DTYPE),
        output_counts=to_column([len(r) for r in rows], COUNT_DTYPE),
        completion_tokens=to_column(completion, COUNT_DTYPE),
        finished_reasons=finished,
        request_stats=stats,
        decode_options=options,
    )


def through(detok: IncrementalDetokenizer, frame: BatchTokenIDOutput) -> BatchStrOutput:
    """The frame over the wire into the detokenizer, and its output over the wire out."""
    wire = TO_DETOKENIZER.decode(ENCODER.encode(frame))
    assert isinstance(wire, BatchTokenIDOutput)
    out = TO_MANAGER.decode(ENCODER.encode(detokenize_frame(detok, wire)))
    assert isinstance(out, BatchStrOutput)
    return out


def test_a_steady_row_after_a_restart_fails_its_request_and_leaves_the_others_alone() -> None:
    """Two requests run; the detokenizer restarts; one more opens. In the next steady frame
    (no finish column, no options) the two older requests' rows fail with the 503 and no
    text; the new one's row decodes as usual."""
    hello, world = TOK.encode(" hello there"), TOK.encode(" world")
    before = IncrementalDetokenizer(TOK.tokenizer)
    first = through(
        before,
        token_frame(
            [1, 2], [hello[:1], world[:1]], [1, 1], options=[DecodeOptions(), DecodeOptions()]
        ),
    )
    assert first.finished_reasons is None and "".join(first.text_deltas) == TOK.decode(
        [hello[0], world[0]]
    )

    restarted = IncrementalDetokenizer(TOK.tokenizer)
    through(restarted, token_frame([3], [hello[:1]], [1], options=[DecodeOptions()]))
    steady = through(
        restarted, token_frame([1, 3, 2], [hello[1:2], hello[1:2], world[1:2]], [2, 2, 2])
    )
    assert steady.finished_reasons == [DETOKENIZER_LOST_TEXT, None, DETOKENIZER_LOST_TEXT]
    assert steady.text_deltas == ["", TOK.decode(hello[1:2]), ""]
    assert restarted.num_live == 1  # only request 3's: none kept for the lost ones


def test_a_row_of_several_tokens_after_a_restart_fails_too() -> None:
    """A stream_interval > 1 or dLLM row carries several tokens; a PD-decode request's first
    row at the decode server carries options like any first row (so it is never lost)."""
    ids = TOK.encode(" several tokens in one row")
    restarted = IncrementalDetokenizer(TOK.tokenizer)
    out = through(
        restarted,
        token_frame([9, 10], [ids[2:5], ids[:3]], [5, 3], options=[None, DecodeOptions()]),
    )
    assert out.finished_reasons == [DETOKENIZER_LOST_TEXT, None]
    assert out.text_deltas == ["", TOK.decode(ids[:3])]


def _manager(tmp_path: Path) -> TokenizerManager:
    config = ServerConfig(
        scheduler_input=f"ipc://{tmp_path}/sched",
        tokenizer_input=f"ipc://{tmp_path}/tm",
        max_total_tokens=4096,
    )
    return TokenizerManager(config, load_tokenizer(None), context_length=2048)


def test_the_manager_fails_a_lost_request_and_stops_it_in_the_scheduler(tmp_path: Path) -> None:
    """A stream got its first row; then the detokenizer restarted, and the next row comes as
    the lost-text abort. The manager finishes the stream with that 503, adds none of the
    row's ids (they have no text), and sends the scheduler an AbortReq for it, once: a later
    row of the same request finds no state and is dropped. A request whose first row was
    lost in the restart (no stats yet) fails the same way rather than wait forever."""
    ids = TOK.encode(" one two three four")
    stats = RequestOutputStats(prompt_tokens=3)

    Outcome = tuple[FinishReason | None, list[StreamChunk], int, FinishReason | None]

    async def scenario() -> tuple[Outcome, list[SchedulerInput | None]]:
        tm = _manager(tmp_path)
        inbox: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        inbox.setsockopt(zmq.RCVTIMEO, 30_000)  # a missing message fails the test, never hangs it
        inbox.bind(tm.config.scheduler_input)
        await tm.start()
        try:
            streamed = tm.submit_generate(
                input_ids=[5, 6, 7], sampling=SamplingParams(), stream=True, rid="streamed"
            )
            unheard = tm.submit_generate(
                input_ids=[5, 6, 7], sampling=SamplingParams(), stream=True, rid="unheard"
            )
            before = IncrementalDetokenizer(TOK.tokenizer)
            opened = token_frame(
                [streamed.req_id], [ids[:1]], [1], options=[DecodeOptions()], stats=[stats]
            )
            tm.handle_output(through(before, opened))
            assert streamed.take_pending()[0].ids == ids[:1] and not streamed.finished

            restarted = IncrementalDetokenizer(TOK.tokenizer)
            steady = token_frame([streamed.req_id, unheard.req_id], [ids[1:2], ids[1:2]], [2, 2])
            tm.handle_output(through(restarted, steady))
            tm.handle_output(through(restarted, token_frame([streamed.req_id], [ids[2:3]], [3])))
            outcome = (
                streamed.finished_reason,
                streamed.take_pending(),
                streamed.completion_tokens,
                unheard.finished_reason,
            )
            assert tm.states == {} and tm.num_aborted_requests == 2
            sent = [TO_SCHEDULER.decode(inbox.recv()) for _ in range(5)]
            assert not inbox.poll(200), "a lost request was aborted more than once"
            return outcome, sent
        finally:
            await tm.close()
            inbox.close(0)

    outcome, sent = asyncio.run(scenario())
    reason, pending, completion, unheard_reason = outcome
    assert reason == DETOKENIZER_LOST_TEXT and unheard_reason == DETOKENIZER_LOST_TEXT
    # The finish event carries nothing of the lost row: no ids without their text.
    assert [(c.text, c.ids) for c in pending] == [("", [])] and completion == 1
    # The manager's start-up abort, the two requests, then one abort per lost request.
    assert isinstance(sent[0], AbortReq) and sent[0].abort_all
    submitted = [s.req_id for s in sent[1:3] if isinstance(s, TokenizedGenerateReqInput)]
    aborts = [
        a
        for a in sent[3:]
        if isinstance(a, AbortReq) and not a.abort_all and a.reason == DETOKENIZER_LOST_TEXT.message
    ]
    assert len(submitted) == 2 and sorted(a.req_id or 0 for a in aborts) == sorted(submitted)
