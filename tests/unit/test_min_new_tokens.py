"""``min_new_tokens`` bans what would stop a request (docs/design.md section 10): while its
output is shorter than the minimum, a request never draws EOS or one of its
``stop_token_ids``, on every path that draws (the prefill's first token, the decode step,
a dLLM pass, a PD pair). A logit_bias of 100 on the stop token outweighs every logit of the
built-in model, so without the ban every draw would be that token.

In-process schedulers (real model, real pools), as in tests/unit/test_scheduler_steps.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    FinishLength,
    FinishReason,
    FinishStop,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import read_token_logprobs
from scheduler_proc.main import build_scheduler
from scheduler_proc.scheduler import Scheduler
from tests.unit.test_pd_scheduler import Row, make, run
from tests.unit.test_pd_scheduler import submit as pd_submit

EOS = 0  # the shipped tokenizer's <|endoftext|>
STOP_ID = 70
MIN_NEW = 5
PROMPT = [(11 * i + 7) % 3000 + 60 for i in range(20)]
SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 1.0, "seed": 5}, id="seeded"),
    pytest.param({"temperature": 0.8, "top_k": 20, "seed": 6}, id="top_k"),
    pytest.param({"temperature": 0.8, "top_p": 0.9, "min_p": 0.05, "seed": 7}, id="top_p"),
]


def submit(
    s: Scheduler, req_id: int, sampling: SamplingParams, logprobs: LogprobParams | None = None
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=PROMPT,
            sampling_params=sampling,
            stream=True,
            arrival_time=time.time(),
            logprobs=logprobs,
        )
    )


def outputs(
    s: Scheduler,
) -> tuple[dict[int, list[int]], dict[int, FinishReason], dict[int, list[list[float]]]]:
    """Each request's tokens, its finish, and per token the logprobs of the ids it asked."""
    tokens: dict[int, list[int]] = {}
    finished: dict[int, FinishReason] = {}
    asked: dict[int, list[list[float]]] = {}
    while s.has_work():
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            lp = frame.logprobs
            per_row = (
                read_token_logprobs(lp.output, [len(r) for r in rows])
                if lp is not None and lp.output is not None
                else {}
            )
            for i, req_id in enumerate(ids):
                tokens.setdefault(req_id, []).extend(rows[i])
                if i in per_row:
                    asked.setdefault(req_id, []).extend(per_row[i].ids_values.tolist())
                reason = frame.finished_reasons[i] if frame.finished_reasons is not None else None
                if reason is not None:
                    finished[req_id] = reason
    return tokens, finished, asked


def pushed(stop: int, **params: object) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=12, min_new_tokens=MIN_NEW, logit_bias=((stop, 100.0),), **params
    )  # type: ignore[arg-type]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_eos_and_stop_ids_are_never_drawn_before_min_new_tokens(
    sampling: dict[str, object],
) -> None:
    """The first token comes from the prefill pass, the others from decode steps; beside
    them runs a request without a minimum, which the bias stops at once."""
    s = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    submit(s, 1, pushed(EOS, **sampling))
    submit(s, 2, pushed(STOP_ID, stop_token_ids=(STOP_ID,), ignore_eos=True, **sampling))
    params = SamplingParams(
        max_new_tokens=12,
        logit_bias=((EOS, 100.0),),
        **sampling,  # type: ignore[arg-type]
    )
    submit(s, 3, params)
    tokens, finished, _ = outputs(s)
    for req_id, stop in ((1, EOS), (2, STOP_ID)):
        assert stop not in tokens[req_id][:MIN_NEW], (req_id, tokens[req_id])
        # Past the minimum the bias wins again: the next token stops the request.
        assert tokens[req_id] == [*tokens[req_id][:MIN_NEW], stop], (req_id, tokens[req_id])
        assert finished[req_id] == FinishStop(matched=stop)
    assert tokens[3] == [EOS] and finished[3] == FinishStop(matched=EOS), (
        "a request without a minimum is not banned"
    )


def test_eos_is_banned_before_min_new_tokens_with_ignore_eos_too() -> None:
    """As SGLang and vLLM do: their min-tokens ban takes EOS whatever ignore_eos says."""
    s = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    submit(s, 1, pushed(EOS, ignore_eos=True, temperature=0.0))
    tokens, finished, _ = outputs(s)
    assert EOS not in tokens[1][:MIN_NEW] and tokens[1][MIN_NEW:] == [EOS] * 7, tokens[1]
    assert finished[1] == FinishLength(length=12)


def test_the_ban_leaves_logprobs_the_raw_distribution() -> None:
    """EOS's logprob at every position, banned or not, is what the model gave it (before
    bias and ban): neither the ban's floor nor the near certainty of the +100 bias."""
    s = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    submit(s, 1, pushed(EOS, temperature=0.0), LogprobParams(token_ids_logprob=(EOS,)))
    tokens, _, asked = outputs(s)
    eos = np.array(asked[1])[:, 0]
    assert len(eos) == len(tokens[1]) == MIN_NEW + 1
    assert ((eos > -50.0) & (eos < -1.0)).all(), eos


def test_a_dllm_block_draws_no_stop_before_min_new_tokens() -> None:
    """Block size 4: the ban covers the first block and the first position of the
    second (output index 4), by each position's own output index."""
    s = build_scheduler(
        ServerConfig(
            max_total_tokens=4096, torch_threads=1, mode="dllm", dllm_block_size=4, dllm_steps=2
        )
    )
    submit(s, 1, pushed(EOS, temperature=0.0))
    submit(
        s, 2, pushed(STOP_ID, stop_token_ids=(STOP_ID,), ignore_eos=True, temperature=1.0, seed=9)
    )
    tokens, finished, _ = outputs(s)
    for req_id, stop in ((1, EOS), (2, STOP_ID)):
        assert stop not in tokens[req_id][:MIN_NEW], (req_id, tokens[req_id])
        assert tokens[req_id][MIN_NEW:] == [stop] and finished[req_id] == FinishStop(
            matched=stop
        ), (req_id, tokens[req_id])


def test_a_pd_pair_draws_no_stop_before_min_new_tokens(tmp_path: Path) -> None:
    """The prefill server draws token 0, the decode server the rest."""
    prefill, _ = make("prefill", tmp_path)
    decode, _ = make("decode", tmp_path)
    sampling = pushed(EOS, temperature=0.0)
    pd_submit(prefill, 1, PROMPT, room=77, max_new=1, sampling=sampling)
    pd_submit(
        decode,
        1,
        PROMPT,
        room=77,
        endpoint=f"ipc://{tmp_path / 'kv'}",
        max_new=12,
        sampling=sampling,
    )
    out: dict[int, list[Row]] = {}
    run([prefill, decode], out)
    got = [t for row in out[1] for t in row.tokens]
    assert EOS not in got[:MIN_NEW] and got[MIN_NEW:] == [EOS], got
    assert out[1][-1].finished == FinishStop(matched=EOS)


def test_the_ban_draws_the_same_tokens_whatever_the_batch() -> None:
    """Seeded requests with a minimum draw the same alone as beside others that ban
    nothing or ban other ids."""
    sampling = pushed(STOP_ID, stop_token_ids=(STOP_ID,), ignore_eos=True, temperature=1.0, seed=21)
    alone = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    submit(alone, 1, sampling)
    want = outputs(alone)[0][1]
    crowd = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    submit(crowd, 7, SamplingParams(max_new_tokens=12, temperature=0.7, seed=3))
    submit(crowd, 8, pushed(EOS, temperature=0.5, seed=4))
    submit(crowd, 1, sampling)
    assert outputs(crowd)[0][1] == want
