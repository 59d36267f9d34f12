"""Output-token logprobs through the real scheduler: each row carries the logprobs of
exactly the tokens it carries (stream intervals, non-streamed, retraction), and they are
the model's raw log-softmax, computed here again by a full forward per token."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import read_output_logprobs
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler

MAX_NEW = 10
PROMPTS = [[(5 * i + 13 * j) % 3900 + 70 for i in range(10 + 4 * j)] for j in range(4)]
ASK = LogprobParams(top_logprobs_num=4, token_ids_logprob=(5, 77, 1000))


def make(pool: int = 8192) -> Scheduler:
    return build_scheduler(ServerConfig(max_total_tokens=pool, torch_threads=1))


def submit(
    s: Scheduler,
    req_id: int,
    params: SamplingParams,
    ask: LogprobParams | None,
    *,
    stream: bool = True,
    interval: int | None = None,
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=PROMPTS[req_id % len(PROMPTS)],
            sampling_params=msgspec.structs.replace(
                params, max_new_tokens=MAX_NEW, ignore_eos=True, stream_interval=interval
            ),
            stream=stream,
            arrival_time=time.time(),
            logprobs=ask,
        )
    )


def run(
    s: Scheduler,
) -> tuple[
    dict[int, list[int]], dict[int, list[tuple[float, list[tuple[float, int]], list[float]]]], int
]:
    """Tokens and (chosen, top, ids) logprob entries per request, read back from encoded
    frames; and how many token frames carried no logprob columns."""
    tokens: dict[int, list[int]] = {}
    entries: dict[int, list[tuple[float, list[tuple[float, int]], list[float]]]] = {}
    without = 0
    while s.has_work():
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            lp = frame.logprobs.output if frame.logprobs is not None else None
            per_row = read_output_logprobs(lp, [len(r) for r in rows]) if lp is not None else {}
            without += frame.logprobs is None
            for i, (req_id, row) in enumerate(zip(ids, rows)):
                tokens.setdefault(req_id, []).extend(row)
                if i in per_row:
                    lp = per_row[i]
                    assert len(lp.chosen) == len(row)
                    entries.setdefault(req_id, []).extend(zip(lp.chosen, lp.top, lp.ids))
    return tokens, entries, without


def reference(s: Scheduler, prompt: list[int], out: list[int]) -> torch.Tensor:
    """log_softmax of the logits that predicted each output token: a full forward of the
    prompt and all but the last output token, no KV reuse."""
    ids = prompt + out[:-1]
    slots = s.kv.alloc(len(ids))
    assert slots is not None
    _, hidden = s.runner.extend(
        [ids], [torch.empty(0, dtype=torch.long)], [slots], return_hidden=True
    )
    s.kv.free(slots)
    assert hidden is not None
    with torch.inference_mode():
        logits = s.runner.model.logits(hidden[len(prompt) - 1 :])
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize(
    "pool", [8192, sum(len(p) for p in PROMPTS) + 20], ids=["roomy", "retracting"]
)
def test_each_row_carries_the_raw_logprobs_of_its_tokens(pool: int) -> None:
    s = make(pool)
    submit(s, 0, SamplingParams(temperature=0.0), ASK)
    submit(
        s,
        1,
        SamplingParams(temperature=0.9, top_p=0.8, seed=3, frequency_penalty=1.0),
        ASK,
        interval=3,
    )
    submit(s, 2, SamplingParams(temperature=0.0), None)  # asks nothing, beside rows that do
    submit(s, 3, SamplingParams(temperature=1.3, top_k=5, seed=4), LogprobParams(), stream=False)
    tokens, entries, _ = run(s)
    if pool < 8192:
        assert s.num_retracted_total > 0, "the small pool forced no retraction"
    assert 2 not in entries
    roomy = make()  # the same model, with room for the reference's full forwards
    for req_id in (0, 1, 3):
        out = tokens[req_id]
        assert len(out) == MAX_NEW and len(entries[req_id]) == MAX_NEW, (
            "a token without its logprobs, or one sent twice"
        )
        ref = reference(roomy, PROMPTS[req_id], out)
        for j, (chosen, top, ids) in enumerate(entries[req_id]):
            assert chosen == pytest.approx(float(ref[j, out[j]]), abs=1e-4)
            k = 4 if req_id != 3 else 0
            want_values, want_ids = ref[j].topk(k) if k else (torch.empty(0), torch.empty(0))
            assert [t for _, t in top] == want_ids.tolist()
            assert [v for v, _ in top] == pytest.approx(want_values.tolist(), abs=1e-4)
            want_ids_values = (
                [float(ref[j, t]) for t in ASK.token_ids_logprob] if req_id != 3 else []
            )
            assert ids == pytest.approx(want_ids_values, abs=1e-4)


def test_a_frame_in_which_no_row_asked_carries_no_logprob_columns() -> None:
    s = make()
    submit(s, 0, SamplingParams(temperature=0.0), None)
    submit(s, 1, SamplingParams(temperature=0.7, seed=1), None)
    _, entries, without = run(s)
    assert entries == {} and without > 0
