"""Retraction policy: which request gives up its KV when the pool cannot give every running
request its next token. The scheduler retracts until the next decode step fits."""

from __future__ import annotations

from scheduler_proc.req import Req
from scheduler_proc.batch.running_batch import RunningBatch


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
