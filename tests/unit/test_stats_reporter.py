"""The scheduler's stats reports: one when work runs out, even for work that came and went
between two reports (a real scheduler, stepped in-process)."""

from __future__ import annotations

import time

from pipeline.config import ServerConfig
from pipeline.io_struct import SamplingParams, TokenizedGenerateReqInput
from scheduler_proc.main import build_scheduler
from scheduler_proc.stats_reporter import SchedulerStatsReporter


def test_work_done_within_one_interval_of_an_idle_report_is_reported() -> None:
    """Idle, reported; then a short request runs and ends before the interval is up. The
    idle moment after it must report its steps (once none came, and forward_steps_total
    stayed behind until the next work: a benchmark waited for it in vain)."""
    scheduler = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    reporter = SchedulerStatsReporter(scheduler, interval=3600.0)
    now = time.time()
    first = reporter.maybe_report(now)
    assert first is not None and first.forward_steps_total == 0
    assert reporter.maybe_report(now) is None, "idle and nothing new: no second report"

    scheduler.add_request(
        TokenizedGenerateReqInput(
            rid="r", req_id=1, input_ids=[11, 12, 13],
            sampling_params=SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True),
            stream=False, arrival_time=now,
        )
    )  # fmt: skip
    reports = []
    while scheduler.has_work():
        scheduler.step()
        reports.append(reporter.maybe_report(now))  # busy within the interval: none
    reports.append(reporter.maybe_report(now))
    sent = [r for r in reports if r is not None]
    assert len(sent) == 1, "exactly one: the idle moment after the work"
    assert sent[0].forward_steps_total == scheduler.forward_steps > 0 and sent[0].live_reqs == 0
    assert reporter.maybe_report(now) is None


def test_an_idle_scheduler_reports_every_idle_interval() -> None:
    """A heartbeat while idle: an API process that starts after the scheduler went idle
    hears from it within the interval (its /health answers 503 until then)."""
    scheduler = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    reporter = SchedulerStatsReporter(scheduler, interval=0.5, idle_interval=2.0)
    now = time.time()
    assert reporter.maybe_report(now) is not None, "a fresh scheduler reports at once"
    assert reporter.maybe_report(now + 1.9) is None
    beat = reporter.maybe_report(now + 2.0)
    assert beat is not None and beat.live_reqs == 0
    assert reporter.maybe_report(now + 3.0) is None
    assert reporter.maybe_report(now + 4.0) is not None
