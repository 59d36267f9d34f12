"""Scheduling policies: ``Fcfs`` (the default: arrival order, nothing preempted) and
``PriorityScheduling`` (``--scheduling-policy priority``, ``--enable-priority-scheduling``).
Under priority scheduling, waiting requests are admitted by priority; a waiting request that
cannot be admitted (``--max-running-requests`` reached, or no KV) retracts the lowest-priority
running request, through the usual retraction, when its priority is strictly lower; a full
queue gives up its lowest waiting request for a higher arrival; and a retraction for the pool
takes the lowest priority first. Strictly lower only, so equal priorities never preempt each
other and a victim, which waits behind its preemptor, can never preempt it back. The scheduler
calls these hooks only where admission waits or fails, never in a steady decode step.
"""

from __future__ import annotations

import time
from collections import deque
from itertools import islice
from typing import Protocol

import torch

from pipeline.config import ServerConfig
from pipeline.io_struct import FinishAbort
from scheduler_proc.admission import QUEUE_FULL_RETRY_AFTER
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.cache.hicache import Fetched
from scheduler_proc.retraction import RetractHost, retract, take_victim
from scheduler_proc.req import Req
from scheduler_proc.waiting_queue import PriorityOrder, PriorityQueue, WaitingQueue

Admitted = tuple[torch.Tensor, Fetched | None]  # what ``PrefixKV.admit`` gives


class SchedulingHost(RetractHost, Protocol):
    """The scheduler's parts a policy reads or changes."""

    max_running_requests: int

    def drop(self, req: Req, reason: FinishAbort, now: float) -> None:
        """Finishes ``req`` wherever it is with ``reason``, and queues its row."""


class SchedulingPolicy(Protocol):
    @property
    def waiting(self) -> WaitingQueue:
        """The scheduler's waiting queue, in admission order."""

    def make_room(self, host: SchedulingHost) -> None:
        """Before admission, while requests wait: frees running slots for the waiting
        requests that outrank running ones (``--max-running-requests``)."""

    def admit_by_preempting(
        self, host: SchedulingHost, req: Req, *, match: bool, budget: int
    ) -> Admitted | None:
        """``req``, at the head of the queue, did not get its KV: retracts lower requests
        until it does; None when that cannot help."""

    def displace(self, host: SchedulingHost, arrival: Req) -> bool:
        """The queue is full: True when a waiting request gave its place up to ``arrival``."""

    def take_victim(self, prefilling: list[Req], running: RunningBatch | list[Req]) -> Req:
        """Removes and returns the next request to retract when the pool runs short."""


class Fcfs:
    """First come, first served: a deque, and every hook does nothing."""

    def __init__(self) -> None:
        self.waiting: deque[Req] = deque()

    def make_room(self, host: SchedulingHost) -> None:
        pass

    def admit_by_preempting(
        self, host: SchedulingHost, req: Req, *, match: bool, budget: int
    ) -> Admitted | None:
        return None

    def displace(self, host: SchedulingHost, arrival: Req) -> bool:
        return False

    def take_victim(self, prefilling: list[Req], running: RunningBatch | list[Req]) -> Req:
        return take_victim(prefilling, running)


class PriorityScheduling:
    def __init__(self, order: PriorityOrder) -> None:
        self.order = order
        self.queue = PriorityQueue(order)
        self.waiting: WaitingQueue = self.queue

    def make_room(self, host: SchedulingHost) -> None:
        free = host.max_running_requests - len(host.running) - len(host.prefilling)
        now = time.time()
        # The first ``free`` waiting requests take the free slots; each one after them takes
        # the slot of a running request it outranks. A victim waits behind the request that
        # took its slot, so these first waiting requests are the ones admission tries.
        for req in list(islice(self.queue, max(free, 0) + len(host.running))):
            if free > 0:
                free -= 1
                continue
            victim = self._victim(host.running, req)
            if victim is None:
                return  # those behind rank no higher
            host.running.remove(victim)
            retract(host, victim, now)

    def admit_by_preempting(
        self, host: SchedulingHost, req: Req, *, match: bool, budget: int
    ) -> Admitted | None:
        now = time.time()
        while (victim := self._victim(host.running, req)) is not None:
            host.running.remove(victim)
            retract(host, victim, now)  # its KV goes into the prefix cache, evictable
            got = host.prefix_kv.admit(req, match=match, budget=budget, reserve=host.mode.demand())
            if got is not None:
                return got
        return None

    def displace(self, host: SchedulingHost, arrival: Req) -> bool:
        victim = self.queue.lowest_below(arrival)
        if victim is None:
            return False
        reason = FinishAbort(
            message="the waiting queue is full and this request gave its place to one of "
            "higher priority; retry later",
            status_code=503,
            retry_after=QUEUE_FULL_RETRY_AFTER,
        )
        host.drop(victim, reason, time.time())
        return True

    def take_victim(self, prefilling: list[Req], running: RunningBatch | list[Req]) -> Req:
        ranks = {self.order.rank(r) for r in (*prefilling, *running)}
        if len(ranks) <= 1:  # one priority: the usual choice (retraction.take_victim)
            return take_victim(prefilling, running)
        worst = max(ranks)
        lowest = [r for r in prefilling if self.order.rank(r) == worst]
        if lowest:
            victim = max(lowest, key=_latest)
            prefilling.remove(victim)
            return victim
        victim = max((r for r in running if self.order.rank(r) == worst), key=_latest)
        running.remove(victim)
        return victim

    def _victim(self, running: RunningBatch | list[Req], req: Req) -> Req | None:
        """The running request ``req`` may preempt: the lowest priority, the latest to
        arrive among equals, when its priority is strictly lower than ``req``'s."""
        worst = max(running, key=lambda r: (self.order.rank(r), _latest(r)), default=None)
        return worst if worst is not None and self.order.outranks(req, worst) else None


def _latest(req: Req) -> tuple[float, int]:
    return req.arrival_time, req.req_id


def priority_order(config: ServerConfig) -> PriorityOrder | None:
    """The order of priority scheduling, None without it. vLLM's ``--scheduling-policy
    priority`` runs lower values first; SGLang's ``--enable-priority-scheduling`` higher ones,
    unless ``--schedule-low-priority-values-first``."""
    if not config.priority_scheduling:
        return None
    low_first = config.scheduling_policy == "priority" or config.schedule_low_priority_values_first
    return PriorityOrder(low_first=low_first)


def scheduling_policy(order: PriorityOrder | None) -> SchedulingPolicy:
    return Fcfs() if order is None else PriorityScheduling(order)
