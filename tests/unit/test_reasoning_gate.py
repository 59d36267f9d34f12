"""Grammars after reasoning in the scheduler (scheduler_proc/sampling/reasoning_gate.py): a
constraint with ``reasoning_end`` leaves the output free until the output ends with those ids,
then the grammar applies from the next token; the same answer through a retraction and a PD
hand-over. In-process schedulers, as in tests/unit/test_grammar.py, whose helpers these use.

The random model writes the end when a bias pushes it (``END`` stands for ``</think>``); a
two-token end shows the gate waits for the whole sequence."""

from __future__ import annotations

import re
import time
from pathlib import Path

import msgspec

from pipeline.io_struct import Constraint, FinishStop, SamplingParams
from scheduler_proc.retraction import retract
from scheduler_proc.batch.running_batch import RunningBatch
from tests.unit.test_grammar import (
    EOS,
    PROMPT,
    REGEX,
    TOKENIZER,
    constraint,
    make,
    run,
    sampling,
    submit,
)
from tests.unit.test_pd_scheduler import Row
from tests.unit.test_pd_scheduler import make as make_pd
from tests.unit.test_pd_scheduler import run as run_pd

END = tuple(TOKENIZER.encode(" therefore"))  # one token in the shipped vocabulary
TWO = tuple(TOKENIZER.encode(" therefore so"))  # two tokens
SEEDS = (5, 6, 7, 8)
MAX_NEW = 160
LONGER = 4.0  # a push under which these seeds think for 9 to 136 tokens


def gated(end: tuple[int, ...]) -> Constraint:
    return msgspec.structs.replace(constraint("regex"), reasoning_end=end)


def params(seed: int, end: tuple[int, ...], push: float = 6.0, **kw: object) -> SamplingParams:
    """A bias that makes the model write ``end`` after some free tokens (fewer the larger
    ``push``); a longer end's later tokens are pushed harder, so they follow the first."""
    bias = tuple((t, push + 2 * i) for i, t in enumerate(end))
    return sampling(seed, logit_bias=bias, **{"max_new_tokens": MAX_NEW, **kw})


def split(tokens: list[int], end: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """The tokens up to and including the first ``end``, and those after it."""
    for i in range(len(end), len(tokens) + 1):
        if tuple(tokens[i - len(end) : i]) == end:
            return tokens[:i], tokens[i:]
    raise AssertionError(f"the answer never ends its reasoning: {TOKENIZER.decode(tokens)!r}")


def test_the_grammar_applies_from_the_token_after_the_reasoning_end() -> None:
    """Before the end the tokens are free (the pattern could not start with them); after it,
    the answer is the pattern, ended by the grammar's stop token."""
    for end in (END, TWO):
        s = make()
        for seed in SEEDS:
            submit(s, seed, gated(end), params(seed, end))
        out = run(s)
        thought_somewhere = False
        for seed in SEEDS:
            answer = out[seed]
            reasoning, rest = split(answer.tokens, end)
            assert answer.finish == FinishStop(matched=EOS), answer.finish
            assert re.fullmatch(REGEX, TOKENIZER.decode(rest[:-1])), TOKENIZER.decode(rest)
            thought_somewhere |= len(reasoning) > len(end)
        assert thought_somewhere, "every answer ended its reasoning at once"


def test_a_retraction_and_a_pd_hand_over_keep_the_gate_where_it_was(tmp_path: Path) -> None:
    """Requests retracted mid-answer (by a small pool, and on a PD decode server once its
    grammar applies), and requests whose first token came from a PD prefill server, give the
    answers they give alone."""
    alone = {}
    for seed in SEEDS:
        s = make()
        submit(s, seed, gated(END), params(seed, END, LONGER))
        alone[seed] = run(s)[seed].tokens
    peaks = [len(PROMPT) + len(tokens) for tokens in alone.values()]
    # Too small for all at once, and large enough for any one (admission's rule).
    small = make(pool=max(len(PROMPT) + MAX_NEW, sum(peaks) * 2 // 3))
    for seed in SEEDS:
        submit(small, seed, gated(END), params(seed, END, LONGER))
    out = run(small)
    assert small.num_retracted_total > 0, "the pool never forced a retraction"
    assert {k: a.tokens for k, a in out.items()} == alone

    prefill, _ = make_pd("prefill", tmp_path)
    decode, _ = make_pd("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    for seed in SEEDS:
        first = params(seed, END, LONGER, max_new_tokens=1)
        whole = params(seed, END, LONGER)
        submit(prefill, seed, gated(END), first, room=600 + seed)
        submit(decode, seed, gated(END), whole, room=600 + seed, endpoint=endpoint)
    retracted: list[int] = []

    def retract_one_after_its_reasoning() -> None:
        batch = decode.running
        assert isinstance(batch, RunningBatch)
        victim = next((r for r in batch.reqs if r.matcher is not None), None)
        if not retracted and victim is not None:
            batch.remove(victim)
            retract(decode, victim, time.time())
            retracted.append(victim.req_id)

    rows: dict[int, list[Row]] = {}
    run_pd([prefill, decode], rows, on_step=retract_one_after_its_reasoning)
    assert retracted, "no request reached its answer on the decode server"
    assert {k: [t for row in r for t in row.tokens] for k, r in rows.items()} == alone
