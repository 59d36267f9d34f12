"""Speculative decoding's series on ``/metrics``, kept only on a server that speculates (k > 0),
from the running totals in the scheduler's reports: drafts (a request's drafts in one verify
pass count once), draft tokens, accepted tokens, and accepted tokens by draft position (0: the
first draft), counted as vLLM counts its spec_decode series (``vllm:`` names and labels under
``--metrics-compat vllm``, ``tokenpipe:`` otherwise). Under ``--metrics-compat sglang`` also
SGLang's ``spec_accept_length`` and ``spec_accept_rate`` gauges over each report's interval."""

from __future__ import annotations

from pipeline.io_struct import SchedulerStatsReport
from tokenizer_proc.metrics_compat import Naming, one_child


class SpecMetrics:
    def __init__(self, naming: Naming, num_speculative_tokens: int) -> None:
        self._drafts = naming.counter("spec_decode_num_drafts", "Number of spec decoding drafts.")()
        self._draft_tokens = naming.counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens."
        )()
        self._accepted = naming.counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens."
        )()
        per_pos = naming.counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            ("position",),
        )
        # One child per position from the start, as vLLM makes them: a dashboard's rate per
        # position reads 0, not nothing, before a draft reaches it.
        self._per_pos = [per_pos(str(pos)) for pos in range(num_speculative_tokens)]
        self._accept_length = one_child(
            naming.peer_gauge(
                "spec_accept_length",
                "Mean acceptance length of speculative decoding: accepted drafts plus the "
                "target's own token per verify pass of a request, over the last report interval.",
            )
        )
        self._accept_rate = one_child(
            naming.peer_gauge(
                "spec_accept_rate",
                "Speculative acceptance rate: accepted drafts over drafted tokens, over the last "
                "report interval.",
            )
        )
        # The running totals of the previous report, and its scheduler's instance.
        self._instance: int | None = None
        self._seen: tuple[int, int, int] = (0, 0, 0)
        self._seen_per_pos: tuple[int, ...] = ()

    def on_report(self, report: SchedulerStatsReport) -> None:
        """The report's running totals move the counters by their difference (from zero again
        for a restarted scheduler, a new instance)."""
        if report.instance != self._instance:
            self._seen, self._seen_per_pos = (0, 0, 0), ()
        totals = (
            report.spec_num_drafts,
            report.spec_num_draft_tokens,
            report.spec_num_accepted_tokens,
        )
        drafts, draft_tokens, accepted = (now - then for now, then in zip(totals, self._seen))
        for counter, n in (
            (self._drafts, drafts),
            (self._draft_tokens, draft_tokens),
            (self._accepted, accepted),
        ):
            if n > 0:
                counter.inc(n)
        now, before = report.spec_accepted_per_pos, self._seen_per_pos
        for pos, counter in enumerate(self._per_pos):
            n = (now[pos] if pos < len(now) else 0) - (before[pos] if pos < len(before) else 0)
            if n > 0:
                counter.inc(n)
        if drafts > 0 and draft_tokens > 0:  # an interval without drafts leaves them as they were
            self._accept_length.set((accepted + drafts) / drafts)
            self._accept_rate.set(accepted / draft_tokens)
        self._instance, self._seen, self._seen_per_pos = report.instance, totals, now


class NoSpecMetrics:
    """A server that does not speculate, or has metrics off: no speculative series."""

    def on_report(self, report: SchedulerStatsReport) -> None:
        pass
