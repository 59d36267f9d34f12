"""A constrained request outside the batched step (docs/design/structured-outputs.md):
while it waits for its grammar, outside the waiting queue and the running batch, so a
compile never stalls a step and other requests keep decoding; and when a token is appended
to it one request at a time (``accept_appended``).

A constrained request that passed admission comes here first (``start``): a cached grammar
gives it its matcher at once, else its compile starts on the compiler's pool and it waits
here. Each step, ``take`` looks at the ended compiles without blocking: a compiled request
gets its matcher and its wait in ``SchedulerTimeStats.grammar_wait`` and goes on to the
waiting queue; an invalid spec, or a compile past the time limit, finishes it with a 400 that
names its field. An aborted request leaves nothing behind (``remove``). Without a compiler
(no tokenizer) the queue stays empty, and admission refuses constraints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pipeline.io_struct import FinishAbort, FinishReason, FinishStop
from scheduler_proc.req import Req
from scheduler_proc.sampling.grammar import (
    CompileFault,
    CompileOutcome,
    GrammarCompiler,
    GrammarError,
    Key,
    refused_token,
)
from scheduler_proc.sampling.reasoning_gate import start_grammar

logger = logging.getLogger("tokenpipe.scheduler")


@dataclass(slots=True)
class _Waiting:
    req: Req
    key: Key
    since: float


class GrammarQueue:
    def __init__(self, compiler: GrammarCompiler | None) -> None:
        self.compiler = compiler  # None: structured outputs are off (no tokenizer)
        self._waiting: list[_Waiting] = []  # in arrival order
        # Why admission refuses a constrained request here (None: it does not).
        self.refusal = (
            None
            if compiler is not None
            else "structured outputs need a tokenizer, and this server runs with "
            "--skip-tokenizer-init"
        )

    def __len__(self) -> int:
        return len(self._waiting)

    def start(self, req: Req, now: float) -> bool:
        """Gives a constrained request its matcher from the cache (or, for a spec known to
        be invalid, its 400), or starts its compile: True when it must wait here."""
        constraint, compiler = req.constraint, self.compiler
        assert constraint is not None and compiler is not None, "admission refuses it"
        key = compiler.key(constraint)
        outcome = compiler.lookup(key)
        if outcome is None:
            compiler.submit(key)
            self._waiting.append(_Waiting(req, key, now))
            return True
        _settle(req, outcome, now)
        return False

    def any_done(self) -> bool:
        """Whether ``take`` would hand over a request now."""
        return self.compiler is not None and bool(self._waiting) and self.compiler.any_ended()

    def take(self, now: float) -> list[Req]:
        """The requests whose compile ended, in arrival order: each with its matcher, or
        finished with its refusal (the caller queues the first and emits the second).
        Compiles no request waits for any more are put in the cache all the same."""
        if self.compiler is None:
            return []
        ended = self.compiler.poll()
        done = [w for w in self._waiting if w.key in ended]
        if not done:
            return []
        self._waiting = [w for w in self._waiting if w.key not in ended]
        for w in done:
            outcome = ended[w.key]
            if not isinstance(outcome, CompileFault):
                w.req.update_time_stats(grammar_wait=now - w.since)
                _settle(w.req, outcome, now)
                continue
            logger.error(
                "compiling the grammar of req_id=%d rid=%s failed",
                w.req.req_id,
                w.req.rid,
                exc_info=outcome.error,
            )
            message = f"compiling the grammar failed: {type(outcome.error).__name__}"
            w.req.finish(FinishAbort(message=message, status_code=500), now)
        return [w.req for w in done]

    def close(self, wait: float = 0.0) -> bool:
        """Stops the compiler's workers, waiting up to ``wait`` seconds for a compile under
        way; whether none still runs."""
        return self.compiler is None or self.compiler.close(wait)

    def remove(self, req: Req) -> bool:
        """Forgets an aborted request. A compile that no other request waits for is
        released: it never runs if it has not started, and one under way is cached when it
        ends (``take``), so nothing of it stays behind but a cache entry."""
        for i, w in enumerate(self._waiting):
            if w.req is req:
                del self._waiting[i]
                if self.compiler is not None and all(o.key != w.key for o in self._waiting):
                    self.compiler.release(w.key)
                return True
        return False


def _settle(req: Req, outcome: CompileOutcome, now: float) -> None:
    constraint = req.constraint
    assert constraint is not None
    if isinstance(outcome, GrammarError):
        req.finish(FinishAbort(message=f"{constraint.param}: {outcome}", status_code=400), now)
    else:
        reason = start_grammar(req, outcome)  # its matcher, or its gate until reasoning ends
        if reason is not None:
            req.finish(reason, now)


def accept_appended(req: Req, token: int) -> FinishReason | None:
    """A constrained request's matcher takes the token just appended outside the running
    batch (a first token after a prefill, or on a PD decode server the prefill server's):
    ``stop`` when the grammar ended, an abort when the matcher refused the token, else
    None. (In the running batch, ``TokenMasks.accept`` does this for all rows at once.)"""
    assert req.matcher is not None and req.constraint is not None
    if not req.matcher.accept_token(token):
        # On a decode server the token came from the prefill server, whose request ignored
        # the grammar (502); here, the mask let it through, which it never does (500).
        return refused_token(req.constraint.param, token, 502 if req.kv_prebuilt else 500)
    return FinishStop(matched=token) if req.matcher.is_terminated() else None
