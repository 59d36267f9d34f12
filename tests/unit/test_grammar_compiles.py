"""Compiles that cannot stall or leak (scheduler_proc/sampling/grammar.py, compile_pool.py,
scheduler_proc/grammar_queue.py): grammars compile on a pool, a compile past the time limit
fails its requests with a 400 while the other specs compile on (a fresh worker takes a stuck
one's place) and is refused at once the next time; requests aborted while their grammar
compiles leave nothing behind but the bounded cache; the whitespace options reach the
scheduler's compiles.

In-process schedulers, as in tests/unit/test_grammar.py. A slow compile is the test's own:
``GrammarCompiler.compile`` blocks until released, and the limit reads a clock the test moves,
so nothing depends on how fast the machine is."""

from __future__ import annotations

import gc
import json
import re
import threading
import time

import xgrammar as xgr

from pipeline.io_struct import AbortReq, Constraint, FinishAbort
from scheduler_proc.sampling.grammar import GRAMMAR_CACHE_SIZE, CompileOutcome, Key
from scheduler_proc.scheduler import Scheduler
from tests.grammar_bias import TOKENIZER
from tests.unit.test_grammar import (
    Answer,
    assert_valid,
    collect,
    constraint,
    make,
    run,
    sampling,
    submit,
)

WAIT_S = 60.0  # how long a test waits for a worker thread before it gives up


class Clock:
    """The compile limit's clock, moved by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def wait_for(condition: object, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.005)


def test_a_compile_past_the_limit_fails_its_requests_and_the_other_specs_compile_on() -> None:
    """Two specs whose compiles never return hold both workers. Past the limit each one's
    requests (two share the first) get a 400 that says so; fresh workers take the stuck
    ones' places, so a third spec, queued behind them, compiles and answers; asked again, a
    timed-out spec is refused at once, from the cache."""
    s = make(grammar_compile_timeout=5.0)
    compiler = s.grammars.compiler
    assert compiler is not None
    clock = Clock()
    compiler.clock = clock
    stuck = {"[a-c]{3}", "[d-f]{3}"}
    started: list[str] = []
    release = threading.Event()
    inner = compiler.compile

    def slow(key: Key) -> CompileOutcome:
        started.append(key.spec)
        if key.spec in stuck:
            release.wait()
        return inner(key)

    compiler.compile = slow
    out: dict[int, Answer] = {}
    try:
        for req_id, spec in ((1, "[a-c]{3}"), (2, "[d-f]{3}"), (3, "[a-c]{3}")):
            submit(s, req_id, Constraint("regex", spec, "guided_regex"), sampling(req_id))
        submit(s, 4, constraint("regex"), sampling(4))
        wait_for(lambda: len(started) == 2, "both workers take a stuck compile")
        collect(s.step(), out)
        assert not out and len(s.grammars) == 4 and len(started) == 2  # all four wait
        clock.now += 5.01
        run(s, out)
        for req_id in (1, 2, 3):
            finish = out[req_id].finish
            assert isinstance(finish, FinishAbort) and finish.status_code == 400, finish
            assert finish.message == (
                "guided_regex: compiling it took longer than 5 s (the server's "
                "--grammar-compile-timeout)"
            )
            assert out[req_id].tokens == []
        assert_valid("regex", out[4])
        submit(s, 5, Constraint("regex", "[a-c]{3}", "regex"), sampling(5))
        again = run(s)[5].finish
        assert isinstance(again, FinishAbort) and again.message.startswith("regex: compiling")
        assert sorted(started) == sorted([*stuck, constraint("regex").spec])  # no new compile
    finally:
        release.set()
    assert not s.live and s.kv.num_used == s.cache.total_size


def _unique_schema(i: int) -> Constraint:
    schema = {
        "type": "object",
        "description": f"schema number {i}",
        "properties": {f"field_{i}_{j}": {"type": "string", "maxLength": 8} for j in range(8)},
    }
    return Constraint("json_schema", json.dumps(schema), "response_format.json_schema.schema")


def _compiled_grammars_alive() -> int:
    gc.collect()
    return sum(type(o) is xgr.CompiledGrammar for o in gc.get_objects())


def test_600_requests_aborted_while_compiling_leave_only_the_cache_behind() -> None:
    """Each request is aborted as soon as its (unique) schema's compile is queued, as a
    client that disconnects does: a compile not yet started never runs, one under way ends
    in the cache, and nothing else of them stays (no compile in flight, no compiled grammar
    alive but the cache's). Before, every one of them compiled and stayed in the in-flight
    table for good."""
    s = make()
    compiler = s.grammars.compiler
    assert compiler is not None
    calls: list[Key] = []
    inner = compiler.compile

    def counted(key: Key) -> CompileOutcome:
        calls.append(key)
        return inner(key)

    compiler.compile = counted
    before = _compiled_grammars_alive()
    for i in range(600):
        submit(s, i, _unique_schema(i), sampling(i))
        s.abort(AbortReq(req_id=i, reason="client disconnected"))
    out = run(s)
    assert sorted(out) == list(range(600))
    assert all(a.finish == FinishAbort("client disconnected", 499) for a in out.values())
    assert not s.live and not s.grammars

    def settled() -> bool:
        s.grammars.take(time.time())  # what a step does: ended compiles go to the cache
        return compiler.inflight_len == 0

    wait_for(settled, "the compiles under way end")
    assert len(calls) < 600, "every aborted request's compile ran"
    assert compiler.cache_len <= min(len(calls), GRAMMAR_CACHE_SIZE)
    assert _compiled_grammars_alive() - before <= compiler.cache_len


def _whitespace_runs(text: str) -> list[int]:
    """The lengths of the whitespace runs of a JSON text outside its strings."""
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return [len(run) for run in re.findall(r"\s+", outside)]


WHITESPACE_TOKENS = [
    i
    for i in range(TOKENIZER.vocab_size)
    if i not in TOKENIZER.special_token_ids
    and (text := TOKENIZER.tokenizer.decode([i]))
    and not text.strip()
]
PUSH_WHITESPACE = tuple((i, 6.0) for i in WHITESPACE_TOKENS)  # the model leans to blanks


def _json_answers(s: Scheduler, seeds: range) -> list[str]:
    for seed in seeds:
        submit(s, seed, constraint("json_schema"), sampling(seed, logit_bias=PUSH_WHITESPACE))
    answers = run(s)
    for answer in answers.values():
        assert_valid("json_schema", answer)
    return [a.text for a in answers.values()]


def test_a_run_of_whitespace_between_json_tokens_is_bounded_by_default() -> None:
    """With whitespace pushed, a random model fills every gap it may: by default a gap
    holds at most --constrained-json-max-whitespace (24) characters, and the answers end."""
    texts = _json_answers(make(), range(6))
    runs = [n for text in texts for n in _whitespace_runs(text)]
    assert max(runs) == 24, runs


def test_the_servers_compact_json_flag_leaves_no_whitespace_between_tokens() -> None:
    texts = _json_answers(make(constrained_json_disable_any_whitespace=True), range(4))
    for text in texts:
        assert set(_whitespace_runs(text)) <= {1}, text  # the one space of ", " and ": "
        assert json.dumps(json.loads(text), ensure_ascii=False) == text
