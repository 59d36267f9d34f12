"""What /metrics and the span say of adapters (tokenizer_proc/lora_metrics.py, tracing.py):
vLLM's ``lora_requests_info`` as vLLM sets it, ``tokenpipe:lora_requests_total`` by adapter,
nothing of either without LoRA, and the span's requested model and adapter name."""

from __future__ import annotations

import time

import pytest

from pipeline.config import MetricsCompat
from pipeline.io_struct import FinishStop, LoraRef, SchedulerStatsReport
from tests.unit.test_metrics_compat import finished, report
from tokenizer_proc.metrics import ServiceMetrics
from tokenizer_proc.tracing import span_attributes

OWN_LABELS = {"model_name": "m", "engine_type": "unified"}


def lora_report(running: tuple[str, ...], waiting: tuple[str, ...]) -> SchedulerStatsReport:
    base = report(instance=1, steps=1, tokens=1)
    base.max_loras = 2
    base.running_lora_adapters = running
    base.waiting_lora_adapters = waiting
    return base


@pytest.mark.parametrize(
    ("compat", "name", "base_labels"),
    [
        ("vllm", "vllm:lora_requests_info", {}),
        ("tokenpipe", "tokenpipe:lora_requests_info", OWN_LABELS),
    ],
)
def test_lora_requests_info_is_the_time_of_its_labels_last_report(
    compat: MetricsCompat, name: str, base_labels: dict[str, str]
) -> None:
    metrics = ServiceMetrics("m", compat=compat, context_length=100, lora=True)
    before = time.time()
    metrics.lora.on_report(lora_report(("sql",), ("chat", "sql")))
    first = {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": "chat,sql"}
    got = metrics.registry.get_sample_value(name, {**base_labels, **first})
    assert got is not None and before <= got <= time.time()
    metrics.lora.on_report(lora_report((), ()))
    idle = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    latest = metrics.registry.get_sample_value(name, {**base_labels, **idle})
    # vLLM keeps every label set: the current one is the latest.
    assert latest is not None and latest >= got
    assert metrics.registry.get_sample_value(name, {**base_labels, **first}) == got


def test_finished_adapter_requests_are_counted_by_adapter() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=100, lora=True)
    for i, lora in enumerate([LoraRef("sql", 1), LoraRef("sql", 1), None, LoraRef("chat", 2)]):
        state = finished(i, stream=False, reason=FinishStop(matched=2))
        state.lora = lora
        metrics.lora.on_finish(state)
    count = metrics.registry.get_sample_value
    assert count("tokenpipe:lora_requests_total", {**OWN_LABELS, "lora_name": "sql"}) == 2
    assert count("tokenpipe:lora_requests_total", {**OWN_LABELS, "lora_name": "chat"}) == 1
    assert count("tokenpipe:lora_requests_total", {**OWN_LABELS, "lora_name": "m"}) is None


def test_without_lora_no_lora_series() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=100)
    metrics.lora.on_report(lora_report(("sql",), ()))
    names = {family.name for family in metrics.registry.collect()}
    assert not {name for name in names if "lora" in name}


def test_span_names_the_requested_adapter() -> None:
    state = finished(1, stream=False, reason=FinishStop(matched=2))
    base = span_attributes(state, "m")
    assert base["gen_ai.request.model"] == "m" and "tokenpipe.lora_name" not in base
    state.lora = LoraRef("sql", 1)
    attrs = span_attributes(state, "m")
    assert attrs["gen_ai.request.model"] == "sql" and attrs["tokenpipe.lora_name"] == "sql"
