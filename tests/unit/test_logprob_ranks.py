"""The rank column of prompt logprobs (docs/design/logprobs.md, Rank): vLLM's rank of each
prompt token (how many of the vocabulary's logprobs are at or above its own, itself
included), computed in the scheduler's batched pass, carried as one int32 column of the
prompt block only, read back by the API and shown in vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.columns import from_column
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    FrameLogprobs,
    LogprobParams,
    OutputLogprobs,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.logprob_columns import (
    TokenLogprobs,
    build_input_logprobs,
    build_output_logprobs,
    read_input_logprobs,
    read_input_token_logprobs,
)
from scheduler_proc.main import build_scheduler
from scheduler_proc.sampling.logprobs import step_logprobs, token_ranks
from tokenizer_proc.openai.vllm_extras import prompt_logprobs_entries
from tokenizer_proc.req_state import LogprobEntries

PROMPT = [(7 * i) % 3900 + 70 for i in range(12)]


def counted(lp: torch.Tensor, tokens: list[int]) -> list[int]:
    """The rank by its definition, one row at a time."""
    return [int((row >= row[t]).sum()) for row, t in zip(lp, tokens)]


def test_a_rank_counts_the_values_at_or_above_the_tokens_own() -> None:
    """vLLM v1's rule: the most likely token is 1, and tied tokens all take the largest rank
    among them (``batched_count_greater_than`` counts ``>=``)."""
    lp = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 1.0, 1.0]])
    assert token_ranks(lp, np.array([1, 3])).tolist() == [2, 4]
    assert token_ranks(lp, np.array([0, 2])).tolist() == [3, 4]
    assert token_ranks(lp[1:], np.array([0])).tolist() == [1]
    assert token_ranks(lp, np.array([2, 0])).dtype == np.int32


def test_a_ranked_step_keeps_the_values_and_adds_the_ranks() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    rows, tokens = np.array([4, 0, 2]), np.array([7, 99, 499])
    asks = [LogprobParams(top_logprobs_num=3, token_ids_logprob=(5, 6)), LogprobParams()] * 2
    plain = step_logprobs(logits, rows, tokens, asks[:3])
    ranked = step_logprobs(logits, rows, tokens, asks[:3], ranked=True)
    lp = torch.log_softmax(logits[torch.from_numpy(rows)], dim=-1)
    assert [len(p.ranks) for p in plain] == [0, 0, 0]
    assert [int(p.ranks[0]) for p in ranked] == counted(lp, tokens.tolist())
    for a, b in zip(plain, ranked):
        for name in ("chosen", "top_ids", "top_values", "ids_values"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name


def submit(s: object, req_id: int, start: int, top: int) -> None:
    s.add_request(  # type: ignore[attr-defined]
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=PROMPT,
            sampling_params=SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True),
            stream=True,
            arrival_time=time.time(),
            logprobs=LogprobParams(top_logprobs_num=top, logprob_start_len=start),
        )
    )


@pytest.mark.parametrize("chunk", [-1, 4], ids=["whole", "chunked"])
def test_prompt_positions_carry_their_ranks_through_the_wire(chunk: int) -> None:
    """Through the real scheduler (the prompt prefilled at once, or in chunks of 4 whose
    ranks are joined), each prompt position's rank is its token's count in the model's own
    log-softmax; output tokens' blocks carry no rank column."""
    s = build_scheduler(
        ServerConfig(max_total_tokens=8192, torch_threads=1, chunked_prefill_size=chunk)
    )
    submit(s, 0, 0, 0)
    submit(s, 1, 5, 2)
    prompt: dict[int, list[int]] = {}  # req_id -> its prompt positions' ranks
    while s.has_work():
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            req_ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
            lp = frame.logprobs or FrameLogprobs()
            assert lp.output is None or lp.output.ranks == b""
            if lp.input is not None:
                for i, row in read_input_logprobs(lp.input, len(req_ids)).items():
                    assert len(row.ranks) == len(row.chosen)
                    prompt[req_ids[i]] = row.ranks
    slots = s.kv.alloc(len(PROMPT))
    assert slots is not None
    _, hidden = s.runner.extend(
        [PROMPT], [torch.empty(0, dtype=torch.long)], [slots], return_hidden=True
    )
    assert hidden is not None
    with torch.inference_mode():
        ref = torch.log_softmax(s.runner.model.logits(hidden[:-1]).float(), dim=-1)
    assert {r: len(ranks) for r, ranks in prompt.items()} == {
        0: len(PROMPT) - 1,
        1: len(PROMPT) - 5,
    }
    for req_id, ranks in prompt.items():
        for q, rank in zip(range(max(5 * req_id, 1), len(PROMPT)), ranks):
            values, own = ref[q - 1], ref[q - 1, PROMPT[q]]
            # The same model: equal but for float noise in the reference's own forward.
            low, high = int((values > own + 1e-5).sum()) + 1, int((values >= own - 1e-5).sum())
            assert low <= rank <= high, (req_id, q)


def block(ranks: np.ndarray) -> TokenLogprobs:
    t = len(ranks) or 2
    return TokenLogprobs(
        np.full(t, -1.5, dtype=np.float32),
        np.zeros((t, 1), dtype=np.int32),
        np.zeros((t, 1), dtype=np.float32),
        np.zeros((t, 0), dtype=np.float32),
        ranks.astype(np.int32),
    )


def test_the_rank_column_is_read_back_and_checked() -> None:
    """Built and read back per row (the API's lists, the PD decode server's arrays); a rank
    column of another length is refused; a sender's block without it (an array of 7, as
    before the column) reads as no ranks; output blocks carry none."""
    sent = build_input_logprobs([0, 2], [block(np.array([3, 1, 40])), block(np.array([9]))])
    assert sent is not None
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=type(sent))
    assert [r.ranks for r in read_input_logprobs(got, 3).values()] == [[3, 1, 40], [9]]
    assert read_input_token_logprobs(got, 3)[2].ranks.tolist() == [9]
    bad = msgspec.structs.replace(
        got, logprobs=msgspec.structs.replace(got.logprobs, ranks=got.logprobs.ranks[:-4])
    )
    with pytest.raises(ValueError, match="rank"):
        read_input_logprobs(bad, 3)
    older = msgspec.msgpack.encode(msgspec.structs.astuple(got.logprobs)[:7])
    assert msgspec.msgpack.decode(older, type=OutputLogprobs).ranks == b""
    unranked = msgspec.structs.replace(
        got, logprobs=msgspec.msgpack.decode(older, type=OutputLogprobs)
    )
    assert [r.ranks for r in read_input_logprobs(unranked, 3).values()] == [[], []]
    output = build_output_logprobs([1], [block(np.array([], dtype=np.int32))])
    assert output is not None and output.ranks == b""


def test_prompt_logprobs_show_the_rank_column() -> None:
    """Each prompt token's rank is the column's; one among the shown top entries is listed
    once, with its place there (vLLM's top entries overwrite its own); without a column the
    rank outside the top is null."""
    prompt_ids = [1, 10, 20]
    top = [[(-0.1, 10), (-2.0, 11)], [(-0.5, 30), (-0.6, 31)]]
    entries = LogprobEntries(chosen=[-0.1, -7.0], top=top, ids=[[], []], ranks=[1, 812])
    shown = prompt_logprobs_entries(prompt_ids, entries, 2, None)
    assert shown[0] is None
    assert {k: v["rank"] for k, v in (shown[1] or {}).items()} == {"10": 1, "11": 2}
    assert {k: v["rank"] for k, v in (shown[2] or {}).items()} == {"20": 812, "30": 1, "31": 2}
    alone = prompt_logprobs_entries(prompt_ids, entries, 0, None)
    assert [list(e.values())[0]["rank"] for e in alone[1:] if e] == [1, 812]
    entries.ranks = []
    before = prompt_logprobs_entries(prompt_ids, entries, 2, None)
    assert (before[2] or {})["20"]["rank"] is None and (before[1] or {})["10"]["rank"] == 1
