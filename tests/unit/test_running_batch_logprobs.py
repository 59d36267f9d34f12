"""The running batch's pending-logprob columns (scheduler_proc/batch/running_batch.py): whatever
each row asked (top k, ids, nothing), however many steps its tokens wait, and whichever way
they leave (a steady row, a per-request row, the request leaving), they come out in token
order and equal what the per-row ``step_logprobs`` computes for the same logits."""

from __future__ import annotations

import time

import numpy as np
import torch

from pipeline.io_struct import LogprobParams, SamplingParams
from pipeline.logprob_columns import TokenLogprobs, read_output_logprobs
from scheduler_proc.sampling.logprobs import keep_decode_logprobs, step_logprobs
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.batch.running_batch import RunningBatch

VOCAB = 50
ASKS = [
    LogprobParams(top_logprobs_num=5, token_ids_logprob=(3, 9)),
    LogprobParams(),
    None,
    LogprobParams(top_logprobs_num=2),
]


def joined(req_id: int, ask: LogprobParams | None) -> Req:
    req = Req(
        rid=f"r{req_id}", req_id=req_id, input_ids=[1, 2, 3],
        sampling=SamplingParams(max_new_tokens=64), stream=True, stream_interval=1,
        arrival_time=time.time(), stats_pending=StatsPending(), logprob=ask,
    )  # fmt: skip
    req.output_ids.append(4)
    req.num_sent_tokens = 1  # its first row went out at the prefill
    req.num_computed = req.seq_len - 1
    req.kv_slots = torch.arange(req.num_computed)
    return req


def as_lists(part: TokenLogprobs) -> list[tuple[float, list[int], list[float], list[float]]]:
    return [
        (float(c), i.tolist(), v.tolist(), m.tolist())
        for c, i, v, m in zip(part.chosen, part.top_ids, part.top_values, part.ids_values)
    ]


def test_pending_logprobs_leave_in_order_by_every_way_out() -> None:
    gen = torch.Generator().manual_seed(0)
    reqs = [joined(i, ask) for i, ask in enumerate(ASKS)]
    expected: dict[int, list[TokenLogprobs]] = {i: [] for i in range(4)}
    # Request 3 joins with a first token's logprobs not yet sent (a non-streamed first row).
    first = step_logprobs(
        torch.randn((1, VOCAB), generator=gen), np.array([0]), np.array([4]), [ASKS[3]]
    )[0]
    reqs[3].pending_logprobs.append(first)
    reqs[3].num_sent_tokens = 0
    expected[3].append(first)
    batch = RunningBatch(context_length=64, vocab_size=VOCAB)
    batch.extend(reqs)
    assert reqs[3].pending_logprobs == []  # the row holds them now

    def step() -> None:
        logits = torch.randn((len(batch), VOCAB), generator=gen)
        new = torch.randint(0, VOCAB, (len(batch),), generator=gen).numpy()
        batch.append_tokens(new)
        rows = np.flatnonzero(batch.wants_logprobs[: len(batch)])
        keep_decode_logprobs(batch, logits, rows, new)
        parts = step_logprobs(
            logits, rows, new[rows], [batch.reqs[i].logprob for i in rows.tolist()]
        )  # type: ignore[misc]
        for i, part in zip(rows.tolist(), parts):
            expected[batch.reqs[i].req_id].append(part)

    def due(req_id: int) -> list[tuple[float, list[int], list[float], list[float]]]:
        return as_lists(TokenLogprobs.join(expected.pop(req_id))) if req_id in expected else []

    for _ in range(6):  # more steps than the table's first room: it widens
        step()
    steady = batch.take_steady(np.arange(len(batch)))
    assert steady.logprobs is not None
    counts = steady.counts.tolist()
    got = read_output_logprobs(steady.logprobs.columns(), counts)
    assert sorted(got) == [0, 1, 3]  # row 2 asked nothing
    for row in (0, 1, 3):
        want = due(row)
        expected[row] = []
        assert len(got[row].chosen) == counts[row] == len(want) == (7 if row == 3 else 6)
        assert got[row].chosen == [w[0] for w in want]
        assert got[row].top == [list(zip(w[2], w[1])) for w in want]
        assert got[row].ids == [w[3] for w in want]

    step()
    step()
    batch.sync(reqs[1])  # its row goes out the per-request way, as BatchDecoder._events sends it
    batch.hand_over_logprobs(reqs[1])
    reqs[1].num_sent_tokens = len(reqs[1].output_ids)
    batch.note_sent(reqs[1])
    assert as_lists(reqs[1].take_pending_logprobs()) == due(1)  # type: ignore[arg-type]
    expected[1] = []
    step()
    batch.remove(reqs[0])  # it leaves: its row's logprobs go back to it
    assert as_lists(reqs[0].take_pending_logprobs()) == due(0)  # type: ignore[arg-type]
    step()  # rows moved (swap-remove): each keeps its own
    rest = batch.take_steady(np.arange(len(batch)))
    columns = rest.logprobs.columns()  # type: ignore[union-attr]
    got = read_output_logprobs(columns, rest.counts.tolist())
    for row, req in enumerate(batch.reqs):
        if req.logprob is not None:
            assert got[row].chosen == [w[0] for w in due(req.req_id)]
