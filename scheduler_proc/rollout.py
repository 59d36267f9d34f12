"""The rollout controls an RL loop drives between two steps: pause, continue, and new
weights from disk, and the weights' version every request's stats carry.

A pause treats the requests in flight by its mode: ``abort`` finishes every live one with
its output so far; ``retract`` sends the running ones back to wait (KV freed, counted as
retractions, seeded outputs unchanged); ``in_place`` keeps the batch; ``wait`` admits none
and pauses once the running ones finish. Paused, no step runs; arrivals wait (bounded by
--max-queued-requests) and aborts are answered. An update is read on its own thread while
steps go on, then swapped in at a safe point (at once while paused, else once no request
holds KV, none admitted meanwhile), the prefix cache flushed. After an ``in_place`` update
the requests that kept their KV (``stale``) finish on it, and none reads the cache until
they are gone (docs/design/rollout.md)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from pipeline.control_frames import (
    ContinueControl,
    PauseControl,
    PauseMode,
    RolloutState,
    UpdateWeightsControl,
)
from pipeline.io_struct import AbortReq
from scheduler_proc.model.weight_update import StagedWeights, WeightStager, swap_in
from scheduler_proc.retraction import RetractHost, retract_all

from scheduler_proc.cache.prefix_kv import PrefixKV
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.req import Req

logger = logging.getLogger("tokenpipe.scheduler")


class RolloutHost(RetractHost, Protocol):
    """What the rollout controls ask of the scheduler."""

    runner: ModelRunner
    live: dict[int, Req]

    @property
    def num_running(self) -> int: ...

    def abort(self, msg: AbortReq) -> object:
        """Stops the requests ``msg`` names, each finishing with its output so far."""


@dataclass
class PendingUpdate:
    control: UpdateWeightsControl
    staged: Future[StagedWeights]
    started: float  # time.monotonic() at the control


@dataclass
class RolloutCounters:
    """Running totals for the stats report (``tokenpipe:paused_seconds_total`` and the
    weight-update series)."""

    paused_seconds: float = 0.0
    updates_ok: int = 0
    updates_failed: int = 0
    update_seconds: list[float] = field(default_factory=list)  # since the last report

    def take_update_seconds(self) -> tuple[float, ...]:
        taken, self.update_seconds = tuple(self.update_seconds), []
        return taken


class Rollout:
    def __init__(self, stager: WeightStager, weight_version: str) -> None:
        self._stager = stager
        self.weight_version = weight_version
        self.paused: PauseMode | None = None
        self._drained = False  # a wait-mode pause whose running requests have finished
        self._paused_at = 0.0  # time.monotonic() when steps stopped
        self._pause_waiters: list[int] = []  # wait-mode controls answered once drained
        self._update: PendingUpdate | None = None
        self.stale: set[int] = set()  # req_ids decoding on KV of the weights before
        self.counters = RolloutCounters()

    # --- what the step asks --------------------------------------------------------------

    @property
    def runs_steps(self) -> bool:
        return self.paused is None or (self.paused == "wait" and not self._drained)

    @property
    def admits(self) -> bool:
        """Whether waiting requests may start: not while paused, nor while read weights
        wait for the running requests to finish."""
        loaded = self._update is not None and self._update.staged.done()
        return self.paused is None and not loaded

    @property
    def busy(self) -> bool:
        """Work between steps: weights being read, or waited on to be swapped in."""
        return self._update is not None

    def may_cache(self, req: Req) -> bool:
        return req.req_id not in self.stale

    def on_release(self, req: Req, prefix_kv: PrefixKV) -> None:
        """The last request on the old weights' KV is gone: what the cache took from the
        requests since holds nothing stale any more only once flushed."""
        if self.stale:
            self.stale.discard(req.req_id)
            if not self.stale:
                prefix_kv.flush()

    # --- the controls ----------------------------------------------------------------------

    def pause(self, s: RolloutHost, msg: PauseControl, now: float) -> list[RolloutState]:
        """Applies ``msg.mode``. Its answer comes at once, but for a wait once drained (a
        wait still draining is answered when another mode pauses)."""
        with self._steps_change():
            self.paused, self._drained = msg.mode, False
            if msg.mode == "abort":
                s.abort(AbortReq(abort_all=True, reason="generation paused (mode abort)"))
            elif msg.mode == "retract":
                retract_all(s, now)
            elif msg.mode == "wait" and not self._holds_kv(s):
                self._drained = True
        if msg.mode == "wait" and not self._drained:
            self._pause_waiters.append(msg.control_id)
            return []
        logger.info("generation paused (mode %s): %d requests held", msg.mode, len(s.live))
        return self._answer_waiters(s, [msg.control_id], f"Generation paused (mode {msg.mode}).")

    def resume(self, s: RolloutHost, msg: ContinueControl) -> list[RolloutState]:
        """Continues; a wait still draining is answered as not paused."""
        message = "generation continued before the running requests ended"
        answers = [self.state(s, waiter, False, message) for waiter in self._pause_waiters]
        self._pause_waiters = []
        if self.paused is not None:
            logger.info("generation continued after a pause (mode %s)", self.paused)
        with self._steps_change():
            self.paused = None
        return [*answers, self.state(s, msg.control_id, True, "Generation continued.")]

    def update_weights(self, s: RolloutHost, msg: UpdateWeightsControl) -> RolloutState | None:
        """Starts reading the checkpoint (answered at the swap), or refuses a second update
        while one is under way."""
        if self._update is not None:
            message = "another weight update is in progress; send this one after it answers"
            return self.state(s, msg.control_id, False, message)
        if msg.abort_all_requests:
            s.abort(AbortReq(abort_all=True, reason="aborted for a weight update"))
        staged = self._stager.start(msg.model_path)
        self._update = PendingUpdate(msg, staged, time.monotonic())
        return None

    def advance(self, s: RolloutHost) -> list[RolloutState]:
        """After each step: answers a wait-mode pause that drained, and swaps read weights
        in at a safe point (or reports why they could not be read)."""
        answers = []
        if self.paused == "wait" and not self._drained and not self._holds_kv(s):
            with self._steps_change():
                self._drained = True
            answers = self._answer_waiters(s, [], "Generation paused (mode wait).")
        update = self._update
        if update is not None and update.staged.done():
            if update.staged.exception() is not None:
                answers.append(self._failed(s, update))
            elif not self.runs_steps or not self._holds_kv(s):
                answers.append(self._swap(s, update, update.staged.result()))
        return answers

    def close(self) -> None:
        self._stager.close()

    # --- inside ----------------------------------------------------------------------------

    def _swap(self, s: RolloutHost, update: PendingUpdate, staged: StagedWeights) -> RolloutState:
        swap_in(s.runner.model, staged)
        s.pd.refetch()  # KV a prefill server made before this swap is made again
        # Never the same tag twice, in this process or another writing the same directory.
        s.prefix_kv.hicache.new_weights(secrets.token_hex(8))
        msg = update.control
        if msg.flush_cache:
            # In place, the running requests keep their KV: it is the old weights'.
            holders = [*s.running, *s.prefilling]
            self.stale.update(r.req_id for r in holders)
            s.prefix_kv.flush()
        self.weight_version = msg.weight_version or self.weight_version
        for req in s.live.values():
            req.update_stats(weight_version=self.weight_version)
        self._update = None
        seconds = time.monotonic() - update.started
        self.counters.updates_ok += 1
        self.counters.update_seconds.append(seconds)
        logger.info(
            "weights of %s swapped in (version %s) after %.3f s",
            msg.model_path,
            self.weight_version,
            seconds,
        )
        message = f"Succeeded to update model weights (version {self.weight_version})."
        return self.state(s, msg.control_id, True, message, seconds)

    def _failed(self, s: RolloutHost, update: PendingUpdate) -> RolloutState:
        self._update = None
        self.counters.updates_failed += 1
        self.counters.update_seconds.append(time.monotonic() - update.started)
        error = update.staged.exception()
        logger.warning("weight update from %s failed: %s", update.control.model_path, error)
        message = f"Failed to update weights: {error}. The weights served are unchanged."
        return self.state(s, update.control.control_id, False, message)

    def _holds_kv(self, s: RolloutHost) -> bool:
        """Whether a request holds KV in the pool (KV fetched for a PD decode request but
        not installed yet is fetched again after a swap: ``PdRole.refetch``)."""
        return bool(s.num_running)

    def _answer_waiters(self, s: RolloutHost, ids: list[int], message: str) -> list[RolloutState]:
        """Paused: answers ``ids`` and every wait-mode pause still waiting."""
        ids, self._pause_waiters = [*self._pause_waiters, *ids], []
        return [self.state(s, control_id, True, message) for control_id in ids]

    @contextmanager
    def _steps_change(self) -> Iterator[None]:
        """Counts the paused seconds across a change of state: from when steps stop to
        when they run again."""
        before = self.runs_steps
        yield
        now = time.monotonic()
        if before and not self.runs_steps:
            self._paused_at = now
        elif not before and self.runs_steps:
            self.counters.paused_seconds += now - self._paused_at

    def paused_seconds_total(self) -> float:
        """Seconds without steps so far, the pause under way included."""
        ongoing = 0.0 if self.runs_steps else time.monotonic() - self._paused_at
        return self.counters.paused_seconds + ongoing

    def state(
        self, s: RolloutHost, control_id: int, ok: bool, message: str, seconds: float = 0.0
    ) -> RolloutState:
        return RolloutState(
            control_id=control_id,
            ok=ok,
            message=message,
            paused=self.paused,
            weight_version=self.weight_version,
            num_paused_requests=len(s.live) if self.paused is not None else 0,
            seconds=seconds,
        )
