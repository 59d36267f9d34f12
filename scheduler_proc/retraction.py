"""Retraction: a request gives up its KV and waits again, to re-prefill its prompt and
output so far later (its seeded output unchanged). Which one, when the pool cannot give
every running request its next token (``take_victim``: the scheduler retracts until the
next decode step fits), and all of them for a pause in mode retract. These functions work
on the scheduler's queues between two steps (``RetractHost``)."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.cache.prefix_kv import PrefixKV
from scheduler_proc.decode_mode import DecodeMode
from scheduler_proc.pd.role import PdRole
from scheduler_proc.req import Req
from scheduler_proc.waiting_queue import WaitingQueue

logger = logging.getLogger("tokenpipe.scheduler")


class VictimChoice(Protocol):
    def take_victim(self, prefilling: list[Req], running: RunningBatch | list[Req]) -> Req:
        """Removes and returns the next request to retract when the pool runs short:
        ``take_victim`` below, or the lowest priority first (scheduler_proc/priority.py)."""


class RetractHost(Protocol):
    """The scheduler's parts a retraction changes."""

    prefix_kv: PrefixKV
    mode: DecodeMode
    pd: PdRole
    prefilling: list[Req]
    waiting: WaitingQueue
    num_retracted_total: int

    @property
    def scheduling(self) -> VictimChoice: ...

    @property
    def running(self) -> RunningBatch | list[Req]: ...

    def release_kv(self, req: Req) -> None:
        """Frees the request's KV, caching what may be cached."""


def retract_until_fits(s: RetractHost) -> None:
    """Frees KV until every running request can take its next step."""
    now = time.time()
    while not s.prefix_kv.fits(s.mode.demand()):
        retract(s, s.scheduling.take_victim(s.prefilling, s.running), now)


def retract_all(s: RetractHost, now: float) -> None:
    """Retracts every running and mid-prefill request; they wait in the order they had."""
    victims = [*s.prefilling, *s.running]
    s.prefilling = []
    s.pd.refetch()
    for req in reversed(victims):
        if req in s.running:
            s.running.remove(req)
        retract(s, req, now)


def retract(s: RetractHost, req: Req, now: float) -> None:
    """Frees ``req``'s KV (what it computed stays in the cache while the pool allows) and
    puts it first in the waiting queue, or, on a PD decode server, fetches its KV again."""
    s.release_kv(req)
    req.hidden_sum = None  # an embedding request pools again from its re-prefill
    req.mark_retracted(now)
    s.num_retracted_total += 1
    if s.pd.on_retract(req, now):
        return  # a decode server fetches its KV again (and logs it)
    s.waiting.appendleft(req)
    # A warning: retraction means the pool is too small for the load, and tests and
    # operators count these lines.
    logger.warning(
        "retracted req_id=%d rid=%s retraction_count=%d", req.req_id, req.rid, req.retraction_count
    )


def take_victim(prefilling: list[Req], running: RunningBatch | list[Req]) -> Req:
    """Removes and returns the next request to retract: mid-prefill requests first, then
    running ones with the fewest output tokens (then the longest prompt). The last running
    request is never retracted: admission guarantees that one request alone always fits."""
    if prefilling:
        return prefilling.pop()
    if len(running) <= 1:
        raise RuntimeError(
            "a single request does not fit the KV pool; admission should have refused it"
        )
    if isinstance(running, RunningBatch):
        victim = running.retraction_victim()
    else:
        victim = min(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
    running.remove(victim)
    return victim
