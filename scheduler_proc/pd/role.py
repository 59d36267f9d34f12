"""The one seam between the scheduler and PD disaggregation.

A ``Scheduler`` holds one ``PdRole``: ``PrefillKVSender`` (``--disaggregation-mode prefill``,
scheduler_proc/pd/prefill.py), ``DecodeBootstrapper`` (``decode``, scheduler_proc/pd/decode.py)
or ``Unified`` (no PD: every hook does nothing). The scheduler calls the hooks at fixed
points of a request's life and of a step, and never asks which role it holds; what the
PD side may ask of the scheduler in return is ``PdHost``.

Order within a request's life: ``bind`` (on arrival, before any check: a refused prefill
half still answers its decode server), ``on_admit`` (accepted), ``on_first_token`` (its
first token sampled after a prefill), ``on_retract``, ``on_abort`` (before it finishes),
``on_release`` (its KV about to be freed). ``take_inputs`` runs at the start of each step.
"""

from __future__ import annotations

from typing import Protocol

import torch

from scheduler_proc.admission import AdmissionCheck
from scheduler_proc.lora_queue import LoraQueue
from scheduler_proc.req import Req, StatsPending


class PdHost(Protocol):
    """What the PD side may ask of its scheduler."""

    stats_pending: StatsPending
    collect_time_stats: bool
    admission: AdmissionCheck
    loras: LoraQueue

    def enqueue(self, req: Req, now: float) -> None:
        """Queues an accepted request (``PdRole.on_admit`` first)."""

    def slots_for_joining(self, num_tokens: int, joining: int) -> torch.Tensor | None:
        """Pool slots for ``num_tokens`` of KV of a request that joins the running batch
        after ``joining`` others this step, or None while the batch or the pool is full."""

    def append_tokens(self, reqs: list[Req], tokens: list[int], rows: list[Req]) -> list[Req]:
        """Appends one token per request as a sampled one; returns those that keep running."""


class PdRole(Protocol):
    def bind(self, req: Req, room: int | None, endpoint: str | None) -> None:
        """Sets ``req.pd`` for a request that arrived with these bootstrap fields."""

    def on_admit(self, req: Req, now: float) -> bool:
        """True when the PD side takes this accepted request instead of the waiting queue."""

    def take_inputs(self, host: PdHost, rows: list[Req], now: float) -> list[Req]:
        """Step 0: takes what arrived from peers. Returns the requests that join the running
        batch after this step's decode; queues finished ones in ``rows``."""

    def on_first_token(self, reqs: list[Req]) -> None:
        """These requests' first tokens were just sampled after their prefill."""

    def on_retract(self, req: Req, now: float) -> bool:
        """True when the PD side takes this retracted request back instead of a re-prefill."""

    def on_abort(self, req: Req) -> None:
        """Forgets an aborted request wherever the PD side holds it."""

    def on_release(self, req: Req, now: float) -> None:
        """Called just before req's KV is released."""

    def refetch(self) -> None:
        """A pause retracted every request: KV fetched from elsewhere and not installed yet
        (made by weights that may be swapped out before the continue) is fetched again once
        steps run."""

    @property
    def has_work(self) -> bool:
        """Something the next step must handle even with no request queued or running."""

    @property
    def num_waiting(self) -> int:
        """Requests the PD side holds that wait to join the running batch."""


class Unified:
    """No PD disaggregation: every request prefills here, and nothing goes elsewhere."""

    def bind(self, req: Req, room: int | None, endpoint: str | None) -> None:
        pass

    def on_admit(self, req: Req, now: float) -> bool:
        return False

    def take_inputs(self, host: PdHost, rows: list[Req], now: float) -> list[Req]:
        return []

    def on_first_token(self, reqs: list[Req]) -> None:
        pass

    def on_retract(self, req: Req, now: float) -> bool:
        return False

    def on_abort(self, req: Req) -> None:
        pass

    def on_release(self, req: Req, now: float) -> None:
        pass

    def refetch(self) -> None:
        pass

    @property
    def has_work(self) -> bool:
        return False

    @property
    def num_waiting(self) -> int:
        return 0
