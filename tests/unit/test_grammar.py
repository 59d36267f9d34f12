"""Structured outputs in the scheduler (docs/design.md section 10;
scheduler_proc/sampling/grammar.py, scheduler_proc/grammar_queue.py): every kind of constraint makes
every answer of the built-in random model, at temperature 1 and any seed, one the grammar allows;
the mask comes before logit_bias; a row's tokens never depend on its neighbours, a retraction or a
PD hand-over; compiles run off the step and are cached; invalid specs and servers that cannot
compile are refused with a 400 that names the field.

In-process schedulers (real model, real pools), as in tests/unit/test_scheduler_steps.py.
The answers are bounded (patterns, enums, maxItems, integer ranges) so that they end well
within max_new_tokens; the grammar, not luck, makes each one valid.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    AbortReq,
    BatchTokenIDOutput,
    Constraint,
    FinishAbort,
    FinishLength,
    FinishReason,
    FinishStop,
    LogprobParams,
    RequestOutputStats,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from pipeline.columns import from_column, split_token_rows
from pipeline.logprob_columns import read_token_logprobs
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.retraction import retract
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.main import build_scheduler
from scheduler_proc.sampling.grammar import CompileOutcome, Key, TokenMasks, choice_grammar
from scheduler_proc.scheduler import Scheduler
from tests.unit.test_pd_scheduler import Row
from tests.unit.test_pd_scheduler import make as make_pd
from tests.unit.test_pd_scheduler import run as run_pd

TOKENIZER = load_tokenizer(None)
EOS = 0  # the shipped tokenizer's <|endoftext|>
PROMPT = TOKENIZER.encode("Once upon a time")
SEEDS = (1, 2, 3, 4)
MAX_NEW = 1024  # the longest answer here is a few hundred tokens (JSON may hold much whitespace)

COLORS = ("red", "green", "blue")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "tags": {"type": "array", "items": {"enum": list(COLORS)}, "maxItems": 2},
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": 0, "maximum": 99},
                "ok": {"type": "boolean"},
            },
            "required": ["x", "ok"],
        },
    },
    "required": ["name", "tags", "point"],
}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["yes", "no", 'say "hi"', "back\\slash", "two\nlines", "ünï"]
EBNF = 'root ::= greeting ", " name "!"\ngreeting ::= "hello" | "hi"\nname ::= [a-z]{1,4}'
EBNF_AS_REGEX = r"(hello|hi), [a-z]{1,4}!"


def follows_schema(value: object) -> bool:
    """SCHEMA, checked by hand: exactly its keys (no others: xgrammar's strict mode), each
    value of its type and within its bounds."""
    if not isinstance(value, dict) or set(value) != {"name", "tags", "point"}:
        return False
    name, tags, point = value["name"], value["tags"], value["point"]
    if not (isinstance(name, str) and re.fullmatch(r"[a-z]{1,6}", name)):
        return False
    if not (isinstance(tags, list) and len(tags) <= 2 and all(t in COLORS for t in tags)):
        return False
    if not (isinstance(point, dict) and set(point) == {"x", "ok"}):
        return False
    x, ok = point["x"], point["ok"]
    return type(x) is int and 0 <= x <= 99 and type(ok) is bool


def valid(kind: str, text: str) -> bool:
    if kind == "json_schema":
        return follows_schema(json.loads(text))
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    assert kind == "grammar"
    return re.fullmatch(EBNF_AS_REGEX, text) is not None


def constraint(kind: str, param: str = "sampling_params.x") -> Constraint:
    spec = {
        "json_schema": json.dumps(SCHEMA),
        "json_object": "",
        "regex": REGEX,
        "choice": json.dumps(CHOICES),
        "grammar": EBNF,
    }[kind]
    return Constraint(kind, spec, param)


KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
QUOTE, CLOSE = TOKENIZER.encode('"')[0], TOKENIZER.encode("}")[0]
# A random model never closes an open-ended object by itself: pushing '"' and "}" closes
# each string and the object soon, where the mask allows them (an object opens with "{").
KIND_BIAS: dict[str, tuple[tuple[int, float], ...]] = {
    "json_object": ((QUOTE, 100.0), (CLOSE, 100.0))
}


def make(pool: int = 8192, **kw: object) -> Scheduler:
    config = ServerConfig(max_total_tokens=pool, torch_threads=1, **kw)  # type: ignore[arg-type]
    return build_scheduler(config)


def sampling(seed: int | None, **kw: object) -> SamplingParams:
    params: dict[str, object] = {"max_new_tokens": MAX_NEW, "temperature": 1.0, "seed": seed, **kw}
    return SamplingParams(**params)  # type: ignore[arg-type]


def submit(
    s: Scheduler,
    req_id: int,
    c: Constraint | None,
    params: SamplingParams,
    *,
    logprobs: LogprobParams | None = None,
    room: int | None = None,
    endpoint: str | None = None,
) -> None:
    s.add_request(
        TokenizedGenerateReqInput(
            rid=f"r{req_id}",
            req_id=req_id,
            input_ids=PROMPT,
            sampling_params=params,
            stream=True,
            arrival_time=time.time(),
            logprobs=logprobs,
            bootstrap_room=room,
            bootstrap_endpoint=endpoint,
            constraint=c,
        )
    )


@dataclass
class Answer:
    tokens: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    stats: list[RequestOutputStats] = field(default_factory=list)  # every stats entry, in order
    asked_logprobs: list[list[float]] = field(default_factory=list)  # per token: the asked ids'

    @property
    def text(self) -> str:
        return TOKENIZER.decode(self.tokens)


def collect(frames: list[object], into: dict[int, Answer]) -> None:
    for frame in frames:
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
            answer = into.setdefault(req_id, Answer())
            answer.tokens.extend(rows[i])
            if i in per_row:
                answer.asked_logprobs.extend(per_row[i].ids_values.tolist())
            if frame.request_stats is not None and frame.request_stats[i] is not None:
                answer.stats.append(frame.request_stats[i])  # type: ignore[arg-type]
            if frame.finished_reasons is not None and frame.finished_reasons[i] is not None:
                answer.finish = frame.finished_reasons[i]


def run(s: Scheduler, into: dict[int, Answer] | None = None) -> dict[int, Answer]:
    out: dict[int, Answer] = {} if into is None else into
    while s.has_work():
        collect(s.step(), out)  # type: ignore[arg-type]
    return out


def assert_valid(kind: str, answer: Answer) -> None:
    assert answer.finish == FinishStop(matched=EOS), (kind, answer.finish, answer.text)
    assert answer.tokens[-1] == EOS and EOS not in answer.tokens[:-1], answer.tokens
    assert valid(kind, answer.text), (kind, answer.text)


@pytest.mark.parametrize("kind", KINDS)
def test_every_seeded_answer_follows_its_constraint(kind: str) -> None:
    """Four seeds at temperature 1, batched together: each answer ends with EOS exactly
    where its grammar can end, and spells what the constraint allows."""
    s = make()
    for seed in SEEDS:
        submit(s, seed, constraint(kind), sampling(seed, logit_bias=KIND_BIAS.get(kind, ())))
    out = run(s)
    assert sorted(out) == list(SEEDS)
    for answer in out.values():
        assert_valid(kind, answer)
    assert len({a.text for a in out.values()}) > 1, (
        "the seeds all drew one answer: the test shows nothing"
    )


def test_choices_with_quotes_backslashes_newlines_and_non_ascii_are_spelled_exactly() -> None:
    """The choice grammar escapes each string (a JSON literal, which xgrammar's EBNF reads
    alike): every choice is reachable as written, and nothing else."""
    grammar = choice_grammar(json.dumps(CHOICES))
    assert (
        grammar
        == 'root ::= "yes" | "no" | "say \\"hi\\"" | "back\\\\slash" | "two\\nlines" | "ünï"'
    )
    s = make()
    for seed in range(24):
        submit(s, seed, constraint("choice"), sampling(seed))
    texts = {a.text for a in run(s).values()}
    assert texts <= set(CHOICES) and len(texts) >= 3, texts


def test_a_masked_token_is_never_drawn_whatever_its_logit_bias() -> None:
    """A +100 bias outweighs every logit of the built-in model, so unmasked the biased token
    would be every draw; the mask comes first, so it is drawn only where the grammar allows
    it: EOS once the answer is complete, a letter never (the answer is digits)."""
    letter = TOKENIZER.encode("x")[0]
    digits = Constraint("regex", "[0-9]{2,4}", "sampling_params.regex")
    s = make()
    for seed in SEEDS:
        submit(s, seed, digits, sampling(seed, logit_bias=((EOS, 100.0), (letter, 100.0))))
    submit(
        s, 99, None, sampling(5, logit_bias=((letter, 100.0),), max_new_tokens=4)
    )  # an unconstrained neighbour
    out = run(s)
    for seed in SEEDS:
        answer = out[seed]
        assert letter not in answer.tokens
        assert re.fullmatch("[0-9]{2,4}", answer.text) and answer.finish == FinishStop(
            matched=EOS
        ), answer.text
        # EOS is allowed from the second digit on, and the bias takes it at once: before the
        # last digit token there was less than two digits.
        assert len(TOKENIZER.decode(answer.tokens[:-2])) < 2, answer.text
    assert out[99].tokens == [letter] * 4, "the unconstrained row is not masked"


def test_special_tokens_never_enter_an_answer() -> None:
    """Any character may follow, and ``<|image|>`` and ``<|im_end|>`` are pushed +100: the
    grammar never allows a special token (the client, who sees text without them, would read
    another answer), so the answer is text the grammar accepted, as the client reads it."""
    special = sorted(TOKENIZER.special_token_ids - {EOS})
    assert len(special) >= 2
    anything = Constraint("regex", ".{4,12}", "p")
    s = make()
    for seed in SEEDS:
        submit(s, seed, anything, sampling(seed, logit_bias=tuple((t, 100.0) for t in special)))
    for answer in run(s).values():
        assert not set(answer.tokens) & set(special), answer.tokens
        # xgrammar's "." takes a newline too
        assert answer.finish == FinishStop(matched=EOS) and re.fullmatch(
            ".{4,12}", answer.text, re.DOTALL
        ), answer.text
        assert TOKENIZER.decode(answer.tokens[:-1], skip_special_tokens=False) == answer.text


def test_the_grammar_ends_the_answer_even_with_ignore_eos_and_max_new_tokens_still_cuts() -> None:
    s = make()
    submit(s, 1, constraint("choice"), sampling(1, ignore_eos=True))
    submit(s, 2, constraint("json_schema"), sampling(2, max_new_tokens=3))
    out = run(s)
    assert_valid("choice", out[1])
    assert out[2].finish == FinishLength(length=3) and len(out[2].tokens) == 3


def test_a_grammar_that_can_only_end_ends_even_short_of_min_new_tokens() -> None:
    """After "yes" the grammar allows EOS alone. min_new_tokens bans EOS and the request's
    stop id (a letter the grammar forbids): the ban lowers EOS to the lowest float but
    never lifts the forbidden letter from -inf, so EOS is drawn and the answer ends there."""
    letter = TOKENIZER.encode("x")[0]
    yes = Constraint("choice", '["yes"]', "p")
    s = make()
    for seed in SEEDS:
        submit(s, seed, yes, sampling(seed, min_new_tokens=8, stop_token_ids=(letter,)))
    for answer in run(s).values():
        assert answer.text == "yes" and answer.finish == FinishStop(matched=EOS), (
            answer.text,
            answer.finish,
        )


def test_logprobs_of_a_constrained_row_stay_the_raw_distribution() -> None:
    """EOS is masked until the answer is complete, yet its logprob at every position is the
    model's own, finite, and at the first position the same as an unconstrained request's
    (same prompt alone, same logits)."""
    asked = LogprobParams(token_ids_logprob=(EOS,))
    constrained, plain = make(), make()
    submit(constrained, 1, constraint("regex"), sampling(1), logprobs=asked)
    submit(plain, 1, None, sampling(1, max_new_tokens=1), logprobs=asked)
    answer, reference = run(constrained)[1], run(plain)[1]
    assert_valid("regex", answer)
    eos_logprobs = [values[0] for values in answer.asked_logprobs]
    assert len(eos_logprobs) == len(answer.tokens) and all(np.isfinite(eos_logprobs)), eos_logprobs
    assert eos_logprobs[0] == reference.asked_logprobs[0][0]


MIX: list[tuple[str | None, int]] = [
    ("json_schema", 7),
    (None, 8),
    ("regex", 9),
    ("grammar", 10),
    (None, 11),
    ("choice", 12),
]


def _mix_alone() -> dict[int, list[int]]:
    alone: dict[int, list[int]] = {}
    for j, (kind, seed) in enumerate(MIX):
        s = make()
        submit(
            s,
            j,
            constraint(kind) if kind else None,
            sampling(seed, max_new_tokens=MAX_NEW if kind else 40),
        )
        alone[j] = run(s)[j].tokens
    return alone


def test_seeded_rows_draw_the_same_tokens_alone_and_in_any_batch() -> None:
    """A row's mask depends on its own matcher only, and unconstrained rows are not touched,
    so each request draws alone what it draws beside any neighbours, joining in any order."""
    alone = _mix_alone()
    together = make()
    for j, (kind, seed) in enumerate(MIX):
        submit(
            together,
            j,
            constraint(kind) if kind else None,
            sampling(seed, max_new_tokens=MAX_NEW if kind else 40),
        )
    assert {k: a.tokens for k, a in run(together).items()} == alone
    staggered = make()  # reversed, and half of them join a few steps late
    out: dict[int, Answer] = {}
    for j in reversed(range(len(MIX))):
        kind, seed = MIX[j]
        submit(
            staggered,
            j,
            constraint(kind) if kind else None,
            sampling(seed, max_new_tokens=MAX_NEW if kind else 40),
        )
        if j == 3:
            for _ in range(5):
                collect(staggered.step(), out)  # type: ignore[arg-type]
    assert {k: a.tokens for k, a in run(staggered, out).items()} == alone
    for j, (kind, _) in enumerate(MIX):
        if kind is not None:
            assert valid(kind, TOKENIZER.decode(alone[j]))


def test_a_retracted_constrained_request_resumes_its_grammar_where_it_stopped() -> None:
    """A pool too small for all of them: requests are retracted mid-answer and re-prefilled;
    their matchers keep what they accepted (nothing is accepted twice), so each answer is
    the one it draws alone, and valid."""
    seeds = (21, 22, 23, 24, 25, 26)
    params = [sampling(seed, max_new_tokens=600) for seed in seeds]
    # Unbounded whitespace: the random model's answers run long, and outgrow the pool.
    loose = {"constrained_json_max_whitespace": 0}
    alone: dict[int, list[int]] = {}
    for seed, p in zip(seeds, params):
        s = make(**loose)
        submit(s, seed, constraint("json_schema"), p)
        alone[seed] = run(s)[seed].tokens
    small = make(pool=len(PROMPT) + 700, **loose)
    for seed, p in zip(seeds, params):
        submit(small, seed, constraint("json_schema"), p)
    out = run(small)
    assert small.num_retracted_total > 0, "the pool never forced a retraction"
    assert any(a.stats[-1].num_retractions > 0 and len(a.tokens) > 1 for a in out.values())
    assert {k: a.tokens for k, a in out.items()} == alone
    for answer in out.values():
        assert_valid("json_schema", answer)
    assert small.kv.num_used == small.cache.total_size and not small.live


def test_pd_the_prefill_server_draws_the_first_token_under_the_mask_and_the_decode_server_goes_on(
    tmp_path: Path,
) -> None:
    """The prefill half samples token 0 under its grammar; the decode half compiles the same
    grammar, accepts that token before its first step, and draws the rest: the answer is
    the unified server's, valid. A decode-side retraction re-bootstraps and keeps the
    matcher as it was."""
    kinds = ("json_schema", "regex", "grammar")
    unified = make()
    for j, kind in enumerate(kinds):
        submit(unified, j, constraint(kind), sampling(30 + j))
    expected = {k: a.tokens for k, a in run(unified).items()}

    prefill, _ = make_pd("prefill", tmp_path)
    decode, _ = make_pd("decode", tmp_path)
    endpoint = f"ipc://{tmp_path / 'kv'}"
    for j, kind in enumerate(kinds):
        submit(prefill, j, constraint(kind), sampling(30 + j, max_new_tokens=1), room=500 + j)
        submit(decode, j, constraint(kind), sampling(30 + j), room=500 + j, endpoint=endpoint)
    retracted: list[int] = []

    def retract_the_schema_answer_once() -> None:
        batch = decode.running
        assert isinstance(batch, RunningBatch)
        victim = next((r for r in batch.reqs if r.req_id == 0), None)
        if not retracted and victim is not None and batch.output_len()[batch.row_of(victim)] >= 8:
            batch.remove(victim)
            retract(decode, victim, time.time())
            retracted.append(victim.req_id)

    rows: dict[int, list[Row]] = {}
    run_pd([prefill, decode], rows, on_step=retract_the_schema_answer_once)
    assert retracted == [0]
    got = {k: [t for row in r for t in row.tokens] for k, r in rows.items()}
    assert got == expected
    for j, kind in enumerate(kinds):
        assert rows[j][-1].finished == FinishStop(matched=EOS)
        assert valid(kind, TOKENIZER.decode(got[j]))


def test_pd_a_first_token_outside_the_grammar_fails_the_decode_half_with_a_502(
    tmp_path: Path,
) -> None:
    """A prefill half sent without the constraint draws a letter (pushed +100) where the
    grammar wants a digit: the decode half's matcher refuses it before any step."""
    letter = TOKENIZER.encode("x")[0]
    prefill, _ = make_pd("prefill", tmp_path)
    decode, _ = make_pd("decode", tmp_path)
    digits = Constraint("regex", "[0-9]+", "sampling_params.regex")
    submit(prefill, 1, None, sampling(1, max_new_tokens=1, logit_bias=((letter, 100.0),)), room=700)
    submit(decode, 1, digits, sampling(1), room=700, endpoint=f"ipc://{tmp_path / 'kv'}")
    rows: dict[int, list[Row]] = {}
    run_pd([prefill, decode], rows)
    finish = rows[1][-1].finished
    assert isinstance(finish, FinishAbort) and finish.status_code == 502, finish
    assert finish.message == f"sampling_params.regex: token {letter} is outside the grammar"


INVALID = [
    pytest.param("json_schema", '{"type": "foo"}', 'Unsupported type "foo"', id="schema-type"),
    pytest.param("json_schema", '{"type": ', "Failed to parse JSON", id="schema-json"),
    pytest.param("regex", "[a-", "Unclosed '['", id="regex"),
    pytest.param("grammar", "root ::= foo", 'Rule "foo" is not defined', id="grammar"),
    pytest.param("choice", "[]", "the choices must be a non-empty list of strings", id="choice"),
]


@pytest.mark.parametrize(("kind", "spec", "reason"), INVALID)
def test_an_invalid_spec_is_refused_with_a_400_naming_the_field_and_the_engines_reason(
    kind: str, spec: str, reason: str
) -> None:
    s = make()
    submit(s, 1, Constraint(kind, spec, "sampling_params.bad"), sampling(1))
    submit(s, 2, None, sampling(2, max_new_tokens=3))  # a neighbour, untouched
    out = run(s)
    finish = out[1].finish
    assert isinstance(finish, FinishAbort) and finish.status_code == 400, finish
    assert finish.message.startswith("sampling_params.bad: ") and reason in finish.message, (
        finish.message
    )
    assert (
        "/project/" not in finish.message and "Check failed" not in finish.message
    )  # the engine's log prefix is cut
    assert out[1].tokens == [] and out[1].stats, "refused before any token, with its stats"
    assert len(out[2].tokens) == 3
    assert not s.live and s.kv.num_used == s.cache.total_size


def _count_compiles(s: Scheduler) -> list[tuple[str, str]]:
    assert s.grammars is not None
    compiler = s.grammars.compiler
    calls: list[tuple[str, str]] = []
    inner = compiler.compile

    def counted(key: Key) -> CompileOutcome:
        calls.append((key.kind, key.spec))
        return inner(key)

    compiler.compile = counted
    return calls


def test_a_compiled_grammar_is_cached_and_a_second_request_does_not_wait() -> None:
    """The first request waits for its compile (grammar_wait > 0, sent through the stats
    setter on its first row); the second, with the same spec, takes it from the cache:
    no compile, grammar_wait 0. An invalid spec is cached too, with its reason."""
    s = make()
    calls = _count_compiles(s)
    submit(s, 1, constraint("regex"), sampling(1))
    first = run(s)[1]
    submit(s, 2, constraint("regex", param="another.field"), sampling(2))
    second = run(s)[2]
    assert calls == [("regex", REGEX)]
    ts1, ts2 = first.stats[0].time_stats, second.stats[0].time_stats
    assert ts1 is not None and ts1.grammar_wait > 0
    assert ts2 is not None and ts2.grammar_wait == 0.0
    assert_valid("regex", first)
    assert_valid("regex", second)
    for req_id in (3, 4):
        submit(s, req_id, Constraint("regex", "(", f"p{req_id}"), sampling(req_id))
    out = run(s)
    assert calls == [("regex", REGEX), ("regex", "(")]
    for req_id in (3, 4):
        finish = out[req_id].finish
        assert (
            isinstance(finish, FinishAbort)
            and finish.status_code == 400
            and finish.message.startswith(f"p{req_id}: ")
        )


def test_a_slow_compile_does_not_stop_other_requests_steps() -> None:
    """The compile blocks until the test releases it: meanwhile an unconstrained request
    is admitted and decodes to its end, step by step, and the constrained one waits
    outside the batch (no row, not running). Released, it is admitted and answers."""
    s = make(grammar_compile_timeout=3600.0)  # however slow the machine, no time limit here
    release = threading.Event()
    started = threading.Event()
    assert s.grammars is not None
    compiler = s.grammars.compiler
    inner = compiler.compile

    def slow(key: Key) -> CompileOutcome:
        started.set()
        release.wait()
        return inner(key)

    compiler.compile = slow
    out: dict[int, Answer] = {}
    try:
        submit(s, 1, constraint("grammar"), sampling(1))
        submit(s, 2, None, sampling(2, max_new_tokens=20, ignore_eos=True))
        assert started.wait(30), "the compile never started"
        steps = 0
        while 2 not in out or out[2].finish is None:
            collect(s.step(), out)  # type: ignore[arg-type]
            steps += 1
            assert steps < 100
            assert s.num_waiting == 1 and 1 not in out, (
                "the constrained request left its wait before its grammar"
            )
            assert all(r.req_id != 1 for r in s.running)
        assert len(out[2].tokens) == 20 and steps >= 20
        assert s.has_work() and s.only_compiling(), (
            "the loop would spin instead of waiting on its sockets"
        )
    finally:
        release.set()
    run(s, out)
    assert_valid("grammar", out[1])
    ts = out[1].stats[0].time_stats
    assert ts is not None and ts.grammar_wait > 0


def test_an_abort_during_compile_finishes_the_request_and_the_compile_serves_the_next() -> None:
    s = make()
    calls = _count_compiles(s)
    release = threading.Event()
    assert s.grammars is not None
    compiler = s.grammars.compiler
    counted = compiler.compile

    def blocked(key: Key) -> CompileOutcome:
        release.wait()
        return counted(key)

    compiler.compile = blocked
    try:
        submit(s, 1, constraint("choice"), sampling(1))
        assert s.has_work() and s.only_compiling()
        s.abort(AbortReq(req_id=1, reason="gone"))
        out = run(s)
        assert out[1].finish == FinishAbort(message="gone", status_code=499) and out[1].tokens == []
        assert not s.live and not s.grammars and s.num_waiting == 0
    finally:
        release.set()
    submit(s, 2, constraint("choice"), sampling(2))
    assert_valid("choice", run(s)[2])
    assert calls == [("choice", json.dumps(CHOICES))], (
        "the aborted request's compile was not the one used"
    )


def test_no_mask_work_while_no_running_row_is_constrained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unconstrained rows cost nothing: with none constrained, neither the fill nor the
    accept runs, and the sampler gets no mask. Once a constrained row runs, both do."""
    calls: list[str] = []
    fill, accept = TokenMasks.fill, TokenMasks.accept
    monkeypatch.setattr(
        TokenMasks, "fill", lambda self, *a: (calls.append("fill"), fill(self, *a))[1]
    )
    monkeypatch.setattr(
        TokenMasks, "accept", lambda self, *a: (calls.append("accept"), accept(self, *a))[1]
    )
    s = make()
    submit(s, 1, None, sampling(1, max_new_tokens=8))
    run(s)
    assert calls == []
    submit(s, 2, constraint("regex"), sampling(2))
    assert_valid("regex", run(s)[2])
    assert "fill" in calls and "accept" in calls


def test_without_a_tokenizer_a_constrained_request_is_refused_with_a_400_naming_the_flag() -> None:
    s = make(skip_tokenizer_init=True)
    assert s.grammars.compiler is None
    submit(s, 1, constraint("regex", param="sampling_params.regex"), sampling(1))
    finish = run(s)[1].finish
    assert isinstance(finish, FinishAbort) and finish.status_code == 400
    assert (
        finish.message == "sampling_params.regex: structured outputs need a tokenizer, "
        "and this server runs with --skip-tokenizer-init"
    )


def test_dllm_mode_refuses_a_constrained_request_with_a_400() -> None:
    s = make(mode="dllm")
    submit(s, 1, constraint("choice", param="response_format"), sampling(1))
    finish = run(s)[1].finish
    assert finish == FinishAbort(
        message="response_format: structured outputs are not supported in --mode dllm",
        status_code=400,
    )


def test_an_unknown_kind_is_refused_with_a_400() -> None:
    s = make()
    submit(s, 1, Constraint("yaml", "a: 1", "p"), sampling(1))
    finish = run(s)[1].finish
    assert (
        isinstance(finish, FinishAbort)
        and finish.status_code == 400
        and finish.message.startswith("p: unknown structured-output kind 'yaml'")
    )


def test_a_grammar_that_dead_ends_mid_answer_finishes_with_a_400_not_a_fault() -> None:
    """A grammar whose first tokens can be written but that then allows nothing (an empty
    character class after a literal) cannot be caught when it compiles; the row it strands
    finishes with a 400 naming the field, not the 500 of a refused token."""
    s = make()
    dead_end = Constraint("grammar", 'root ::= "ab" [^\\x00-\\U0010FFFF]', "ebnf")
    submit(s, 1, dead_end, sampling(1))
    submit(s, 2, constraint("regex"), sampling(2))  # a neighbour that goes on
    out = run(s)
    finish = out[1].finish
    assert isinstance(finish, FinishAbort) and finish.status_code == 400, finish
    assert finish.message.startswith("ebnf: the grammar allows no token after"), finish
    assert TOKENIZER.decode(out[1].tokens[:-1]) == "ab"
    assert_valid("regex", out[2])
