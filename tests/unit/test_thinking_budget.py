"""Thinking budgets in the scheduler (scheduler_proc/sampling/thinking_budget.py): a request
with ``thinking_budget`` k takes the ``thinking_end`` ids at output positions k, k+1, ...
unless its output holds them already, then goes on as the model would after them; the
same tokens through the overlap schedule, a retraction in the middle of the end, and a PD
hand-over; a grammar gated on the end opens after a forced one. In-process schedulers with
the built-in random model, as in tests/unit/test_reasoning_gate.py.

``END`` stands for ``</think>``: two ids, to show the end is forced in order."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    FinishAbort,
    FinishStop,
    LogprobParams,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from scheduler_proc.retraction import retract
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.main import build_scheduler
from scheduler_proc.sampling.sampler import ForcedTokens, SamplingColumns, sample
from scheduler_proc.scheduler import Scheduler
from tokenizer_proc.request_checks import RequestChecks
from tokenizer_proc.request_edge.errors import RequestValidationError
from tests.unit.test_grammar import EOS, PROMPT, REGEX, TOKENIZER, constraint
from tests.unit.test_pd_scheduler import Row, collect
from tests.unit.test_pd_scheduler import make as make_pd
from tests.unit.test_pd_scheduler import run as run_pd
from tests.unit.test_reasoning_gate import split

END = tuple(TOKENIZER.encode(" therefore so"))  # two tokens in the shipped vocabulary
MAX_NEW = 24
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
SEEDED = msgspec.structs.replace(GREEDY, temperature=1.0, seed=9)
ASK_END = LogprobParams(token_ids_logprob=END)  # each position's logprobs of the end's ids

Hook = Callable[[Scheduler], None]


def budget(k: int | None, base: SamplingParams = GREEDY, **kw: object) -> SamplingParams:
    return msgspec.structs.replace(base, thinking_budget=k, thinking_end=END, **kw)


def make(*, overlap: bool = False, mode: str = "generate") -> Scheduler:
    config = ServerConfig(
        max_total_tokens=8192,
        torch_threads=1,
        disable_overlap_schedule=not overlap,
        mode=mode,  # type: ignore[arg-type]
    )
    return build_scheduler(config)


def submit(s: Scheduler, req_id: int, params: SamplingParams, prompt: list[int] = PROMPT) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=prompt,
            sampling_params=params,
            stream=True,
            arrival_time=time.time(),
            logprobs=ASK_END,
        )
    )


def run(s: Scheduler, on_step: Hook | None = None) -> dict[int, list[Row]]:
    out: dict[int, list[Row]] = {}
    while s.has_work():
        frames: list[object] = list(s.step())
        collect(frames, out)
        if on_step is not None:
            on_step(s)
    s.close()
    return out


def tokens(rows: list[Row]) -> list[int]:
    return [t for row in rows for t in row.tokens]


def answers(requests: dict[int, SamplingParams], **kw: object) -> dict[int, list[int]]:
    """Each request's output, the requests batched together in one scheduler."""
    s = make(**kw)  # type: ignore[arg-type]
    for req_id, params in requests.items():
        submit(s, req_id, params)
    return {req_id: tokens(rows) for req_id, rows in run(s).items()}


# The requests batched in the tests below: by id, its budget (None: none) and sampling.
BUDGETS = {1: 0, 2: 1, 3: 5, 4: None}
MIXED = {
    **{i: budget(k) if k is not None else GREEDY for i, k in BUDGETS.items()},
    5: budget(3, SEEDED),
    6: SEEDED,
}


@pytest.fixture(scope="module")
def mixed() -> dict[int, list[int]]:
    return answers(MIXED)


def test_a_spent_budget_forces_the_end_then_the_model_goes_on(
    mixed: dict[int, list[int]],
) -> None:
    """Greedy and seeded rows batched together: the budgeted ones equal the free ones up to
    k, hold the end at k and k+1, and then equal the greedy continuation of the prompt plus
    that forced prefix (the model goes on freely)."""
    free = mixed[4]
    assert END[0] not in free and END[1] not in free, "the model wrote the end by itself"
    for req_id, k in ((1, 0), (2, 1), (3, 5)):
        out = mixed[req_id]
        assert out[:k] == free[:k] and tuple(out[k : k + 2]) == END, (k, out)
        prefix = out[: k + 2]
        s = make()
        rest = msgspec.structs.replace(GREEDY, max_new_tokens=MAX_NEW - k - 2)
        submit(s, 0, rest, PROMPT + prefix)
        assert tokens(run(s)[0]) == out[k + 2 :], k
    seeded = mixed[5]
    assert seeded[:3] == mixed[6][:3] and tuple(seeded[3:5]) == END
    assert len(set(map(len, mixed.values()))) == 1, "a forced token is an output token"


def test_an_end_the_model_wrote_itself_forces_nothing(mixed: dict[int, list[int]]) -> None:
    """An end the output holds before its budget is spent (here the model's own tokens at
    positions 2 and 3 stand for the end) leaves the request as it would be without one."""
    free = mixed[4]
    own_end = (free[2], free[3])
    params = msgspec.structs.replace(GREEDY, thinking_budget=6, thinking_end=own_end)
    assert answers({1: params, 2: GREEDY}) == {1: free, 2: free}


def test_forced_tokens_report_the_models_logprobs(mixed: dict[int, list[int]]) -> None:
    """A forced token's logprob is the model's raw value for it: at position k, what the
    free request (same tokens before k) gives the end's first id; then the end's second."""
    s = make()
    submit(s, 3, MIXED[3])
    submit(s, 4, MIXED[4])
    out = run(s)
    forced = [row.logprobs for row in out[3] if row.logprobs is not None]
    free = [row.logprobs for row in out[4] if row.logprobs is not None]
    chosen = np.concatenate([lp.chosen for lp in forced])
    asked = np.concatenate([lp.ids_values for lp in forced])
    free_asked = np.concatenate([lp.ids_values for lp in free])
    assert chosen[5] == free_asked[5, 0] == asked[5, 0]
    assert chosen[6] == asked[6, 1]
    assert -np.inf < chosen[5] < -1.0 and -np.inf < chosen[6] < 0, "the forced logprobs"


def test_a_forced_row_takes_its_token_and_its_neighbours_draw_as_before() -> None:
    """The sampler alone: greedy and seeded rows, one forced to a token its logits make
    unlikely; every other row draws what it draws unforced."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((6, 4096), generator=gen)
    params = [GREEDY, SEEDED, GREEDY, SEEDED, msgspec.structs.replace(SEEDED, top_p=0.9), GREEDY]
    unlikely = int(logits[1].argmin())

    def draw(forced: ForcedTokens | None) -> np.ndarray:
        cols = SamplingColumns.from_requests(
            params, [7] * 6, [0] * 6, [[1]] * 6, [[]] * 6, 4096, "cpu", forced=forced
        )
        return sample(logits, cols)

    free = draw(None)
    forced = draw(ForcedTokens(np.array([1, 4]), np.array([unlikely, END[1]])))
    assert free[1] != unlikely and free[4] != END[1]
    assert forced[1] == unlikely and forced[4] == END[1]
    assert np.array_equal(np.delete(forced, [1, 4]), np.delete(free, [1, 4]))


def retract_mid_end(retracted: list[int]) -> Hook:
    """Retracts each budgeted request once, right after its first forced id (for budget 0
    that is its first token, from the prefill): it re-prefills and must force the second."""

    def hook(s: Scheduler) -> None:
        batch = s.running
        assert isinstance(batch, RunningBatch)
        for req in list(batch.reqs):
            k = req.sampling.thinking_budget
            out_len = int(batch.output_len()[batch.row_of(req)])
            if k is not None and req.req_id not in retracted and out_len == k + 1:
                batch.remove(req)
                retract(s, req, time.time())
                retracted.append(req.req_id)

    return hook


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "overlap"])
def test_the_overlap_schedule_and_a_retraction_mid_end_change_no_token(
    overlap: bool, mixed: dict[int, list[int]]
) -> None:
    assert answers(MIXED, overlap=overlap) == mixed
    s = make(overlap=overlap)
    for req_id, params in MIXED.items():
        submit(s, req_id, params)
    retracted: list[int] = []
    out = run(s, retract_mid_end(retracted))
    assert sorted(retracted) == [1, 2, 3, 5]
    assert {req_id: tokens(rows) for req_id, rows in out.items()} == mixed


def test_a_pd_hand_over_forces_the_rest_of_the_end(
    tmp_path: Path, mixed: dict[int, list[int]]
) -> None:
    """The prefill server forces a first token of budget 0; the decode server, holding the
    end's first id in the output it inherits, forces the second."""
    prefill, _ = make_pd("prefill", tmp_path)
    decode, _ = make_pd("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    for req_id in (1, 2, 4):
        params = MIXED[req_id]
        for side, max_new, where in ((prefill, 1, None), (decode, MAX_NEW, endpoint)):
            side.add_request(
                TokenizedGenerateReqInput(
                    rid=f"r{req_id}",
                    req_id=req_id,
                    input_ids=PROMPT,
                    sampling_params=msgspec.structs.replace(params, max_new_tokens=max_new),
                    stream=True,
                    arrival_time=time.time(),
                    bootstrap_room=700 + req_id,
                    bootstrap_endpoint=where,
                )
            )
    rows: dict[int, list[Row]] = {}
    run_pd([prefill, decode], rows)
    got = {req_id: tokens(r) for req_id, r in rows.items()}
    assert tuple(got[1][:2]) == END and tuple(got[2][1:3]) == END
    assert got == {req_id: mixed[req_id] for req_id in (1, 2, 4)}


def test_a_grammar_after_reasoning_opens_after_a_forced_end() -> None:
    """A regex gated on the end (a chat request with a reasoning parser) applies from the
    token after a forced end, as after the model's own; a grammar that applies from the
    first token is never forced (its grammar decides every token)."""
    gated = msgspec.structs.replace(constraint("regex"), reasoning_end=END)
    s = make()
    for req_id, c, k in ((1, gated, 4), (2, constraint("regex"), 0)):
        s.add_request(
            TokenizedGenerateReqInput(
                rid=f"r{req_id}",
                req_id=req_id,
                input_ids=PROMPT,
                sampling_params=budget(k, SEEDED, ignore_eos=False),
                stream=True,
                arrival_time=time.time(),
                constraint=c,
            )
        )
    out = {req_id: (tokens(rows), rows[-1].finished) for req_id, rows in run(s).items()}
    reasoning, answer = split(out[1][0], END)
    assert len(reasoning) == 4 + len(END) and out[1][1] == FinishStop(matched=EOS)
    assert re.fullmatch(REGEX, TOKENIZER.decode(answer[:-1])), answer
    ungated, finish = out[2]
    assert finish == FinishStop(matched=EOS) and END[0] not in ungated
    assert re.fullmatch(REGEX, TOKENIZER.decode(ungated[:-1])), ungated


@pytest.mark.parametrize(
    ("k", "end", "mode", "problem"),
    [
        (-1, END, "generate", "thinking_budget is -1; it must be at least 0"),
        (3, (), "generate", "thinking_budget needs thinking_end"),
        (3, (END[0], 1 << 20), "generate", "thinking_end holds a token id outside the vocabulary"),
        (0, END, "dllm", "thinking_budget is not supported in --mode dllm"),
    ],
)
def test_a_budget_the_scheduler_cannot_serve_is_refused(
    k: int, end: tuple[int, ...], mode: str, problem: str
) -> None:
    """A frame from elsewhere (the API checks first) gets a 400 row, not a crash."""
    s = make(mode=mode)
    submit(s, 1, msgspec.structs.replace(GREEDY, thinking_budget=k, thinking_end=end))
    (row,) = run(s)[1]
    assert isinstance(row.finished, FinishAbort) and row.finished.status_code == 400
    assert problem in row.finished.message, row.finished.message


def checks(**config: object) -> RequestChecks:
    return RequestChecks(
        ServerConfig(**config),  # type: ignore[arg-type]
        None,
        vocab_size=4096,
        context_length=2048,
    )


@pytest.mark.parametrize(
    ("k", "end", "mode", "param", "says"),
    [
        (-1, END, "generate", "thinking_budget", "is -1; it must be at least 0"),
        (3, (), "generate", "thinking_end", "the token ids that end the reasoning"),
        (3, (END[0], 4096), "generate", "thinking_end", "token id 4096, not in the vocabulary"),
        (0, END, "dllm", "thinking_budget", "not served in --mode dllm"),
    ],
)
def test_the_api_refuses_a_budget_out_of_range_naming_its_field(
    k: int, end: tuple[int, ...], mode: str, param: str, says: str
) -> None:
    params = msgspec.structs.replace(GREEDY, thinking_budget=k, thinking_end=end)
    with pytest.raises(RequestValidationError) as caught:
        checks(mode=mode).validate_sampling(len(PROMPT), params)
    assert caught.value.param == f"sampling_params.{param}" and says in str(caught.value)
    checks(mode=mode).validate_sampling(len(PROMPT), GREEDY)  # no budget: nothing to check
    checks().validate_sampling(len(PROMPT), budget(0))
