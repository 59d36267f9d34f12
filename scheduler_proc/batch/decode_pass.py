"""One batched decode step over the running batch (generate mode), and the per-row work
of the rows that need their request.

Hot path: everything but the event rows is column work on the ``RunningBatch``. A row
goes the per-request way only on an event: a finish, a stop string to check, or stats
due (its request is in the scheduler's ``StatsPending`` set). The other due rows come
back as ``SteadyRows`` columns, for ``build_token_output``.

Constrained rows (a grammar: scheduler_proc/sampling/grammar.py) add three column operations,
only while one runs: their mask is filled before the draw, applied in it, and their drawn
tokens accepted after it (a row whose grammar ended finishes with ``stop``); an open thinking
budget (thinking_budget.py) a compare before the draw and one after it."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from pipeline.io_struct import FinishLength, FinishReason, FinishStop
from scheduler_proc.sampling.grammar import StepMasks
from scheduler_proc.sampling.logprobs import keep_decode_logprobs
from scheduler_proc.model.forward_worker import ForwardRunner
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.output_builder import SteadyRows
from scheduler_proc.req import Req, StatsPending
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.sampling.grammar import GrammarRows
from scheduler_proc.sampling.sampler import SamplingColumns
from scheduler_proc.stop_checker import CONTEXT, LENGTH, RUNNING, STOP_TOKEN, StopChecker

# A row's outcome beside the stop checker's: its matcher refused the drawn token.
OUTSIDE_GRAMMAR = 4


@dataclass(frozen=True, slots=True)
class Prepared:
    """A draw's inputs built before its logits (``BatchDecoder.prepare``)."""

    at: np.ndarray | None  # the rows drawn (None: every row)
    columns: SamplingColumns
    grammar: GrammarRows | None


@dataclass(frozen=True, slots=True)
class Drawn:
    """A draw's tokens and each row's outcome (the stop checker's codes, or
    ``OUTSIDE_GRAMMAR``) and whether its stop strings must be checked by its text."""

    new: np.ndarray
    code: np.ndarray
    check_strings: np.ndarray


class BatchDecoder:
    def __init__(
        self,
        runner: ModelRunner,
        stop_checker: StopChecker,
        stats_pending: StatsPending,
        dense_usage_columns: bool,
        masks: StepMasks,
        forward: ForwardRunner,
    ) -> None:
        self.runner = runner
        self.forward = forward  # where the forward runs: its own thread, or inline
        self.stop_checker = stop_checker
        self.stats_pending = stats_pending  # the scheduler's: whose rows carry stats
        self.dense_usage_columns = dense_usage_columns  # SteadyRows keep their requests
        self.masks = masks  # the constrained rows' masks (NoGrammars: a scheduler has none)

    def launch(self, batch: RunningBatch, slots: torch.Tensor) -> Future[torch.Tensor]:
        """Starts the forward of one decode pass over every row of ``batch`` (``slots``: one
        new KV slot each) on the ``forward`` runner; ``finish`` takes its logits. Until then
        the batch's rows, tokens and lengths must not change (the forward reads them)."""
        n = len(batch)
        return self.forward.submit(
            self.runner.decode,
            batch.last_tokens(),
            batch.seq_len[:n],
            batch.write_kv_slots(slots),
            batch.joined[:n],
            batch.lora_slots(),
        )

    def finish(
        self, batch: RunningBatch, forward: Future[torch.Tensor], rows: list[Req]
    ) -> SteadyRows | None:
        """Samples one token for every row of ``batch`` from the launched ``forward``. Rows
        with an event are queued in ``rows`` as requests (a finished one leaves the batch);
        the other due rows come back as columns. The sampler's inputs (bans, the grammar
        mask, the parameter columns) are built while the forward runs: the only wait is for
        its logits."""
        prepared = self.prepare(batch)
        drawn = self.draw(batch, forward.result(), prepared)
        return self.settle(batch, drawn.code, drawn.check_strings, rows)

    def prepare(self, batch: RunningBatch, at: np.ndarray | None = None) -> Prepared:
        """What a draw over the rows ``at`` (ascending; None: every row) needs before its
        logits: the min_new_tokens bans, the constrained rows' mask, the forced tokens."""
        sel = slice(0, len(batch)) if at is None else at
        bans = self.stop_checker.min_new_bans(
            batch.output_len(at), batch.params["min_new_tokens"][sel], batch.stop_ids[sel]
        )
        grammar = batch.grammar_rows(at)
        size = len(batch) if at is None else len(at)
        mask = self.masks.fill(grammar, size) if grammar is not None else None
        columns = batch.sampling_columns(bans, mask, batch.forced_tokens(at), at)
        return Prepared(at, columns, grammar)

    def draw(self, batch: RunningBatch, logits: torch.Tensor, prepared: Prepared) -> Drawn:
        """Draws one token for each row of ``prepared`` (``logits``: theirs, in order) and
        appends it: its logprobs when asked, its grammar's accept, its gates and budgets,
        and its stop check by columns (stop strings are left to the per-row check)."""
        at = prepared.at
        sel = slice(0, len(batch)) if at is None else at
        new = self.runner.sample(logits, prepared.columns)
        batch.append_tokens(new, at)
        asking = np.flatnonzero(batch.wants_logprobs[sel])
        if asking.size:
            keep_decode_logprobs(batch, logits, asking, new, None if at is None else at[asking])
        params = batch.params
        code, check_strings = self.stop_checker.check_columns(
            new, batch.output_len(at), batch.seq_len[sel], params["min_new_tokens"][sel],
            params["max_new_tokens"][sel], params["ignore_eos"][sel], batch.stop_ids[sel],
            batch.has_stop_strings[sel],
        )  # fmt: skip
        grammar = prepared.grammar
        if grammar is not None:
            ended, refused = self.masks.accept(grammar, new)
            code[ended] = STOP_TOKEN  # the grammar ended (its stop token), whatever ignore_eos says
            code[refused] = OUTSIDE_GRAMMAR
        batch.open_gates(new, at)  # grammars waiting for the end of the reasoning
        batch.close_budgets(new, at)  # thinking budgets whose end is now in the output
        return Drawn(new, code, check_strings)

    def stops_on_text(self, batch: RunningBatch, row: int) -> bool:
        """Whether row ``row``'s newest token completes one of its stop strings (a row that
        ``draw`` says must be checked by its text)."""
        req = batch.reqs[row]
        batch.sync(req)
        return self.stop_checker.check(req) is not None

    def settle(
        self, batch: RunningBatch, code: np.ndarray, check_strings: np.ndarray, rows: list[Req]
    ) -> SteadyRows | None:
        """After a step's draws (``code`` and ``check_strings``: every row's outcome of its
        last draw): the due rows without an event come back as columns; those with one (a
        finish, a stop string to check, stats due) are queued in ``rows``."""
        due = batch.due(code != RUNNING)
        event = (code != RUNNING) | check_strings
        if (
            self.stats_pending
        ):  # stats changed since their last row: that row goes the per-request way
            for req in list(self.stats_pending):
                if req in batch:
                    row = batch.row_of(req)
                    event[row] |= due[row]
        steady_rows = np.flatnonzero(due & ~event)
        steady = (
            batch.take_steady(steady_rows, with_reqs=self.dense_usage_columns)
            if steady_rows.size
            else None
        )
        event_rows = np.flatnonzero(event)
        if event_rows.size:
            self._events(batch, event_rows, code, rows)
        return steady

    def _events(
        self, batch: RunningBatch, event_rows: np.ndarray, code: np.ndarray, rows: list[Req]
    ) -> None:
        """The rows of a decode step that need their request: a finish (the request leaves
        the batch), a stop string to check, stats due. Per-row work, for these rows only."""
        ends = batch.seq_len[event_rows]
        tokens = batch.tokens[event_rows, ends - 1].tolist()
        lengths = (ends - batch.prompt_len[event_rows]).tolist()
        events = [
            (batch.reqs[i], int(code[i]), token, length)
            for i, token, length in zip(event_rows.tolist(), tokens, lengths)
        ]
        for req, outcome, token, length in events:
            batch.sync(req)
            reason: FinishReason | None = None
            if outcome == OUTSIDE_GRAMMAR:
                assert req.constraint is not None and req.matcher is not None
                reason = self.masks.refusal(req.constraint.param, req.matcher, token)
            elif (
                req.sampling.stop
                and outcome != STOP_TOKEN
                and length >= req.sampling.min_new_tokens
            ):
                reason = self.stop_checker.check(req)  # the text decides; its order of checks wins
            elif outcome == STOP_TOKEN:
                reason = FinishStop(matched=token)
            elif outcome == LENGTH:
                reason = FinishLength(length=req.sampling.max_new_tokens)
            elif outcome == CONTEXT:
                reason = FinishLength(length=length)
            if reason is not None:
                req.finish(reason)
                batch.remove(req)  # its pending logprobs go back to it
            if req.output_due():
                if reason is None:
                    batch.hand_over_logprobs(req)  # this row goes out the per-request way
                rows.append(req)
