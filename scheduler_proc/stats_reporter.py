"""Turns the scheduler's running counters into a ``SchedulerStatsReport`` now and then:
gauges are windowed over the time since the previous report."""

from __future__ import annotations

import random

from pipeline.io_struct import SchedulerStatsReport
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.req import Req
from scheduler_proc.scheduler import Scheduler

REPORT_INTERVAL = 0.5
# While idle, a report this often all the same: an API process that starts (or restarts)
# while the scheduler has no work learns within this long that the pipeline is up; until its
# first report, /health answers 503.
IDLE_REPORT_INTERVAL = 2.0


class SchedulerStatsReporter:
    def __init__(
        self,
        scheduler: Scheduler,
        interval: float = REPORT_INTERVAL,
        idle_interval: float = IDLE_REPORT_INTERVAL,
    ) -> None:
        self._s = scheduler
        self._interval = interval
        self._idle_interval = idle_interval
        self._last_time = 0.0
        self._last_generated = 0
        self._last_prompt = 0
        self._last_cached = 0
        self._last_retracted = 0
        self._last_steps = 0
        self._cache_hit_rate = 0.0
        self._reported_idle = False  # so a fresh scheduler announces itself at once
        self._instance = random.getrandbits(62)

    def maybe_report(self, now: float) -> SchedulerStatsReport | None:
        """A report every ``interval`` seconds while busy, and one when work runs out, so
        the gauges fall back to zero instead of freezing at their last busy value. Work that
        came and went within one interval of an idle report gets its idle report too, or
        ``forward_steps_total`` would stay behind for good. While idle, one every
        ``idle_interval`` seconds (``IDLE_REPORT_INTERVAL``)."""
        idle = not self._s.has_work()
        if (
            idle
            and self._reported_idle
            and self._s.forward_steps == self._last_steps
            and now - self._last_time < self._idle_interval
        ):
            return None
        if not idle and now - self._last_time < self._interval:
            return None
        self._reported_idle = idle
        return self.report(now)

    def report(self, now: float) -> SchedulerStatsReport:
        s = self._s
        hicache = s.hicache
        spec = s.mode.spec_counters
        elapsed = now - self._last_time if self._last_time else 0.0
        generated = s.generated_tokens_total - self._last_generated
        prompt = s.prefill_tokens_total - self._last_prompt
        cached = s.cached_tokens_total - self._last_cached
        if prompt > 0:
            self._cache_hit_rate = cached / prompt
        # The tokens of vLLM's iteration_tokens_total: each prompt whole (its cached tokens
        # too, as vLLM counts a prompt's tokens in the step its prefill ends), and every
        # generated token. Prompt tokens count at their first admission, so a chunked
        # prefill's tokens land in the report of the step that admitted it; retraction
        # recomputes are not counted.
        forward_tokens = s.prefill_tokens_total + s.generated_tokens_total
        report = SchedulerStatsReport(
            num_running_reqs=s.num_running,
            num_queue_reqs=s.num_waiting,
            token_usage=s.kv_tokens_held_by_requests / s.kv.capacity,
            cache_hit_rate=self._cache_hit_rate,
            gen_throughput=generated / elapsed if elapsed > 0 else 0.0,
            num_retracted_reqs=s.num_retracted_total - self._last_retracted,
            num_retracted_requests_total=s.num_retracted_total,
            kv_used_tokens=s.kv.num_used,
            kv_capacity=s.kv.capacity,
            cached_tokens_in_tree=s.cache.total_size,
            forward_steps_total=s.forward_steps,
            live_reqs=len(s.live),
            instance=self._instance,
            hicache_host_used_tokens=hicache.host_used_tokens,
            hicache_host_capacity=hicache.host_capacity,
            hicache_storage_backend=s.prefix_kv.storage_backend,
            forward_tokens_total=forward_tokens,
            torch_threads=s.runner.threads.count,
            num_grammar_queue_reqs=len(s.grammars),
            decode_sum_seq_lens=_sum_seq_lens(s.running),
            paused=s.rollout.paused,
            weight_version=s.rollout.weight_version,
            paused_seconds_total=s.rollout.paused_seconds_total(),
            weight_updates_ok=s.rollout.counters.updates_ok,
            weight_updates_failed=s.rollout.counters.updates_failed,
            weight_update_seconds=s.rollout.counters.take_update_seconds(),
            **s.loras.report_fields(s.running, s.prefilling, s.waiting),
            # Speculative decoding's running totals (k 0 and zeros when off)
            spec_num_speculative_tokens=spec.k,
            spec_num_drafts=spec.num_drafts,
            spec_num_draft_tokens=spec.num_draft_tokens,
            spec_num_accepted_tokens=spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(int(n) for n in spec.accepted_per_pos),
        )
        self._last_time = now
        self._last_generated = s.generated_tokens_total
        self._last_prompt = s.prefill_tokens_total
        self._last_cached = s.cached_tokens_total
        self._last_retracted = s.num_retracted_total
        self._last_steps = s.forward_steps
        return report


def _sum_seq_lens(running: RunningBatch | list[Req]) -> int:
    """Prompt plus generated tokens of the running requests: one column sum for a batch."""
    if isinstance(running, RunningBatch):
        return int(running.seq_len[: len(running)].sum())
    return sum(req.seq_len for req in running)
