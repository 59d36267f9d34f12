"""The draft model's KV (``draft_model.py``): its own pool, and per request (by req_id) the
pool slots of its first tokens, position by position, with how many of them are tokens known
to be in its sequence (the rest are the KV of drafts not yet verified). ``fit`` decides which
rows one propose may feed and draft within the pool's free slots and a pass's token budget.

Invariant: a request holds slots only while it is in the running batch the last propose saw
(``retain`` frees the others), and after ``keep_first`` only the KV of known tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from scheduler_proc.cache.kv_pool import KVPool

_NO_SLOTS = torch.zeros(0, dtype=torch.long)


@dataclass(slots=True)
class _Held:
    slots: torch.Tensor  # CPU int64: the draft pool slot of position j at index j
    known: int  # the first ``known`` positions are tokens of the sequence; the rest drafts'


class DraftKV:
    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._held: dict[int, _Held] = {}

    def held(self, req_id: int) -> int:
        """Positions whose KV the draft holds for the request (0: none)."""
        entry = self._held.get(req_id)
        return 0 if entry is None else entry.slots.numel()

    def retain(self, req_ids: np.ndarray) -> None:
        """Frees the KV of every request not in ``req_ids`` (the running batch's)."""
        gone = self._held.keys() - set(req_ids.tolist())
        self._free([self._held.pop(req_id).slots for req_id in gone])

    def usable(self, req_id: int, seq_len: int) -> torch.Tensor:
        """The slots a propose may build on for a sequence of ``seq_len`` tokens: those of
        known tokens, short of the last (a pass needs one new token to draw from). Frees the
        rest: a verify that never came leaves drafts' KV, which the tokens may contradict."""
        entry = self._held.get(req_id)
        if entry is None:
            return _NO_SLOTS
        keep = min(entry.known, seq_len - 1)
        if keep < entry.slots.numel():
            self._free([entry.slots[keep:]])
            entry.slots = entry.slots[:keep]
        entry.known = keep
        return entry.slots

    def hold(self, req_id: int, slots: torch.Tensor, known: int) -> None:
        """After a propose: the request's slots (known tokens, then drafts)."""
        self._held[req_id] = _Held(slots, known)

    def keep_first(self, req_ids: np.ndarray, counts: np.ndarray) -> None:
        """Request ``req_ids[i]`` keeps the KV of its first ``counts[i]`` positions (those
        it holds of them), all known tokens now; the rest is freed, in one call."""
        freed = []
        for req_id, count in zip(req_ids.tolist(), counts.tolist()):
            entry = self._held.get(req_id)
            if entry is None:
                continue
            keep = min(count, entry.slots.numel())
            freed.append(entry.slots[keep:])
            entry.slots = entry.slots[:keep]
            entry.known = keep
        self._free(freed)

    def _free(self, slots: list[torch.Tensor]) -> None:
        if slots:
            self.pool.free(torch.cat(slots))


def fit(
    catch_up: np.ndarray, want: np.ndarray, free: int, budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the tokens the first pass feeds it and the drafts it makes. A row whose
    ``catch_up`` tokens (those the draft has not seen) fit the pass's token ``budget`` and,
    with drafts 1 .. ``want`` - 1, the ``free`` slots drafts ``want``; one whose catch-up is
    over the budget left feeds what it allows and drafts from a later step (a long prompt is
    read in chunks, as the target prefills it); one that does not fit gets nothing this
    step. Rows with the least to catch up go first: they are the cheapest drafts."""
    feed = np.zeros(len(want), dtype=np.int64)
    drafts = np.zeros(len(want), dtype=np.int64)
    for i in np.argsort(catch_up, kind="stable").tolist():
        if want[i] <= 0:
            continue
        fed, wanted = int(catch_up[i]), int(want[i])
        if fed <= budget and fed + wanted - 1 <= free:
            feed[i], drafts[i] = fed, wanted
            budget -= fed
            free -= fed + wanted - 1
        elif budget < fed and 0 < budget <= free:
            feed[i] = budget
            free -= budget
            budget = 0
    return feed, drafts
