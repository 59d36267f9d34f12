"""Speculative decoding's series (tokenizer_proc/spec_metrics.py): vLLM's four spec_decode
counters with its names, labels and position label under ``--metrics-compat vllm``, the same
under ``tokenpipe:`` names otherwise, SGLang's accept length and rate gauges under
``--metrics-compat sglang``; moved by the differences of the reports' running totals (afresh
after a scheduler restart), and absent on a server that does not speculate."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from pipeline.config import MetricsCompat, ServerConfig
from pipeline.io_struct import SchedulerStatsReport
from tests.unit.test_metrics_compat import (
    OWN_LABELS,
    SGLANG_SCHEDULER_LABELS,
    VLLM_LABELS,
    names,
    report,
    value,
)
from tokenizer_proc.metrics import ServiceMetrics, service_metrics

VLLM = "vllm:spec_decode_num_"
OWN = "tokenpipe:spec_decode_num_"


def spec_report(
    instance: int, drafts: int, draft_tokens: int, accepted: int, per_pos: tuple[int, ...]
) -> SchedulerStatsReport:
    return replace(
        report(instance=instance, steps=1, tokens=1),
        spec_num_speculative_tokens=3,
        spec_num_drafts=drafts,
        spec_num_draft_tokens=draft_tokens,
        spec_num_accepted_tokens=accepted,
        spec_accepted_per_pos=per_pos,
    )


def test_vllm_names_labels_and_positions() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=100, num_speculative_tokens=3)
    # Every position's child from the start, at 0, as vLLM makes them.
    for pos in ("0", "1", "2"):
        assert (
            value(metrics, VLLM + "accepted_tokens_per_pos_total", VLLM_LABELS, position=pos) == 0
        )
    metrics.scheduler.update(
        spec_report(1, drafts=4, draft_tokens=10, accepted=6, per_pos=(3, 2, 1))
    )
    metrics.scheduler.update(
        spec_report(1, drafts=6, draft_tokens=15, accepted=8, per_pos=(4, 3, 1))
    )
    assert value(metrics, VLLM + "drafts_total", VLLM_LABELS) == 6
    assert value(metrics, VLLM + "draft_tokens_total", VLLM_LABELS) == 15
    assert value(metrics, VLLM + "accepted_tokens_total", VLLM_LABELS) == 8
    per_pos = [
        value(metrics, VLLM + "accepted_tokens_per_pos_total", VLLM_LABELS, position=str(pos))
        for pos in range(3)
    ]
    assert per_pos == [4, 3, 1]
    assert sum(per_pos) == value(metrics, VLLM + "accepted_tokens_total", VLLM_LABELS)
    served = names(metrics)
    assert not {name for name in served if name.startswith("tokenpipe:spec")}
    assert not {name for name in served if name.startswith("sglang:")}


def test_a_restarted_scheduler_counts_from_zero_again() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=100, num_speculative_tokens=3)
    metrics.scheduler.update(
        spec_report(1, drafts=4, draft_tokens=10, accepted=6, per_pos=(3, 2, 1))
    )
    metrics.scheduler.update(
        spec_report(2, drafts=1, draft_tokens=3, accepted=1, per_pos=(1, 0, 0))
    )
    assert value(metrics, VLLM + "drafts_total", VLLM_LABELS) == 5
    assert value(metrics, VLLM + "accepted_tokens_total", VLLM_LABELS) == 7
    assert value(metrics, VLLM + "accepted_tokens_per_pos_total", VLLM_LABELS, position="0") == 4


def test_tokenpipe_names_keep_the_model_labels() -> None:
    metrics = ServiceMetrics("m", context_length=100, num_speculative_tokens=3)
    metrics.scheduler.update(
        spec_report(1, drafts=2, draft_tokens=6, accepted=3, per_pos=(2, 1, 0))
    )
    assert value(metrics, OWN + "drafts_total", OWN_LABELS) == 2
    assert value(metrics, OWN + "draft_tokens_total", OWN_LABELS) == 6
    assert value(metrics, OWN + "accepted_tokens_total", OWN_LABELS) == 3
    assert value(metrics, OWN + "accepted_tokens_per_pos_total", OWN_LABELS, position="1") == 1
    assert not {name for name in names(metrics) if name.startswith(("vllm:", "sglang:"))}


def test_sglang_accept_length_and_rate_over_each_interval() -> None:
    metrics = ServiceMetrics("m", compat="sglang", context_length=100, num_speculative_tokens=3)
    # 4 verify passes with drafts, 10 drafted tokens, 6 accepted: 10 tokens in 4 passes.
    metrics.scheduler.update(
        spec_report(1, drafts=4, draft_tokens=10, accepted=6, per_pos=(3, 2, 1))
    )
    length = "sglang:spec_accept_length"
    rate = "sglang:spec_accept_rate"
    assert value(metrics, length, SGLANG_SCHEDULER_LABELS) == pytest.approx(10 / 4)
    assert value(metrics, rate, SGLANG_SCHEDULER_LABELS) == pytest.approx(6 / 10)
    # The next interval alone: 2 passes, 6 drafted, 0 accepted.
    metrics.scheduler.update(
        spec_report(1, drafts=6, draft_tokens=16, accepted=6, per_pos=(3, 2, 1))
    )
    assert value(metrics, length, SGLANG_SCHEDULER_LABELS) == 1.0
    assert value(metrics, rate, SGLANG_SCHEDULER_LABELS) == 0.0
    # An interval without drafts leaves them as they were.
    metrics.scheduler.update(
        spec_report(1, drafts=6, draft_tokens=16, accepted=6, per_pos=(3, 2, 1))
    )
    assert value(metrics, length, SGLANG_SCHEDULER_LABELS) == 1.0
    # SGLang has no counters of these: tokenpipe's names.
    assert value(metrics, OWN + "drafts_total", OWN_LABELS) == 6


@pytest.mark.parametrize("compat", ["tokenpipe", "sglang", "vllm"])
def test_no_speculative_series_without_speculation(compat: MetricsCompat) -> None:
    metrics = service_metrics(ServerConfig(metrics_compat=compat), "m", context_length=100)
    assert isinstance(metrics, ServiceMetrics)
    metrics.scheduler.update(report(instance=1, steps=1, tokens=1))
    assert not {name for name in names(metrics) if "spec_" in name}


def test_a_speculating_server_serves_them_with_its_k() -> None:
    config = ServerConfig(
        metrics_compat="vllm", speculative_config='{"method": "ngram", "num_speculative_tokens": 2}'
    )
    metrics = service_metrics(config, "m", context_length=100)
    assert isinstance(metrics, ServiceMetrics)
    positions = {
        sample.labels["position"]
        for family in metrics.registry.collect()
        if family.name == VLLM + "accepted_tokens_per_pos"
        for sample in family.samples
    }
    assert positions == {"0", "1"}
