"""How the running requests decode, one object per ``--mode``: ``TokenDecode`` (generate and
embedding: one token per request per step, as column work on the ``RunningBatch``) or
``dllm.DllmDecoder`` (block diffusion: a request list refined block by block). The
scheduler calls its ``DecodeMode`` the same way in every mode and never asks which it holds."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol

import torch

from scheduler_proc.batch.decode_pass import BatchDecoder
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.output_builder import SteadyRows
from scheduler_proc.req import Req
from scheduler_proc.speculative.counters import SpecCounters
from scheduler_proc.speculative.proposer import Drafter
from scheduler_proc.speculative.verify import NoSpeculation, Plan, Speculation


class DecodeMode(Protocol):
    # Whether the logits of a completed prefill pick the request's first token.
    samples_first_token: bool
    # What admission says of max_new_tokens when the output does not fit the pool.
    output_slots_note: str
    # Why a constrained request is refused in this mode (None: grammars may run here).
    constraint_refusal: str | None
    # Why a request with a thinking budget is refused in this mode (None: it may run here).
    thinking_budget_refusal: str | None

    @property
    def running(self) -> RunningBatch | list[Req]:
        """The running requests, which the scheduler extends and removes from."""

    @property
    def spec_counters(self) -> SpecCounters:
        """Speculative decoding's running totals (k 0 and zeros where it is off)."""

    def demand(self) -> int:
        """Pool slots the next step takes (the scheduler retracts until they fit)."""

    def start(self) -> None:
        """Starts the next pass's forward where this mode can run it beside the step's
        prefill (the scheduler calls it only when no request needs retracting first);
        ``step`` finishes it."""

    def step(self, rows: list[Req]) -> tuple[SteadyRows | None, int]:
        """One decode pass over every running request (the one ``start`` began, if any):
        queues the rows with an event in ``rows``, drops the finished ones from
        ``running``; returns the other due rows as columns and the number of tokens it
        added to outputs."""

    def note_sent(self, req: Req) -> None:
        """An event row of this running request went out."""

    def drop_block(self, req: Req) -> None:
        """Forgets work in progress that is not in ``req.kv_slots`` (its KV is released)."""

    def peak_output_slots(self, max_new_tokens: int) -> int:
        """KV slots the output may take at its peak."""


class TokenDecode:
    """Generate and embedding modes: one token per running request per step, or, with
    speculation, a verify pass that may give a request several (speculative/verify.py)."""

    samples_first_token = True
    output_slots_note = ""
    constraint_refusal: str | None = None
    thinking_budget_refusal: str | None = None

    def __init__(
        self,
        decoder: BatchDecoder,
        batch: RunningBatch,
        alloc: Callable[[int], torch.Tensor | None],
        speculation: Speculation | NoSpeculation,
    ) -> None:
        self._decoder = decoder
        self._batch = batch
        self._alloc = alloc
        self._speculation = speculation
        # The forward ``start`` launched, and the drafts it verifies (None: a plain step).
        self._started: tuple[Future[torch.Tensor], Plan | None] | None = None

    @classmethod
    def build(
        cls,
        decoder: BatchDecoder,
        context_length: int,
        alloc: Callable[[int], torch.Tensor | None],
        drafter: Drafter | None,
    ) -> TokenDecode:
        """The running batch and the speculation (``drafter``: its settings and proposer;
        None: off) around ``decoder``."""
        runner = decoder.runner
        batch = RunningBatch(context_length, runner.model_config.vocab_size)
        if drafter is None:
            return cls(decoder, batch, alloc, NoSpeculation())
        spec = Speculation(drafter, decoder, runner.kv, decoder.forward, context_length)
        return cls(decoder, batch, alloc, spec)

    @property
    def running(self) -> RunningBatch:
        return self._batch

    @property
    def spec_counters(self) -> SpecCounters:
        return self._speculation.counters

    def demand(self) -> int:
        return len(self._batch)

    def start(self) -> None:
        """Launches a verify pass when rows draft (their drafts take free slots, evicting
        cached prefixes at most: never a retraction), else a plain decode pass."""
        batch, spec = self._batch, self._speculation
        plan = spec.plan(batch)
        if plan is not None:
            slots = self._alloc(len(batch) + plan.num_drafts)
            if slots is not None:
                self._started = (spec.launch(batch, plan, slots), plan)
                return
            spec.cancel(batch, plan)
        slots = self._alloc(len(batch))
        assert slots is not None, "retraction left too few KV slots"
        self._started = (self._decoder.launch(batch, slots), None)

    def step(self, rows: list[Req]) -> tuple[SteadyRows | None, int]:
        if self._started is None:
            self.start()
        assert self._started is not None
        (forward, plan), self._started = self._started, None
        if plan is not None:
            return self._speculation.finish(self._batch, plan, forward, rows)
        tokens = len(self._batch)  # one per row, before finished rows leave the batch
        return self._decoder.finish(self._batch, forward, rows), tokens

    def note_sent(self, req: Req) -> None:
        if req in self._batch:
            self._batch.note_sent(req)

    def drop_block(self, req: Req) -> None:
        pass  # a token's KV is in the request's slots as soon as it is decoded

    def peak_output_slots(self, max_new_tokens: int) -> int:
        return max_new_tokens
