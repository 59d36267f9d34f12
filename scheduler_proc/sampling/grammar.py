"""Structured outputs (docs/design.md section 10): the grammar a request's tokens must spell,
compiled by xgrammar off the step (``GrammarCompiler``, over ``tokenizer_info``'s view of
the vocabulary), and the token mask of the constrained rows of a step (``TokenMasks``).

A matcher lives with its request (``Req.matcher``) and has accepted exactly the request's
output tokens: a retracted request resumes with it as it is, and a re-prefill accepts
nothing again. A matcher ends (terminates) exactly when it accepts a stop token, which it
allows only where the grammar can end, so the request then finishes with ``stop``.

A step costs something only while a row is constrained (``TokenMasks``); without one, no
bitmask and no copy.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Set
from concurrent.futures import Future
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

import numpy as np
import tokenizers
import torch

from pipeline.io_struct import Constraint, FinishAbort
from scheduler_proc.sampling.compile_pool import CompileJob, CompilePool
from scheduler_proc.sampling.json_grammar import JsonOptions, json_schema_ebnf

if TYPE_CHECKING:
    import xgrammar as xgr


def _xgr() -> ModuleType:
    """xgrammar, imported where it is first used. With the transformers it imports it takes
    over a second, which a scheduler's start need not wait for: ``GrammarCompiler`` imports
    it on a thread of its own while the model loads (docs/design.md, "Structured outputs")."""
    import xgrammar

    return xgrammar


GRAMMAR_CACHE_SIZE = 256  # compile outcomes kept (LRU), as SGLang's and vLLM's caches are bounded
# Threads that compile at once: a slow compile holds up its own requests, not every new spec.
COMPILE_THREADS = 2
JSON_KINDS = frozenset({"json_schema", "json_object"})  # the kinds whitespace options touch
_FIRST_ROWS = 64  # bitmask rows allocated up front; doubled when a step has more
# A JSON object of any shape: xgrammar's builtin JSON grammar would also take an array at
# the root, and OpenAI's json_object (and vLLM's) means an object.
_ANY_OBJECT = '{"type": "object"}'
_MAX_REASON = (
    500  # characters of the engine's reason in a 400 (a JSON parse error quotes the whole spec)
)
# xgrammar's error text starts with its log prefix ("[12:00:00] /project/cpp/file.cc:94: ")
# and, for a failed check, the check ("Check failed: (error.empty()) is false: ").
_LOG_PREFIX = re.compile(r"^\[[0-9:.]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class Key(NamedTuple):
    """What a compile depends on: a ``Constraint``'s kind and spec, and for the JSON kinds
    whether whitespace may go between tokens (``GrammarCompiler.key``)."""

    kind: str
    spec: str
    any_whitespace: bool


class GrammarError(ValueError):
    """A spec the engine cannot compile; the message is the engine's reason."""


# What a compile ends in: the grammar, or why there is none. Both are cached.
CompileOutcome: TypeAlias = "xgr.CompiledGrammar | GrammarError"


@dataclass(frozen=True, slots=True)
class CompileFault:
    """A compile that raised: a fault of the engine, not a bad spec (never cached)."""

    error: BaseException


def tokenizer_info(
    tokenizer: tokenizers.Tokenizer,
    vocab_size: int,
    eos_token_ids: Set[int],
    special_token_ids: Set[int],
) -> xgr.TokenizerInfo:
    """xgrammar's vocabulary: ``vocab_size`` is the model's (its logits' width; ids past the
    tokenizer's are never allowed), and the EOS ids are the stop tokens a grammar allows
    where it can end.

    Special tokens are given no text, which xgrammar never allows: its own detection takes
    ``<|im_end|>`` for the ten characters of its name, so a grammar would let it into an
    answer, and the client, who sees text without special tokens, would read another."""
    from transformers import PreTrainedTokenizerFast

    xgr = _xgr()
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    detected = xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=sorted(eos_token_ids)
    )
    encoded: list[bytes | str] = [""] * vocab_size
    for token, token_id in hf.get_vocab().items():
        if token_id < vocab_size and token_id not in special_token_ids:
            encoded[token_id] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, detected.dump_metadata())


def choice_grammar(spec: str) -> str:
    """The EBNF of "exactly one of these strings" (``spec``: a JSON list of them). Each
    string is written as a JSON string literal, whose escapes xgrammar's EBNF reads alike."""
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the choices are not valid JSON: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("the choices must be a non-empty list of strings")
    return "root ::= " + " | ".join(
        json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(choices)
    )


def compile_spec(
    compiler: xgr.GrammarCompiler, key: Key, json_options: JsonOptions
) -> CompileOutcome:
    """Compiles one spec; an invalid one, or one whose language is empty, is returned as a
    GrammarError with the reason (not raised: the outcome is cached either way)."""
    kind, spec, any_whitespace = key
    try:
        if kind in JSON_KINDS:
            schema = spec if kind == "json_schema" else _ANY_OBJECT
            grammar = compiler.compile_grammar(
                json_schema_ebnf(schema, any_whitespace, json_options)
            )
        elif kind == "regex":
            grammar = compiler.compile_regex(spec)
        elif kind == "grammar":
            grammar = compiler.compile_grammar(spec)
        elif kind == "choice":
            grammar = compiler.compile_grammar(choice_grammar(spec))
        else:
            return GrammarError(f"unknown constraint kind {kind!r}")
    except GrammarError as exc:
        return exc
    except (RuntimeError, ValueError) as exc:  # xgrammar's parse and conversion errors
        return GrammarError(_engine_reason(exc))
    if matches_nothing(grammar):
        return GrammarError(
            "the grammar matches nothing: no answer can start (not even an empty one)"
        )
    return grammar


def matches_nothing(grammar: xgr.CompiledGrammar) -> bool:
    """Whether a new matcher allows no first token, the end (a stop token) included: an
    empty language, as ``root ::= root`` or an empty character class has. A request with it
    could only draw a token the mask forbids."""
    return allows_no_token(new_matcher(grammar), grammar.tokenizer_info.vocab_size)


def allows_no_token(matcher: xgr.GrammarMatcher, vocab_size: int) -> bool:
    """Whether ``matcher``'s next mask is empty: the answer can go no further."""
    bitmask = _xgr().allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    # int32 words, little-endian: bit i of word w is token 32 * w + i.
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
    return not bits[:vocab_size].any()


def _engine_reason(exc: Exception) -> str:
    reason = _LOG_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."


class GrammarCompiler:
    """Compiles specs on a small pool of threads (``CompilePool``) and keeps the last
    ``cache_size`` outcomes: a bounded LRU keyed by ``Key`` of a compiled grammar or the
    reason there is none. A miss compiles on the pool, and the step never waits for it
    (xgrammar releases the GIL while it compiles); the requests that wait are
    ``scheduler_proc.grammar_queue``'s. A compile that runs past ``timeout`` seconds is
    written off and its outcome is a GrammarError saying so, cached like any other.

    Used from the scheduler's thread only: ``lookup``, ``submit``, ``release`` and ``poll``
    touch the cache and the compiles under way there; the workers run ``compile`` and
    nothing else. xgrammar's compiler is made from ``info`` (the vocabulary,
    ``tokenizer_info``) on a thread of its own, so the import and the vocabulary's scan run
    beside the model's load, and a first compile waits for them (not counted against its
    time). ``stop_ids``: the EOS ids, the stop tokens ``info`` gives xgrammar."""

    def __init__(
        self,
        info: Callable[[], xgr.TokenizerInfo],
        stop_ids: Set[int],
        *,
        json_options: JsonOptions,
        timeout: float,
        threads: int = COMPILE_THREADS,
        cache_size: int = GRAMMAR_CACHE_SIZE,
    ) -> None:
        self._cache: OrderedDict[Key, CompileOutcome] = OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[Key, CompileJob[Key, CompileOutcome]] = {}
        self._json = json_options
        self.timeout = timeout
        self.stop_ids = frozenset(stop_ids)
        self._engine: Future[xgr.GrammarCompiler] = Future()
        # Not a daemon: the build ends on its own (within seconds), and a process that exits
        # meanwhile must wait for it. Finalizing the interpreter under a thread inside the
        # tokenizer's Rust or xgrammar's C++ ends the process with std::terminate (SIGABRT).
        threading.Thread(
            target=self._start, args=(info,), name="grammar-engine", daemon=False
        ).start()
        # The compile step itself, and the clock its time limit reads; a test may replace
        # them (to make a compile slow, or the time pass).
        self.compile: Callable[[Key], CompileOutcome] = self._compile
        self.clock: Callable[[], float] = time.monotonic
        self._pool: CompilePool[Key, CompileOutcome] = CompilePool(
            lambda key: self.compile(key), self._engine.result, threads, lambda: self.clock()
        )

    def _start(self, info: Callable[[], xgr.TokenizerInfo]) -> None:
        try:
            # Our own LRU keeps the outcomes (and bounds them); xgrammar's cache would be a
            # second, unbounded copy.
            self._engine.set_result(_xgr().GrammarCompiler(info(), cache_enabled=False))
        except Exception as exc:  # each compile raises it: a fault, not a bad spec
            self._engine.set_exception(exc)

    def _compile(self, key: Key) -> CompileOutcome:
        return compile_spec(self._engine.result(), key, self._json)

    def key(self, constraint: Constraint) -> Key:
        """The cache key of ``constraint``: whitespace counts for the JSON kinds only."""
        free = constraint.kind in JSON_KINDS and constraint.any_whitespace
        return Key(constraint.kind, constraint.spec, free and self._json.any_whitespace)

    def lookup(self, key: Key) -> CompileOutcome | None:
        """The cached outcome (now the most recently used), or None."""
        outcome = self._cache.get(key)
        if outcome is not None:
            self._cache.move_to_end(key)
        return outcome

    def submit(self, key: Key) -> None:
        """Starts the compile of ``key`` unless one is already under way (requests that ask
        for the same spec at once share it); ``poll`` reports its end."""
        if key not in self._inflight:
            self._inflight[key] = self._pool.submit(key)

    def release(self, key: Key) -> None:
        """No request waits for ``key`` any more: a compile not yet started never runs; one
        under way goes on, and ``poll`` caches its outcome for a next request."""
        job = self._inflight.get(key)
        if job is not None and self._pool.cancel(job):
            del self._inflight[key]

    def any_ended(self) -> bool:
        """Whether ``poll`` would report a compile now (one done, or one past the limit)."""
        now = self.clock()
        return any(
            job.future.done() or job.ran_for(now) > self.timeout for job in self._inflight.values()
        )

    def poll(self) -> dict[Key, CompileOutcome | CompileFault]:
        """The compiles that ended since the last poll, each now in the cache, whether a
        request still waits for it or not: the outcome, or a GrammarError for one written off
        past the limit. A compile that raised is reported as a ``CompileFault`` and not
        cached."""
        now = self.clock()
        ended: dict[Key, CompileOutcome | CompileFault] = {}
        for key, job in list(self._inflight.items()):
            if job.future.done():
                fault = job.future.exception()
                if fault is not None:
                    del self._inflight[key]
                    ended[key] = CompileFault(fault)
                    continue
                outcome = job.future.result()
            elif job.ran_for(now) > self.timeout and self._pool.write_off(job):
                outcome = GrammarError(
                    f"compiling it took longer than {self.timeout:g} s (the server's "
                    "--grammar-compile-timeout)"
                )
            else:
                continue
            del self._inflight[key]
            ended[key] = self._remember(key, outcome)
        return ended

    def _remember(self, key: Key, outcome: CompileOutcome) -> CompileOutcome:
        self._cache[key] = outcome
        self._cache.move_to_end(key)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return outcome

    @property
    def cache_len(self) -> int:
        return len(self._cache)

    @property
    def inflight_len(self) -> int:
        """Compiles under way or waiting for a worker."""
        return len(self._inflight)

    def close(self, wait: float = 0.0) -> bool:
        """Stops the workers, waiting up to ``wait`` seconds; whether none still compiles
        (``CompilePool.close``)."""
        return self._pool.close(wait)


def new_matcher(grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    """A request's matcher, at the start of its output."""
    return _xgr().GrammarMatcher(grammar)


def refused_token(param: str, token: int, status_code: int) -> FinishAbort:
    """The finish of a request whose matcher refused a token: never one the mask let through
    (a fault, 500), or a PD prefill server's first token that ignored the grammar (502)."""
    return FinishAbort(
        message=f"{param}: token {token} is outside the grammar", status_code=status_code
    )


@dataclass(frozen=True, slots=True)
class GrammarRows:
    """The constrained rows of a draw, ascending, and their matchers."""

    rows: np.ndarray  # int64 [m]
    indices: list[int]  # the same rows, as xgrammar takes them
    matchers: list[xgr.GrammarMatcher]


@dataclass(frozen=True, slots=True)
class GrammarMask:
    """One draw's bitmask: row i of ``bitmask`` holds the tokens row i may draw, for the
    rows in ``rows`` (the others' bits are stale and never read)."""

    bitmask: torch.Tensor  # int32 [n, ceil(V / 32)], on the logits' device
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``logits`` with -inf on each listed row's forbidden tokens.
        A copy: logprobs stay the raw distribution (docs/design.md section 11)."""
        x = logits.to(torch.float32, copy=True)
        _xgr().apply_token_bitmask_inplace(
            x, self.bitmask, vocab_size=x.shape[1], indices=self.rows
        )
        return x


class StepMasks(Protocol):
    """The constrained rows' masks of a draw: ``TokenMasks``, or ``NoGrammars`` on a
    scheduler that serves none (no tokenizer)."""

    def fill(self, grammar: GrammarRows, n: int) -> GrammarMask: ...

    def accept(self, grammar: GrammarRows, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def refusal(self, param: str, matcher: xgr.GrammarMatcher, token: int) -> FinishAbort: ...


class NoGrammars:
    """The masks of a scheduler without grammars: no request there is constrained (admission
    refuses one), so a step never asks."""

    def fill(self, grammar: GrammarRows, n: int) -> GrammarMask:
        raise AssertionError("a constrained request on a scheduler without grammars")

    def accept(self, grammar: GrammarRows, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("a constrained request on a scheduler without grammars")

    def refusal(self, param: str, matcher: xgr.GrammarMatcher, token: int) -> FinishAbort:
        raise AssertionError("a constrained request on a scheduler without grammars")


class TokenMasks:
    """The step's bitmask (reused step after step) and the batched fill and accept: an int32
    bitmask ``[rows, ceil(V / 32)]``, filled for the constrained rows only
    (``xgr.BatchGrammarMatcher``: one call for all of them); ``GrammarMask.apply`` puts -inf
    on every token a row's grammar forbids, before bias, penalties and everything else the
    sampler does, so no bias brings one back; ``accept`` feeds each constrained row its drawn
    token. A step with a constrained row costs the fill, a copy of the logits with
    xgrammar's masked write, and the accepts; per row, Python builds only the list of drawn
    tokens xgrammar takes, and the list of matchers is kept between steps
    (``RunningBatch.grammar_rows``)."""

    def __init__(self, vocab_size: int, stop_ids: Set[int], device: torch.device) -> None:
        self._vocab_size = vocab_size
        self._device = device
        # Made by the first constrained step (xgrammar is imported by then: see _xgr).
        self._bitmask: torch.Tensor | None = None
        self._batch: xgr.BatchGrammarMatcher | None = None
        self._stop_ids = np.array(sorted(stop_ids), dtype=np.int64)

    def fill(self, grammar: GrammarRows, n: int) -> GrammarMask:
        """The mask of a draw over ``n`` rows of which ``grammar.rows`` are constrained."""
        if self._bitmask is None or self._batch is None:
            xgr = _xgr()
            self._bitmask = xgr.allocate_token_bitmask(max(n, _FIRST_ROWS), self._vocab_size)
            self._batch = xgr.BatchGrammarMatcher()
        elif n > len(self._bitmask):
            self._bitmask = _xgr().allocate_token_bitmask(
                max(n, 2 * len(self._bitmask)), self._vocab_size
            )
        self._batch.batch_fill_next_token_bitmask(grammar.matchers, self._bitmask, grammar.indices)
        bitmask = self._bitmask[:n]
        if bitmask.device != self._device:
            bitmask = bitmask.to(self._device)
        return GrammarMask(bitmask, grammar.indices)

    def accept(self, grammar: GrammarRows, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Feeds each constrained row its drawn token (``new``: every row's). Returns the
        rows whose grammar ended (it accepted a stop token) and the rows whose matcher
        refused the token (none, unless something is wrong)."""
        drawn = new[grammar.rows]
        accepted = np.array(
            _xgr().BatchGrammarMatcher.batch_accept_token(grammar.matchers, drawn.tolist()),
            dtype=bool,
        )
        ended = grammar.rows[accepted & np.isin(drawn, self._stop_ids)]
        return ended, grammar.rows[~accepted]

    def refusal(self, param: str, matcher: xgr.GrammarMatcher, token: int) -> FinishAbort:
        """Why a row's matcher refused its drawn token (the event path only): a grammar that
        allows no token where the answer stands (it can never be completed: a 400, as a
        grammar that matches nothing is refused when it compiles), else a fault (500)."""
        if allows_no_token(matcher, self._vocab_size):
            return FinishAbort(
                message=f"{param}: the grammar allows no token after the output so far, so "
                "the answer can never be completed",
                status_code=400,
            )
        return refused_token(param, token, 500)
