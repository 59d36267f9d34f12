"""Grammars after reasoning (docs/design/structured-outputs.md): a constraint whose
``reasoning_end`` is set (a chat request with a reasoning parser on) applies from the token
after the end of the reasoning, as vLLM's does; before it, the output is free, so the model
can think and then close its reasoning.

Until then the compiled grammar waits on the request (``Req.gate``); the request's matcher
is made when its output first ends with the ``reasoning_end`` ids, and has accepted exactly
the tokens after them. A request that never ends its reasoning is never constrained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pipeline.io_struct import Constraint, FinishReason, FinishStop
from scheduler_proc.sampling.grammar import new_matcher, refused_token

if TYPE_CHECKING:
    import xgrammar as xgr


@dataclass(frozen=True, slots=True)
class ReasoningGate:
    """A compiled grammar waiting for ``end``, the token ids that close the reasoning."""

    grammar: xgr.CompiledGrammar
    end: tuple[int, ...]


def ends_with(output_ids: Sequence[int], end: tuple[int, ...]) -> bool:
    """Whether ``output_ids`` (the output, or as many of its last tokens as ``end`` has)
    ends with ``end``, the reasoning's end (checked after each token)."""
    n = len(end)
    return len(output_ids) >= n and tuple(output_ids[-n:]) == end


def after_end(output_ids: Sequence[int], end: tuple[int, ...]) -> int | None:
    """Where the output after the first ``end`` starts, or None when it holds no end."""
    n = len(end)
    return next(
        (i for i in range(n, len(output_ids) + 1) if tuple(output_ids[i - n : i]) == end),
        None,
    )


class Req(Protocol):
    """What the gate reads and sets of a request (``scheduler_proc.req.Req``)."""

    constraint: Constraint | None
    output_ids: list[int]
    matcher: xgr.GrammarMatcher | None
    gate: ReasoningGate | None

    @property
    def kv_prebuilt(self) -> bool: ...


def start_grammar(req: Req, grammar: xgr.CompiledGrammar) -> FinishReason | None:
    """Gives a request its compiled grammar: its matcher at once, or, with a
    ``reasoning_end``, a gate until its output holds that end. A request whose output holds
    it already (on a PD decode server: the prefill server's first token) gets its matcher with
    the tokens after the end accepted; an abort when one is outside the grammar."""
    assert req.constraint is not None
    end = req.constraint.reasoning_end
    if not end:
        req.matcher = new_matcher(grammar)
        return None
    after = after_end(req.output_ids, end)
    if after is not None:
        return _open(req, grammar, req.output_ids[after:])
    req.gate = ReasoningGate(grammar, end)
    return None


def open_if_ended(req: Req, output_ids: Sequence[int] | None = None) -> bool:
    """Called after each token a gated request appends (``output_ids``: the output's last
    tokens, where the running batch holds them rather than the request): makes its matcher
    when that token completed the end of its reasoning, so the grammar applies from the next
    token."""
    gate = req.gate
    tail = req.output_ids if output_ids is None else output_ids
    if gate is None or not ends_with(tail, gate.end):
        return False
    req.gate = None
    req.matcher = new_matcher(gate.grammar)
    return True


def _open(req: Req, grammar: xgr.CompiledGrammar, after: Sequence[int]) -> FinishReason | None:
    req.matcher = matcher = new_matcher(grammar)
    for token in after:
        if not matcher.accept_token(token):
            assert req.constraint is not None
            return refused_token(req.constraint.param, token, 502 if req.kv_prebuilt else 500)
        if matcher.is_terminated():
            return FinishStop(matched=token)
    return None
