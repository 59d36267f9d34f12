"""The LoRA series on ``/metrics`` (docs/design/metrics.md), kept only when the server serves
adapters: vLLM's ``lora_requests_info`` from the scheduler's reports (``vllm:`` under
``--metrics-compat vllm``, ``tokenpipe:`` with the model labels otherwise), and
``tokenpipe:lora_requests_total{lora_name}``, the finished requests that ran with each
adapter (a base-model request is not counted: ``num_requests`` counts every request).

``lora_requests_info`` is vLLM's: its labels are the slots (``max_lora``) and the names of
the adapters of the running and of the waiting requests, comma-joined, and its value the
time (seconds since the epoch) the last report with those labels arrived. A set of labels
is never removed, as in vLLM: the current one is the sample with the latest time."""

from __future__ import annotations

from pipeline.io_struct import SchedulerStatsReport
from tokenizer_proc.metrics_compat import Naming
from tokenizer_proc.req_state import ReqState

INFO_LABELS = ("max_lora", "waiting_lora_adapters", "running_lora_adapters")


class LoraMetrics:
    def __init__(self, naming: Naming) -> None:
        self._requests = naming.counter(
            "lora_requests",
            "Finished requests that ran with an adapter, by adapter.",
            ("lora_name",),
        )
        self._info = naming.gauge(
            "lora_requests_info", "Running stats on lora requests.", INFO_LABELS
        )

    def on_report(self, report: SchedulerStatsReport) -> None:
        self._info(
            str(report.max_loras),
            ",".join(report.waiting_lora_adapters),
            ",".join(report.running_lora_adapters),
        ).set_to_current_time()

    def on_finish(self, state: ReqState) -> None:
        if state.lora is not None:
            self._requests(state.lora.name).inc()


class NoLoraMetrics:
    """The LoRA series of a server without adapters, or with metrics off: nothing."""

    def on_report(self, report: SchedulerStatsReport) -> None:
        pass

    def on_finish(self, state: ReqState) -> None:
        pass
