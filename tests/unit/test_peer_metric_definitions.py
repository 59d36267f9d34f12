"""Each peer series under the peer's own definition (issue 47, group 5; the table in
docs/operations.md): the numbers a vLLM or SGLang dashboard reads are computed as the peer
computes them, from the scheduler's reports and each finished request's stats."""

from __future__ import annotations

from msgspec.structs import replace

from pipeline.io_struct import FinishStop, SamplingParams
from tests.unit.test_metrics_compat import (
    OWN_LABELS,
    SGLANG_SCHEDULER_LABELS,
    VLLM_LABELS,
    finished,
    report,
    value,
)
from tokenizer_proc.metrics import ServiceMetrics
from tokenizer_proc.req_state import ChoiceGroup

STOP = FinishStop(matched=2)


def test_vllm_splits_the_waiting_requests_by_reason() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000)
    waiting = replace(report(instance=1, steps=1, tokens=1), num_queue_reqs=5)
    metrics.scheduler.update(replace(waiting, num_grammar_queue_reqs=2))
    by_reason = "vllm:num_requests_waiting_by_reason"
    assert value(metrics, "vllm:num_requests_waiting", VLLM_LABELS) == 5  # grammar waits too
    assert value(metrics, by_reason, VLLM_LABELS, reason="capacity") == 3
    assert value(metrics, by_reason, VLLM_LABELS, reason="deferred") == 2  # a grammar compiles


def test_vllm_cache_config_info_carries_the_pool_and_the_dtype() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000, kv_dtype="bfloat16")
    info = {"engine": "0", "block_size": "1", "cache_dtype": "bfloat16"}
    info["enable_prefix_caching"] = "True"
    metrics.scheduler.update(report(instance=1, steps=1, tokens=1))  # a pool of 1000 tokens
    assert value(metrics, "vllm:cache_config_info", info, num_gpu_blocks="1000") == 1
    # A restarted scheduler with another pool: the info names the new one only.
    metrics.scheduler.update(replace(report(instance=2, steps=1, tokens=1), kv_capacity=500))
    assert value(metrics, "vllm:cache_config_info", info, num_gpu_blocks="500") == 1
    gone = metrics.registry.get_sample_value(
        "vllm:cache_config_info", {**info, "num_gpu_blocks": "1000"}
    )
    assert gone is None


def test_vllm_prompt_tokens_by_source_keep_vllms_identities() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000)
    metrics.requests.on_finish(finished(1, stream=False, reason=STOP, prompt=10, cached=4))
    # All but the last prompt token from the cache: vLLM counts that last one "recomputed".
    metrics.requests.on_finish(finished(2, stream=False, reason=STOP, prompt=10, cached=9))
    source = "vllm:prompt_tokens_by_source_total"
    compute = value(metrics, source, VLLM_LABELS, source="local_compute")
    hit = value(metrics, source, VLLM_LABELS, source="local_cache_hit")
    external = value(metrics, source, VLLM_LABELS, source="external_kv_transfer")
    cached = value(metrics, "vllm:prompt_tokens_cached_total", VLLM_LABELS)
    recomputed = value(metrics, "vllm:prompt_tokens_recomputed_total", VLLM_LABELS)
    assert (compute, hit, external, cached, recomputed) == (7, 14, 0, 13, 1)
    total = value(metrics, "vllm:prompt_tokens_total", VLLM_LABELS)
    assert compute + hit + external - recomputed == total == 20
    assert hit + external - recomputed == cached
    # The KV computed in each prefill: prompt less cached tokens, per request.
    computed = "vllm:request_prefill_kv_computed_tokens"
    assert value(metrics, f"{computed}_sum", VLLM_LABELS) == 7
    assert value(metrics, f"{computed}_count", VLLM_LABELS) == 2


def test_vllm_observes_max_tokens_per_choice_and_n_per_request() -> None:
    metrics = ServiceMetrics("m", compat="vllm", context_length=1000)
    group = ChoiceGroup(n=3, unfinished=3)
    for i, out in enumerate((5, 2, 4)):
        state = finished(i, stream=False, reason=STOP, out=out)
        state.sampling = SamplingParams(max_new_tokens=8)
        state.choices = group
        metrics.requests.on_finish(state)
    assert value(metrics, "vllm:request_params_max_tokens_count", VLLM_LABELS) == 3
    assert value(metrics, "vllm:request_params_max_tokens_sum", VLLM_LABELS) == 24
    assert value(metrics, "vllm:request_params_n_sum", VLLM_LABELS) == 3
    assert value(metrics, "vllm:request_params_n_count", VLLM_LABELS) == 1
    assert value(metrics, "vllm:request_max_num_generation_tokens_sum", VLLM_LABELS) == 5


def test_sglang_keeps_the_grammar_queue_out_of_its_waiting_queue() -> None:
    metrics = ServiceMetrics("m", compat="sglang")
    waiting = replace(report(instance=1, steps=1, tokens=1), num_queue_reqs=5)
    metrics.scheduler.update(replace(waiting, num_grammar_queue_reqs=2, decode_sum_seq_lens=77))
    scheduler = SGLANG_SCHEDULER_LABELS
    assert value(metrics, "sglang:num_queue_reqs", scheduler) == 3
    assert value(metrics, "sglang:num_grammar_queue_reqs", scheduler) == 2
    assert value(metrics, "sglang:decode_sum_seq_lens", scheduler) == 77
    assert value(metrics, "sglang:num_running_reqs", scheduler) == 3
    # tokenpipe's own count, grammar waits included, keeps its own name.
    assert value(metrics, "tokenpipe:num_queue_reqs", OWN_LABELS) == 5


def test_sglang_counts_tokens_by_mode() -> None:
    metrics = ServiceMetrics("m", compat="sglang")
    metrics.requests.on_finish(finished(1, stream=True, reason=STOP, prompt=10, cached=4, out=5))
    realtime = "sglang:realtime_tokens_total"
    scheduler = SGLANG_SCHEDULER_LABELS
    assert value(metrics, realtime, scheduler, mode="prefill_compute") == 6
    assert value(metrics, realtime, scheduler, mode="prefill_cache") == 4
    assert value(metrics, realtime, scheduler, mode="decode") == 5
