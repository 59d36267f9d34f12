"""The rollout series on ``/metrics``, set from the scheduler's reports like its gauges:
whether generation is paused, the seconds it has been, and the weight updates by result with
their durations (tokenpipe's names: neither peer exports these); under ``--metrics-compat
sglang`` also SGLang's ``num_paused_reqs``."""

from __future__ import annotations

from prometheus_client import Histogram

from pipeline.io_struct import SchedulerStatsReport
from tokenizer_proc.metrics_compat import Naming, one_child

# Seconds from an update's control to its swap: a small checkpoint reads in well under a
# second on a CPU; a large one, or one that waits for running requests, in minutes.
WEIGHT_UPDATE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RolloutMetrics:
    def __init__(self, naming: Naming) -> None:
        self.paused = naming.gauge(
            "generation_paused", "1 while generation is paused (/pause_generation, /pause)."
        )()
        self._paused_seconds = naming.counter(
            "paused_seconds", "Seconds no step ran because generation was paused."
        )()
        updates = naming.counter(
            "weight_updates", "Weight updates from disk, by result (ok, failed).", ("result",)
        )
        self._updates = {result: updates(result) for result in ("ok", "failed")}
        self._duration = naming.histogram(
            "weight_update_duration_seconds",
            "Seconds from a weight update's control to its swap (or its failure).",
            WEIGHT_UPDATE_BUCKETS,
            Histogram,
        )()
        # SGLang's: the requests held by a pause (its weight sync), 0 while running.
        self._paused_reqs = one_child(
            naming.peer_gauge("num_paused_reqs", "Requests held while generation is paused.")
        )
        self._seen: SchedulerStatsReport | None = None  # the previous report

    def update(self, report: SchedulerStatsReport) -> None:
        """The report's running totals move the counters by their difference (from zero
        again for a restarted scheduler, a new instance)."""
        seen = self._seen
        if seen is not None and seen.instance != report.instance:
            seen = None
        self.paused.set(1 if report.paused is not None else 0)
        self._paused_reqs.set(report.live_reqs if report.paused is not None else 0)
        self._paused_seconds.inc(
            max(0.0, report.paused_seconds_total - (seen.paused_seconds_total if seen else 0.0))
        )
        for result, total, before in (
            ("ok", report.weight_updates_ok, seen.weight_updates_ok if seen else 0),
            ("failed", report.weight_updates_failed, seen.weight_updates_failed if seen else 0),
        ):
            if total > before:
                self._updates[result].inc(total - before)
        for seconds in report.weight_update_seconds:
            self._duration.observe(seconds)
        self._seen = report
