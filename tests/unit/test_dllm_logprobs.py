"""Logprobs in ``--mode dllm``, in process: each committed token's are the raw
log-softmax of the logits of the pass that committed it, checked against a plain reference
loop (one full forward per pass of each request alone, no KV reuse, no batching); rows
that ask beside rows that do not, uneven passes, blocks cut by max_new_tokens, retraction,
and prompt logprobs from the prefill. The end-to-end check is in tests/e2e/test_dllm.py."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
import torch

import scheduler_proc.dllm as dllm_module
from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    BatchTokenIDOutput,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import read_input_logprobs, read_output_logprobs
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.req import Req
from scheduler_proc.sampling.sampler import SamplingColumns, draw_counter, sample
from scheduler_proc.scheduler import Scheduler

B = 4
MASK = 0  # the shipped tokenizer's <|endoftext|>: scheduler_proc.main.dllm_config
MAX_NEW = 10  # not a multiple of B: the last block is cut
PROMPTS = [[(11 * i + 17 * j) % 3900 + 60 for i in range(9 + 5 * j)] for j in range(5)]
ASK = LogprobParams(top_logprobs_num=4, token_ids_logprob=(5, 77, 1000))

Entry = tuple[
    float, list[tuple[float, int]], list[float]
]  # chosen, top (value, id), asked ids' values


def make(steps: int, pool: int = 8192) -> Scheduler:
    return build_scheduler(
        ServerConfig(
            mode="dllm", dllm_block_size=B, dllm_steps=steps, max_total_tokens=pool, torch_threads=1
        )
    )


def submit(
    s: Scheduler,
    req_id: int,
    params: SamplingParams,
    ask: LogprobParams | None,
    *,
    stream: bool = True,
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=PROMPTS[req_id % len(PROMPTS)],
            sampling_params=msgspec.structs.replace(
                params, max_new_tokens=MAX_NEW, ignore_eos=True
            ),
            stream=stream,
            arrival_time=time.time(),
            logprobs=ask,
        )
    )


def run(
    s: Scheduler, arrivals: list[Callable[[], None]] | None = None
) -> tuple[dict[int, list[int]], dict[int, list[Entry]], dict[int, list[Entry]], int]:
    """Tokens, output and prompt logprob entries per request, read back from encoded
    frames (a row's output entries are exactly its tokens'); and how many frames carried no
    logprob columns. ``arrivals`` run one before each step."""
    tokens: dict[int, list[int]] = {}
    entries: dict[int, list[Entry]] = {}
    prompt: dict[int, list[Entry]] = {}
    without = 0
    pending = list(arrivals or [])
    while s.has_work() or pending:
        if pending:
            pending.pop(0)()
        for frame in s.step():
            assert isinstance(frame, BatchTokenIDOutput)
            frame = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=BatchTokenIDOutput)
            ids = from_column(frame.req_ids, REQ_ID_DTYPE).tolist()
            rows = split_token_rows(frame.output_ids, frame.output_counts)
            lp = frame.logprobs
            without += lp is None
            out = (
                read_output_logprobs(lp.output, [len(r) for r in rows])
                if lp is not None and lp.output is not None
                else {}
            )
            inp = (
                read_input_logprobs(lp.input, len(rows))
                if lp is not None and lp.input is not None
                else {}
            )
            for i, (req_id, row) in enumerate(zip(ids, rows)):
                tokens.setdefault(req_id, []).extend(row)
                if i in out:
                    assert len(out[i].chosen) == len(row), "a row's entries are its own tokens'"
                    entries.setdefault(req_id, []).extend(
                        zip(out[i].chosen, out[i].top, out[i].ids)
                    )
                if i in inp:
                    assert req_id not in prompt, "prompt logprobs are sent once"
                    prompt[req_id] = list(zip(inp[i].chosen, inp[i].top, inp[i].ids))
    return tokens, entries, prompt, without


def reference_decode(
    runner: ModelRunner,
    prompt: list[int],
    params: SamplingParams,
    seed: int,
    steps: int,
    max_new: int = MAX_NEW,
) -> tuple[list[int], list[torch.Tensor]]:
    """What a dLLM request commits, and per token the log-softmax of the logits of the pass
    that committed it, by a plain loop: each pass is a full forward of prompt + committed
    tokens + the block, alone, from scratch (the block's positions attend to each other
    both ways); candidates as the sampler draws them at (output index, pass); the most
    confident ``B // steps (+1)`` positions commit, all that remain on the last pass."""
    out: list[int] = []
    logprobs: list[torch.Tensor] = []
    while len(out) < max_new:
        seq = prompt + out
        block, by_position = [MASK] * B, [torch.empty(0)] * B
        masked = [True] * B
        for p in range(steps):
            positions = [j for j in range(B) if masked[j]]
            ids = seq + block
            slots = runner.kv.alloc(len(ids))
            assert slots is not None
            rows = torch.tensor([len(seq) - 1 + j for j in positions])
            logits = runner.logits_at(
                [ids], [torch.empty(0, dtype=torch.long)], [slots], rows, [len(seq)]
            )
            runner.kv.free(slots)
            n = len(positions)
            cols = SamplingColumns.from_requests(
                [params] * n, [seed] * n, [draw_counter(len(out) + j, p) for j in positions],
                [prompt] * n, [out] * n, logits.shape[-1], logits.device,
            )  # fmt: skip
            drawn = sample(logits, cols).tolist()
            confidence = [float(torch.softmax(logits[i], dim=-1)[drawn[i]]) for i in range(n)]
            take = B // steps + (p < B % steps) if p < steps - 1 else B
            for i in sorted(range(n), key=lambda i: (-confidence[i], positions[i]))[:take]:
                block[positions[i]], masked[positions[i]] = drawn[i], False
                by_position[positions[i]] = torch.log_softmax(logits[i].float(), dim=-1)
        keep = min(B, max_new - len(out))
        out += block[:keep]
        logprobs += by_position[:keep]
    return out, logprobs


def assert_entries_match(
    entries: list[Entry], out: list[int], ref: list[torch.Tensor], ask: LogprobParams
) -> None:
    assert len(entries) == len(out) == len(ref), "a token without its logprobs, or one sent twice"
    for j, (chosen, top, ids) in enumerate(entries):
        assert chosen == pytest.approx(float(ref[j][out[j]]), abs=1e-4), j
        k = ask.top_logprobs_num
        values, top_ids = (
            ref[j].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        )
        assert [t for _, t in top] == top_ids.tolist(), j
        assert [v for v, _ in top] == pytest.approx(values.tolist(), abs=1e-4), j
        assert ids == pytest.approx([float(ref[j][t]) for t in ask.token_ids_logprob], abs=1e-4), j


REQUESTS: list[tuple[SamplingParams, LogprobParams | None, bool]] = [
    (SamplingParams(temperature=0.0), ASK, True),
    # Sampled, biased and penalized: the logprobs stay the raw distribution's.
    (
        SamplingParams(
            temperature=0.9, top_k=40, seed=3, frequency_penalty=0.5, logit_bias=((77, 5.0),)
        ),
        ASK,
        True,
    ),
    (SamplingParams(temperature=0.0), None, True),  # asks nothing, beside rows that do
    (
        SamplingParams(temperature=1.1, seed=4),
        LogprobParams(),
        False,
    ),  # the chosen token's only, one finished row
    (
        SamplingParams(temperature=0.0),
        LogprobParams(top_logprobs_num=2, token_ids_logprob=(9,)),
        True,
    ),
]


@pytest.mark.parametrize(
    ("steps", "pool"),
    [(2, 8192), (3, 8192), (3, sum(len(p) for p in PROMPTS) + 32)],
    ids=["2-passes", "3-passes", "retracting"],
)
def test_each_committed_token_has_the_logprobs_of_the_pass_that_committed_it(
    steps: int, pool: int
) -> None:
    s = make(steps, pool)
    calls: list[int] = []
    batched = dllm_module.span_logprobs

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(len(args[3]))
        return batched(*args, **kwargs)

    dropped_with_logprobs = (
        0  # blocks dropped mid-way (retraction) holding committed positions' logprobs
    )
    drop = s.mode.drop_block

    def counting_drop(req: Req) -> None:
        nonlocal dropped_with_logprobs
        block = req.dllm_block
        dropped_with_logprobs += (
            block is not None and block.logprobs is not None and not all(block.masked)
        )
        drop(req)

    s.mode.drop_block = counting_drop  # type: ignore[method-assign]
    dllm_module.span_logprobs = counting  # type: ignore[assignment]
    try:
        # One arrival per step, so that passes mix block starts and blocks mid-way.
        arrivals = [
            lambda i=i, r=r: submit(s, i, r[0], r[1], stream=r[2]) for i, r in enumerate(REQUESTS)
        ]
        tokens, entries, _, _ = run(s, arrivals)  # type: ignore[arg-type]
    finally:
        dllm_module.span_logprobs = batched  # type: ignore[assignment]
    if pool < 8192:
        assert s.num_retracted_total > 0 and dropped_with_logprobs > 0, (
            "no retraction dropped a block holding logprobs"
        )
    assert 2 not in entries
    assert max(calls) > 1, "one batched computation per pass covers every request that asked"
    runner = make(steps).runner  # the same model, with room for the reference's forwards
    for req_id, (params, ask, _) in enumerate(REQUESTS):
        assert len(tokens[req_id]) == MAX_NEW
        if ask is None:
            continue
        req_seed = params.seed if params.seed is not None else 0
        out, ref = reference_decode(runner, PROMPTS[req_id], params, req_seed, steps)
        assert tokens[req_id] == out, req_id
        assert_entries_match(entries[req_id], out, ref, ask)
    # The sampled row drew a token other than the most likely one somewhere (so the check
    # above would catch values taken after bias, penalties or temperature).
    assert any(chosen < top[0][0] for chosen, top, _ in entries[1])


def test_nothing_is_computed_when_no_row_asks() -> None:
    s = make(2)
    calls = 0
    batched = dllm_module.span_logprobs

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return batched(*args, **kwargs)

    dllm_module.span_logprobs = counting  # type: ignore[assignment]
    try:
        submit(s, 0, SamplingParams(temperature=0.0), None)
        submit(s, 1, SamplingParams(temperature=0.7, seed=1), None, stream=False)
        _, entries, prompt, without = run(s)
    finally:
        dllm_module.span_logprobs = batched  # type: ignore[assignment]
    assert calls == 0 and entries == {} and prompt == {} and without > 0


def test_prompt_logprobs_come_from_the_prefill() -> None:
    """From logprob_start_len on (position 0 has none), on the first row only; the same
    again once the prompt is in the prefix cache; and with the output's."""
    s = make(2)
    ask = LogprobParams(top_logprobs_num=3, logprob_start_len=2, token_ids_logprob=(5, 77))
    prompt_ids = PROMPTS[3]
    slots = s.kv.alloc(len(prompt_ids))
    assert slots is not None
    _, hidden = s.runner.extend(
        [prompt_ids], [torch.empty(0, dtype=torch.long)], [slots], return_hidden=True
    )
    assert hidden is not None
    ref = torch.log_softmax(s.runner.logits(hidden).float(), dim=-1)  # row q - 1 predicts token q
    s.kv.free(slots)
    for attempt in range(2):  # the second finds the prompt cached
        submit(s, 3 + 5 * attempt, SamplingParams(temperature=0.0), ask)
        tokens, entries, prompt, _ = run(s)
        got = prompt[3 + 5 * attempt]
        assert len(got) == len(prompt_ids) - 2 and len(entries[3 + 5 * attempt]) == MAX_NEW
        for q, (chosen, top, ids) in zip(range(2, len(prompt_ids)), got):
            assert chosen == pytest.approx(float(ref[q - 1, prompt_ids[q]]), abs=1e-4), (attempt, q)
            assert [t for _, t in top] == ref[q - 1].topk(3).indices.tolist()
            assert ids == pytest.approx([float(ref[q - 1, t]) for t in (5, 77)], abs=1e-4)
