"""What the API reports of a structured-output request, built from its ``ReqState`` alone
(docs/design.md sections 7 and 8): ``tokenpipe:constrained_requests_total{kind}`` once per
finished constrained request, ``tokenpipe:grammar_compile_wait_seconds`` from the scheduler's
``grammar_wait``, and the span's ``tokenpipe.constraint.kind`` and ``tokenpipe.grammar_wait``."""

from __future__ import annotations

from pipeline.io_struct import (
    CONSTRAINT_KINDS,
    FinishStop,
    RequestOutputStats,
    SamplingParams,
    SchedulerTimeStats,
)
from tokenizer_proc.metrics import ServiceMetrics
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tracing import span_attributes

T0 = 1_800_000_000.0


def _finished(kind: str | None, grammar_wait: float, *, metrics_on: bool = True) -> ReqState:
    time_stats = (
        SchedulerTimeStats(
            forward_entry_time=T0 + 0.01, completion_time=T0 + 0.05, grammar_wait=grammar_wait
        )
        if metrics_on
        else None
    )
    return ReqState(
        rid="r",
        req_id=1,
        stream=False,
        sampling=SamplingParams(max_new_tokens=8),
        created_time=T0,
        constraint_kind=kind,
        request_stats=RequestOutputStats(prompt_tokens=4, time_stats=time_stats),
        finished_reason=FinishStop(matched=0),
        completion_tokens=3,
        finished_time=T0 + 0.06,
    )


def _value(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(
        name, {"model_name": "m", "engine_type": "unified", **labels}
    )
    assert value is not None, name
    return value


def test_each_finished_constrained_request_is_counted_once_by_kind_with_its_grammar_wait() -> None:
    metrics = ServiceMetrics("m")
    finished = [
        ("json_schema", 0.25),
        ("json_schema", 0.0),
        ("regex", 0.004),
        ("choice", 0.0),
        (None, 0.0),
    ]
    for kind, wait in finished:
        metrics.requests.on_finish(_finished(kind, wait))
    counts = {
        kind: _value(metrics, "tokenpipe:constrained_requests_total", kind=kind)
        for kind in CONSTRAINT_KINDS
    }
    assert counts == {"json_schema": 2, "json_object": 0, "regex": 1, "grammar": 0, "choice": 1}
    # The unconstrained request is a request, but no grammar wait.
    assert _value(metrics, "tokenpipe:num_requests_total", is_streaming="false") == 5
    assert _value(metrics, "tokenpipe:grammar_compile_wait_seconds_count") == 4
    assert _value(metrics, "tokenpipe:grammar_compile_wait_seconds_sum") == 0.25 + 0.004
    assert (
        _value(metrics, "tokenpipe:grammar_compile_wait_seconds_bucket", le="0.0001") == 2
    )  # the two cache hits
    assert _value(metrics, "tokenpipe:grammar_compile_wait_seconds_bucket", le="0.005") == 3


def test_with_metrics_off_a_constrained_request_is_counted_without_a_wait() -> None:
    metrics = ServiceMetrics("m")
    metrics.requests.on_finish(_finished("grammar", 0.0, metrics_on=False))
    assert _value(metrics, "tokenpipe:constrained_requests_total", kind="grammar") == 1
    assert _value(metrics, "tokenpipe:grammar_compile_wait_seconds_count") == 0


def test_a_constrained_span_carries_its_kind_and_grammar_wait() -> None:
    attrs = span_attributes(_finished("json_object", 0.125), "m", "chat")
    assert attrs["tokenpipe.constraint.kind"] == "json_object"
    assert attrs["tokenpipe.grammar_wait"] == 0.125
    # Without the scheduler's time stats there is no wait to report, but the kind is known.
    off = span_attributes(_finished("regex", 0.0, metrics_on=False), "m")
    assert off["tokenpipe.constraint.kind"] == "regex" and "tokenpipe.grammar_wait" not in off


def test_an_unconstrained_span_has_no_constraint_keys() -> None:
    attrs = span_attributes(_finished(None, 0.0), "m")
    assert not [key for key in attrs if "constraint" in key or "grammar" in key]
