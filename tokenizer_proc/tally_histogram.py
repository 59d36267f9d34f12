"""A Prometheus histogram that takes one value many times in one update."""

from __future__ import annotations

from prometheus_client import Histogram


class TallyHistogram(Histogram):
    """A Histogram that takes one value many times in one update of its sum and bucket:
    Prometheus's ``observe`` takes one at a time, under a lock each, and a frame brings one
    inter-token gap per row, most of them the same (every row of one decode step)."""

    def observe_many(self, amount: float, count: int) -> None:
        """``observe(amount)`` ``count`` times over; the bucket as ``observe`` picks it."""
        self._raise_if_not_observable()
        self._sum.inc(amount * count)
        for i, bound in enumerate(self._upper_bounds):
            if amount <= bound:
                self._buckets[i].inc(count)
                break
