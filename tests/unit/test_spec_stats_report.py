"""Speculative decoding's running totals in the scheduler's stats report: the counters the
decode mode keeps (``SpecCounters``), reported as they stand, and k 0 with zeros on a
server that does not speculate (a real scheduler, in-process)."""

from __future__ import annotations

import time

import numpy as np

from pipeline.config import ServerConfig
from scheduler_proc.main import build_scheduler
from scheduler_proc.stats_reporter import SchedulerStatsReporter


def test_a_server_without_speculation_reports_k_0_and_zeros() -> None:
    scheduler = build_scheduler(ServerConfig(max_total_tokens=4096, torch_threads=1))
    report = SchedulerStatsReporter(scheduler).report(time.time())
    assert report.spec_num_speculative_tokens == 0
    assert (report.spec_num_drafts, report.spec_num_draft_tokens) == (0, 0)
    assert report.spec_num_accepted_tokens == 0 and report.spec_accepted_per_pos == ()


def test_the_report_carries_the_running_totals_by_position() -> None:
    config = ServerConfig(
        max_total_tokens=4096,
        torch_threads=1,
        speculative_algorithm="NGRAM",
        speculative_num_draft_tokens=4,  # SGLang's count: 3 drafts and the verified token
    )
    scheduler = build_scheduler(config)
    reporter = SchedulerStatsReporter(scheduler)
    first = reporter.report(time.time())
    assert first.spec_num_speculative_tokens == 3
    assert first.spec_accepted_per_pos == (0, 0, 0)
    counters = scheduler.mode.spec_counters
    # Two verify passes: rows drafting 3, 2 and 0 tokens accept 3, 1 and 0; then one row
    # drafts 3 and accepts 2.
    counters.add(np.array([3, 2, 0]), np.array([3, 1, 0]))
    counters.add(np.array([3]), np.array([2]))
    report = reporter.report(time.time())
    assert report.spec_num_drafts == 3  # a row's drafts in one pass count once
    assert report.spec_num_draft_tokens == 8
    assert report.spec_num_accepted_tokens == 6
    assert report.spec_accepted_per_pos == (3, 2, 1)
    # Totals since the start, not since the previous report.
    again = reporter.report(time.time())
    assert again.spec_num_accepted_tokens == 6 and again.spec_accepted_per_pos == (3, 2, 1)
