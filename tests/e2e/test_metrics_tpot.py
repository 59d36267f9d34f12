"""``tokenpipe:request_time_per_output_token_seconds`` is the scheduler's decode time per
token after the first, the interval meta_info's ``decode_throughput`` is measured over, for
streaming and non-streaming requests alike (a non-streaming request's only row is its last,
so the API's own token times cannot measure it). Against a real ``tokenpipe serve``."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import ServerProcess

TPOT = "tokenpipe:request_time_per_output_token_seconds"


def tpot_sum_count(c: httpx.Client) -> tuple[float, float]:
    samples = {
        s.name: s.value
        for family in text_string_to_metric_families(c.get("/metrics").text)
        for s in family.samples
        if s.name in (TPOT + "_sum", TPOT + "_count")
    }
    return samples[TPOT + "_sum"], samples[TPOT + "_count"]


def final_meta_info(c: httpx.Client, body: dict[str, object]) -> dict[str, object]:
    if not body.get("stream"):
        return c.post("/generate", json=body).json()["meta_info"]  # type: ignore[no-any-return]
    with c.stream("POST", "/generate", json=body) as resp:
        events = [line for line in resp.iter_lines() if line.startswith("data: {")]
    return json.loads(events[-1][len("data: ") :])["meta_info"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_time_per_output_token_is_the_scheduler_decode_interval(
    server: ServerProcess, stream: bool
) -> None:
    body = {
        "text": "time per token",
        "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }
    with server.client() as c:
        before = tpot_sum_count(c)
        meta = final_meta_info(c, body)
        after = tpot_sum_count(c)
    assert meta["completion_tokens"] == 12
    observed = after[0] - before[0]
    assert after[1] - before[1] == 1, "one observation per finished request"
    assert observed > 0
    # The same interval as decode_throughput: 11 tokens after the first over the decode time.
    assert observed == pytest.approx(
        1 / meta["decode_throughput"],  # type: ignore[operator]
        rel=1e-6,
    )
