"""``--metrics-compat`` (tokenizer_proc/metrics_compat.py): the same values under SGLang's or
vLLM's names, label names and buckets, the series a peer has and tokenpipe lacks made from the
same ``ReqState`` and scheduler reports, and tokenpipe's own series a peer lacks left under
their ``tokenpipe:`` names."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.io_struct import (
    FinishAbort,
    FinishLength,
    FinishStop,
    RequestOutputStats,
    SamplingParams,
    SchedulerStatsReport,
    SchedulerTimeStats,
)
from pipeline.config import MetricsCompat
from tokenizer_proc.metrics import ServiceMetrics
from tokenizer_proc.metrics_compat import FAMILIES
from tokenizer_proc.peer_buckets import SGLANG_TTFT, VLLM_TTFT, one_two_five
from tokenizer_proc.req_state import ReqState

T0 = 1_800_000_000.0
VLLM_LABELS = {"model_name": "m", "engine": "0"}
OWN_LABELS = {"model_name": "m", "engine_type": "unified"}
# SGLang's scheduler labels its series by parallel rank too.
SGLANG_SCHEDULER_LABELS = {**OWN_LABELS, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


def finished(
    req_id: int,
    *,
    stream: bool,
    reason: FinishStop | FinishLength | FinishAbort,
    prompt: int = 10,
    cached: int = 4,
    out: int = 5,
) -> ReqState:
    ts = SchedulerTimeStats(
        forward_entry_time=T0 + 0.1,
        prefill_finished_time=T0 + 0.3,
        completion_time=T0 + 0.7,
        queue_time=0.1,
    )
    return ReqState(
        rid=f"r{req_id}",
        req_id=req_id,
        stream=stream,
        sampling=SamplingParams(max_new_tokens=16),
        created_time=T0,
        request_stats=RequestOutputStats(prompt_tokens=prompt, cached_tokens=cached, time_stats=ts),
        finished_reason=reason,
        completion_tokens=out,
        first_token_time=T0 + 0.35,
        finished_time=T0 + 0.8,
    )


def report(instance: int, steps: int, tokens: int) -> SchedulerStatsReport:
    return SchedulerStatsReport(
        num_running_reqs=3, num_queue_reqs=2, token_usage=0.25, cache_hit_rate=0.5,
        gen_throughput=10.0, num_retracted_reqs=0, num_retracted_requests_total=1,
        kv_used_tokens=300, kv_capacity=1000, cached_tokens_in_tree=50, forward_steps_total=steps,
        live_reqs=5, instance=instance, forward_tokens_total=tokens,
    )  # fmt: skip


def value(metrics: ServiceMetrics, name: str, labels: dict[str, str], **extra: str) -> float:
    got = metrics.registry.get_sample_value(name, {**labels, **extra})
    assert got is not None, (name, extra)
    return got


def names(metrics: ServiceMetrics) -> set[str]:
    return {family.name for family in text_string_to_metric_families(metrics.render().decode())}


# The ecosystem's HTTP series (prometheus-fastapi-instrumentator's, as vLLM exports them), served
# under every family (tokenizer_proc/http_counters.py); family names as the parser gives them.
HTTP_SERIES = {
    "http_requests",
    "http_request_size_bytes",
    "http_response_size_bytes",
    "http_request_duration_highr_seconds",
    "http_request_duration_seconds",
}


@pytest.mark.parametrize("compat", ["tokenpipe", "sglang", "vllm"])
def test_each_family_serves_its_own_names_and_the_http_series(compat: MetricsCompat) -> None:
    served = names(ServiceMetrics("m", compat=compat, context_length=1000))
    assert HTTP_SERIES <= served
    if compat == "tokenpipe":
        assert all(name.startswith("tokenpipe:") for name in served - HTTP_SERIES)


def test_vllm_counts_requests_by_finish_reason_and_tokens_as_the_meta_info_sums() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000)
    states = [
        finished(1, stream=True, reason=FinishStop(matched=2)),
        finished(2, stream=False, reason=FinishLength(length=5), prompt=20, cached=0),
        finished(3, stream=False, reason=FinishAbort(message="gone"), out=0),
    ]
    for state in states:
        metrics.requests.on_finish(state)
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1)):
        assert (
            value(metrics, "vllm:request_success_total", VLLM_LABELS, finished_reason=reason)
            == count
        )
    assert value(metrics, "vllm:prompt_tokens_total", VLLM_LABELS) == 40
    assert value(metrics, "vllm:generation_tokens_total", VLLM_LABELS) == 10
    assert value(metrics, "vllm:prefix_cache_queries_total", VLLM_LABELS) == 40
    assert value(metrics, "vllm:prefix_cache_hits_total", VLLM_LABELS) == 8
    # A request lost before the scheduler reported on it is an abort, as tokenpipe counts it.
    metrics.requests.on_lost(finished(4, stream=False, reason=FinishAbort(message="lost")))
    assert value(metrics, "vllm:request_success_total", VLLM_LABELS, finished_reason="abort") == 2
    # Its series without a vLLM counterpart keep their own names and labels.
    assert value(metrics, "tokenpipe:num_aborted_requests_total", OWN_LABELS) == 2
    assert value(metrics, "tokenpipe:cached_tokens_total", OWN_LABELS, cache_source="total") == 8


def test_vllm_histograms_have_vllms_buckets_and_no_streaming_split() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000)
    metrics.requests.on_finish(finished(1, stream=True, reason=FinishStop(matched=2)))
    metrics.requests.on_finish(finished(2, stream=False, reason=FinishStop(matched=2)))
    # The two streaming values of tokenpipe's label add up in the one vLLM series.
    assert value(metrics, "vllm:e2e_request_latency_seconds_count", VLLM_LABELS) == 2
    assert value(metrics, "vllm:e2e_request_latency_seconds_bucket", VLLM_LABELS, le="0.3") == 0
    assert value(metrics, "vllm:e2e_request_latency_seconds_bucket", VLLM_LABELS, le="0.8") == 2
    text = metrics.render().decode()
    ttft = next(
        f
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:time_to_first_token_seconds"
    )
    ttft_bounds = [sample.labels["le"] for sample in ttft.samples if "le" in sample.labels]
    assert ttft_bounds == [str(float(b)) for b in VLLM_TTFT] + ["+Inf"]
    assert one_two_five(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert value(metrics, "vllm:request_prompt_tokens_bucket", VLLM_LABELS, le="1000.0") == 2
    assert value(metrics, "vllm:request_params_max_tokens_sum", VLLM_LABELS) == 32
    assert value(metrics, "vllm:request_params_n_count", VLLM_LABELS) == 2
    assert value(metrics, "vllm:request_max_num_generation_tokens_sum", VLLM_LABELS) == 10
    # The phases from the scheduler's times: first forward, the prefill's end, the finish.
    assert (
        abs(value(metrics, "vllm:request_prefill_time_seconds_sum", VLLM_LABELS) - 2 * 0.2) < 1e-6
    )
    assert abs(value(metrics, "vllm:request_decode_time_seconds_sum", VLLM_LABELS) - 2 * 0.4) < 1e-6
    assert (
        abs(value(metrics, "vllm:request_inference_time_seconds_sum", VLLM_LABELS) - 2 * 0.6) < 1e-6
    )
    assert abs(value(metrics, "vllm:request_queue_time_seconds_sum", VLLM_LABELS) - 2 * 0.1) < 1e-6


def test_vllm_gauges_and_tokens_per_step_come_from_the_reports() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000)
    metrics.scheduler.update(report(instance=1, steps=4, tokens=40))
    metrics.scheduler.update(report(instance=1, steps=6, tokens=50))
    assert value(metrics, "vllm:num_requests_running", VLLM_LABELS) == 3
    assert value(metrics, "vllm:num_requests_waiting", VLLM_LABELS) == 2
    assert value(metrics, "vllm:kv_cache_usage_perc", VLLM_LABELS) == 0.25
    assert value(metrics, "vllm:num_preemptions_total", VLLM_LABELS) == 1
    # Steps and tokens are exact; each step of a report counts with that report's mean.
    assert value(metrics, "vllm:iteration_tokens_total_count", VLLM_LABELS) == 6
    assert value(metrics, "vllm:iteration_tokens_total_sum", VLLM_LABELS) == 50
    assert (
        value(metrics, "vllm:iteration_tokens_total_bucket", VLLM_LABELS, le="8.0") == 2
    )  # the second report: 5 per step
    assert (
        value(metrics, "vllm:iteration_tokens_total_bucket", VLLM_LABELS, le="16.0") == 6
    )  # the first: 10 per step
    # A restarted scheduler (a new instance) counts its totals from zero.
    metrics.scheduler.update(report(instance=2, steps=1, tokens=100))
    assert value(metrics, "vllm:iteration_tokens_total_count", VLLM_LABELS) == 7
    assert value(metrics, "vllm:iteration_tokens_total_sum", VLLM_LABELS) == 150


def test_sglang_renames_tokenpipes_series_and_adds_its_own() -> None:
    metrics = ServiceMetrics("m", compat="sglang")
    metrics.scheduler.update(report(instance=1, steps=4, tokens=40))
    state = finished(1, stream=True, reason=FinishStop(matched=2))
    state.constraint_kind = "json_schema"
    metrics.requests.on_tokens(state, 1, None, T0 + 0.35)  # its first token: TTFT
    metrics.requests.on_finish(state)
    # SGLang splits no request series by streaming.
    assert value(metrics, "sglang:num_requests_total", OWN_LABELS) == 1
    assert value(metrics, "sglang:num_so_requests_total", OWN_LABELS) == 1  # whatever the kind
    scheduler = SGLANG_SCHEDULER_LABELS
    assert value(metrics, "sglang:num_used_tokens", scheduler) == 250  # token_usage x the pool
    assert value(metrics, "sglang:max_total_num_tokens", scheduler) == 1000
    assert value(metrics, "sglang:uncached_prompt_tokens_histogram_sum", OWN_LABELS) == 6
    ttft = "sglang:time_to_first_token_seconds_bucket"
    assert SGLANG_TTFT[:3] == (0.1, 0.2, 0.4)  # SGLang's buckets, not tokenpipe's finer ones
    assert value(metrics, ttft, OWN_LABELS, le="0.2") == 0
    assert value(metrics, ttft, OWN_LABELS, le="0.4") == 1
    assert (
        value(metrics, "tokenpipe:grammar_compile_wait_seconds_count", OWN_LABELS) == 1
    )  # SGLang has no such series
    assert not {name for name in names(metrics) if name.startswith("vllm:")}


def test_every_series_a_family_lists_is_served_by_it() -> None:
    # A table key that names no series of the code would be left unused, its peer name unserved.
    # (The registry lists a counter's family without _total, as the table does.)
    for compat in ("sglang", "vllm"):
        metrics = ServiceMetrics(
            "m", compat=compat, context_length=100, lora=True, num_speculative_tokens=2
        )
        served = {family.name for family in metrics.registry.collect()}
        listed = {series.name for series in FAMILIES[compat].series.values()}
        assert listed <= served, listed - served


def test_a_peer_family_works_in_multiprocess_mode(tmp_path: Path) -> None:
    # prometheus-client picks its multiprocess values at import, from the environment: a child.
    script = textwrap.dedent(
        """
        from tests.unit.test_metrics_compat import finished, report
        from pipeline.io_struct import FinishStop
        from tokenizer_proc.metrics import ServiceMetrics
        metrics = ServiceMetrics("m", compat="vllm", context_length=100, multiprocess=True)
        metrics.scheduler.update(report(instance=1, steps=4, tokens=40))
        metrics.requests.on_finish(finished(1, stream=True, reason=FinishStop(matched=2)))
        print(metrics.render().decode())
        """
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 1.0' in out
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0' in out
    assert 'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 4.0' in out


def test_the_rollout_series_follow_the_reports_and_sglang_counts_paused_requests() -> None:
    """tokenpipe's rollout series under any family, and SGLang's num_paused_reqs: the live
    requests while paused, 0 while running (tokenizer_proc/rollout_metrics.py)."""
    import msgspec

    metrics = ServiceMetrics("m", compat="sglang")
    paused = msgspec.structs.replace(
        report(instance=1, steps=4, tokens=40),
        paused="retract",
        paused_seconds_total=1.5,
        weight_updates_ok=2,
        weight_updates_failed=1,
        weight_update_seconds=(0.2, 0.3, 0.05),
    )
    metrics.scheduler.update(paused)
    assert value(metrics, "sglang:num_paused_reqs", SGLANG_SCHEDULER_LABELS) == 5
    assert value(metrics, "tokenpipe:generation_paused", OWN_LABELS) == 1
    assert value(metrics, "tokenpipe:paused_seconds_total", OWN_LABELS) == 1.5
    assert value(metrics, "tokenpipe:weight_updates_total", OWN_LABELS, result="ok") == 2
    assert value(metrics, "tokenpipe:weight_updates_total", OWN_LABELS, result="failed") == 1
    histogram = "tokenpipe:weight_update_duration_seconds"
    assert value(metrics, histogram + "_count", OWN_LABELS) == 3
    assert value(metrics, histogram + "_bucket", OWN_LABELS, le="0.1") == 1
    running = msgspec.structs.replace(
        paused, paused=None, paused_seconds_total=2.0, weight_update_seconds=()
    )
    metrics.scheduler.update(running)
    assert value(metrics, "sglang:num_paused_reqs", SGLANG_SCHEDULER_LABELS) == 0
    assert value(metrics, "tokenpipe:generation_paused", OWN_LABELS) == 0
    assert value(metrics, "tokenpipe:paused_seconds_total", OWN_LABELS) == 2.0
    assert value(metrics, "tokenpipe:weight_updates_total", OWN_LABELS, result="ok") == 2
    assert value(metrics, histogram + "_count", OWN_LABELS) == 3
