"""Each scheduler owns the set of its requests whose next row carries stats: two schedulers
in one process (as the PD tests drive them) never see each other's requests."""

from __future__ import annotations

from pipeline.io_struct import BatchTokenIDOutput
from tests.unit.test_scheduler_steps import PROMPT, make, submit


def test_a_request_pending_on_one_scheduler_is_not_pending_on_another() -> None:
    a, b = make(chunk=64), make(chunk=64)
    submit(a, 1, PROMPT[:40], max_new=8)
    first = a.step()  # prefill and first token: that row carries stats and leaves the set
    assert (
        len(first) == 1
        and isinstance(first[0], BatchTokenIDOutput)
        and first[0].request_stats is not None
    )
    assert not a.stats_pending

    submit(b, 2, PROMPT[:40], max_new=8)
    assert set(b.stats_pending) == {b.live[2]}
    assert not a.stats_pending, "a request of another scheduler is pending on this one"

    # a's next row is steady (columns, no stats), whatever b holds pending.
    steady = a.step()
    assert len(steady) == 1 and isinstance(steady[0], BatchTokenIDOutput)
    assert steady[0].request_stats is None and steady[0].finished_reasons is None
    # b's first row still carries its stats: a's step took nothing from b's set.
    assert set(b.stats_pending) == {b.live[2]}
    row = b.step()
    assert (
        len(row) == 1
        and isinstance(row[0], BatchTokenIDOutput)
        and row[0].request_stats is not None
    )
    assert not b.stats_pending and set(a.stats_pending) <= set(a.live.values())
