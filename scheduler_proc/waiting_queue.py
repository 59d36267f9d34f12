"""The waiting queue: requests accepted and not yet admitted, in the order admission takes
them. Under first come, first served it is a plain ``deque`` (arrival order; a retracted
request goes back to the front). Under priority scheduling it is a ``PriorityQueue``: by
priority (the server's flag says whether lower or higher values go first), then first come,
first served within one priority, a retracted request going back to the front of its own
priority class. Both answer the ``WaitingQueue`` protocol, the operations the scheduler uses.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from scheduler_proc.req import Req


class WaitingQueue(Protocol):
    """What the scheduler does with its waiting queue (``collections.deque`` answers it)."""

    def append(self, req: Req, /) -> None:
        """A request arrives: last (of its priority class)."""

    def appendleft(self, req: Req, /) -> None:
        """A request is retracted: first (of its priority class)."""

    def popleft(self) -> Req:
        """The next request to admit leaves the queue."""

    def remove(self, req: Req, /) -> None:
        """Removes ``req`` (ValueError when it is not here)."""

    def __getitem__(self, index: int, /) -> Req: ...

    def __iter__(self) -> Iterator[Req]: ...

    def __len__(self) -> int: ...

    def __contains__(self, req: object, /) -> bool: ...


@dataclass(frozen=True)
class PriorityOrder:
    """Which priority values go first: lower ones (vLLM's ``--scheduling-policy priority``,
    SGLang's ``--schedule-low-priority-values-first``) or higher ones (SGLang's
    ``--enable-priority-scheduling`` alone)."""

    low_first: bool

    def rank(self, req: Req) -> int:
        """The request's rank: a smaller rank goes first."""
        return req.priority if self.low_first else -req.priority

    def outranks(self, req: Req, other: Req) -> bool:
        """Whether ``req`` goes strictly before ``other`` (an equal priority never does)."""
        return self.rank(req) < self.rank(other)


class PriorityQueue:
    """Waiting requests sorted by (rank, sequence). An arrival takes the next sequence number
    and a retracted request the next one below every number given so far, so each stays first
    come, first served within its priority class, and retracted requests keep the order they
    had at its front, as in the deque. Admission takes the head; the queue is short next to a
    step's work, so a sorted list (insertion by bisection) is enough."""

    def __init__(self, order: PriorityOrder) -> None:
        self.order = order
        self._entries: list[tuple[int, int, Req]] = []  # (rank, sequence, request), sorted
        self._next = 0  # the sequence number of the next arrival
        self._next_front = -1  # the sequence number of the next retracted request

    def append(self, req: Req, /) -> None:
        insort(self._entries, (self.order.rank(req), self._next, req), key=_sort_key)
        self._next += 1

    def appendleft(self, req: Req, /) -> None:
        insort(self._entries, (self.order.rank(req), self._next_front, req), key=_sort_key)
        self._next_front -= 1

    def popleft(self) -> Req:
        if not self._entries:
            raise IndexError("pop from an empty waiting queue")
        return self._entries.pop(0)[2]

    def remove(self, req: Req, /) -> None:
        for i, entry in enumerate(self._entries):
            if entry[2] is req:
                del self._entries[i]
                return
        raise ValueError(f"req_id {req.req_id} is not in the waiting queue")

    def __getitem__(self, index: int, /) -> Req:
        return self._entries[index][2]

    def __iter__(self) -> Iterator[Req]:
        return (entry[2] for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, req: object, /) -> bool:
        return any(entry[2] is req for entry in self._entries)

    def lowest_below(self, arrival: Req) -> Req | None:
        """The waiting request a full queue gives up for ``arrival``: the last of the lowest
        priority class (the latest to arrive there), when that priority is strictly lower than
        the arrival's. A request that has output already (retracted after its first token) is
        passed over: its client is reading it, and it has been admitted once."""
        for rank, _, req in reversed(self._entries):
            if rank <= self.order.rank(arrival):
                return None
            if not req.output_ids:
                return req
        return None


def _sort_key(entry: tuple[int, int, Req]) -> tuple[int, int]:
    return entry[0], entry[1]
