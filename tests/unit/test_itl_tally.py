"""Inter-token latency is tallied per frame and observed once per distinct gap: the
histogram must read as if every token had been observed on its own."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram

from pipeline.io_struct import SamplingParams
from tokenizer_proc.metric_buckets import ITL_BUCKETS
from tokenizer_proc.metrics import ServiceMetrics
from tokenizer_proc.req_state import ReqState


def _samples(registry: CollectorRegistry, name: str) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for m in registry.collect()
        for s in m.samples
        if s.name.startswith(name)
    }


def test_a_tallied_frame_reads_as_one_observation_per_token() -> None:
    rng = random.Random(1)
    metrics = ServiceMetrics("m")
    plain_registry = CollectorRegistry()
    plain = Histogram("itl", "", buckets=ITL_BUCKETS, registry=plain_registry)
    state = ReqState(rid="r", req_id=1, stream=True, sampling=SamplingParams(), created_time=0.0)
    now = 1.0
    for _ in range(50):
        previous, now = now, now + rng.choice([0.0004, 0.003, 0.003, 0.07, 5.0])
        for _ in range(rng.randrange(1, 8)):  # rows of the frame
            tokens = rng.choice([1, 1, 1, 2, 5])
            metrics.requests.on_tokens(state, tokens, previous, now)
            for _ in range(tokens):
                plain.observe((now - previous) / tokens)
        metrics.requests.end_frame()
    got = _samples(metrics.registry, "tokenpipe:inter_token_latency_seconds")
    want = _samples(plain_registry, "itl")
    assert {le: v for (n, le), v in got.items() if n.endswith("_bucket")} == {
        le: v for (n, le), v in want.items() if n.endswith("_bucket")
    }
    assert got[("tokenpipe:inter_token_latency_seconds_count", "")] == want[("itl_count", "")]
    assert got[("tokenpipe:inter_token_latency_seconds_sum", "")] == pytest.approx(
        want[("itl_sum", "")], rel=1e-12
    )
