"""``--metrics-compat vllm`` and ``sglang`` as a real Prometheus sees them: after a short load,
every metric the peers' published Grafana dashboards query exists with samples, the request
and token totals equal the sums of what the clients received, and the series each peer exports
carry its labels and its meaning of the number (docs/operations.md's table). One Prometheus
scrapes both servers; the default names are pinned by tests/e2e/test_metrics.py."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from bench.launch import Launched, answers_200, stop_all, wait_ready
from tests.prometheus_server import query, require_program, scalar
from tests.server_harness import SMALL_SERVER_ARGS, ServerProcess, free_port

# vllm-project/vllm, examples/online_serving/prometheus_grafana/grafana.json, since moved to
# examples/observability/prometheus_grafana/grafana.json: every metric its panels query, in its
# current version (the one docs.vllm.ai publishes, with the TPOT panel).
VLLM_DASHBOARD = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_sum", "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_time_per_output_token_seconds_sum",
    "vllm:request_time_per_output_token_seconds_count", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count",
    "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum", "vllm:request_max_num_generation_tokens_sum",
)  # fmt: skip
# sgl-project/sglang, examples/monitoring/grafana/dashboards/json/sglang-dashboard.json: every
# metric its panels query; and the serving ones of training-capture-dashboard.json in the same
# folder (its sglang:training_capture_* series belong to a feature tokenpipe has not: docs/design.md
# section 7).
SGLANG_DASHBOARD = (
    "sglang:e2e_request_latency_seconds_bucket", "sglang:e2e_request_latency_seconds_sum",
    "sglang:e2e_request_latency_seconds_count", "sglang:time_to_first_token_seconds_bucket",
    "sglang:time_to_first_token_seconds_sum", "sglang:time_to_first_token_seconds_count",
    "sglang:num_running_reqs", "sglang:gen_throughput", "sglang:cache_hit_rate",
    "sglang:num_queue_reqs", "sglang:inter_token_latency_seconds_bucket",
)  # fmt: skip
# What the team's issue names as alerted on beyond the dashboards.
VLLM_ALERTED = (
    "vllm:iteration_tokens_total_bucket", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_n_bucket", "vllm:num_preemptions_total",
)  # fmt: skip
SGLANG_ALERTED = (
    "sglang:token_usage",
    "sglang:num_used_tokens",
    "sglang:prompt_tokens_total",
    "sglang:num_requests_total",
)
FAMILIES = ("vllm", "sglang")


@dataclass
class Stack:
    servers: dict[str, ServerProcess]  # by the family its /metrics speaks
    prometheus: str  # the URL of the one Prometheus scraping them all


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A server per family and one Prometheus scraping both every second, started together."""
    binary = require_program(
        "prometheus"
    )  # before the servers: without it there is nothing to check
    root = tmp_path_factory.mktemp("metrics_compat")
    servers = {
        family: ServerProcess(root / family / "tmp", ["--metrics-compat", family])
        for family in FAMILIES
    }
    targets = ", ".join(f"'127.0.0.1:{srv.port}'" for srv in servers.values())
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: tokenpipe\n    static_configs:\n      - targets: "
        f"[{targets}]\n"
    )
    port = free_port()
    prometheus = Launched(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={root / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        name="prometheus",
        log_path=root / "prometheus.log",
        stop_timeout=10.0,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(
            lambda: answers_200(f"{url}/-/ready", timeout=2),
            [prometheus],
            30,
            what="prometheus did not become ready",
            interval=0.2,
        )
        for srv in servers.values():
            srv.wait_ready()
        yield Stack(servers, url)
    finally:
        stop_all([*servers.values(), prometheus])


def run_load(srv: ServerProcess) -> list[tuple[int, int]]:
    """A few requests through /generate and /v1/chat/completions, streamed and not; the
    (prompt_tokens, completion_tokens) each client received."""
    model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]

    def generate(i: int) -> tuple[int, int]:
        body = {
            "text": f"Tell me about the number {i}.",
            "sampling_params": {"max_new_tokens": 3 + i, "temperature": 0.0},
        }
        with srv.client() as c:
            if i % 2 == 0:
                meta = c.post("/generate", json=body).json()["meta_info"]
            else:
                with c.stream("POST", "/generate", json={**body, "stream": True}) as resp:
                    meta = [
                        json.loads(line[6:])["meta_info"]
                        for line in resp.iter_lines()
                        if line.startswith("data: {")
                    ][-1]
        return meta["prompt_tokens"], meta["completion_tokens"]

    def chat(i: int) -> tuple[int, int]:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Say {i}."}],
            "max_tokens": 4,
            "temperature": 0,
        }
        with srv.client() as c:
            if i % 2 == 0:
                usage = c.post("/v1/chat/completions", json=body).json()["usage"]
            else:
                stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
                with c.stream("POST", "/v1/chat/completions", json=stream) as resp:
                    events = [
                        json.loads(line[6:])
                        for line in resp.iter_lines()
                        if line.startswith("data: {")
                    ]
                usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        return usage["prompt_tokens"], usage["completion_tokens"]

    # One prompt twice, one after the other: the second is served from the prefix cache.
    again = [generate(0), generate(0)]
    with ThreadPoolExecutor(3) as pool:
        return again + list(pool.map(generate, range(4))) + list(pool.map(chat, range(2)))


@pytest.fixture(scope="module")
def loads(stack: Stack) -> dict[str, list[tuple[int, int]]]:
    with ThreadPoolExecutor(len(stack.servers)) as pool:
        return dict(zip(stack.servers, pool.map(run_load, stack.servers.values()), strict=True))


@pytest.fixture(scope="module")
def prometheus(stack: Stack) -> str:
    return stack.prometheus


def settle(prometheus: str, expr: str, expected: float) -> None:
    """Waits until Prometheus has scraped ``expr`` at ``expected`` (a scrape a second)."""
    deadline = time.monotonic() + 30
    while scalar(prometheus, expr) != expected:
        assert time.monotonic() < deadline, (expr, expected, query(prometheus, expr))
        time.sleep(0.25)


def test_vllm_totals_equal_the_sums_the_clients_received(
    prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    usage = loads["vllm"]
    settle(prometheus, "sum(vllm:request_success_total)", len(usage))
    assert scalar(prometheus, "vllm:prompt_tokens_total") == sum(p for p, _ in usage)
    assert scalar(prometheus, "vllm:generation_tokens_total") == sum(c for _, c in usage)
    assert scalar(prometheus, "vllm:prefix_cache_queries_total") == sum(p for p, _ in usage)
    assert scalar(prometheus, "sum(vllm:e2e_request_latency_seconds_count)") == len(usage)
    labels = query(prometheus, "vllm:request_success_total")
    assert all('"engine": "0"' in k and '"model_name": "tokenpipe-tiny"' in k for k in labels), (
        labels
    )


def test_sglang_totals_equal_the_sums_the_clients_received(
    prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    usage = loads["sglang"]
    settle(prometheus, "sum(sglang:num_requests_total)", len(usage))
    assert scalar(prometheus, "sglang:prompt_tokens_total") == sum(p for p, _ in usage)
    assert scalar(prometheus, "sglang:generation_tokens_total") == sum(c for _, c in usage)
    assert scalar(prometheus, "sum(sglang:e2e_request_latency_seconds_count)") == len(usage)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_dashboard_metric_has_samples(
    family: str, stack: Stack, prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    wanted = (
        VLLM_DASHBOARD + VLLM_ALERTED if family == "vllm" else SGLANG_DASHBOARD + SGLANG_ALERTED
    )
    settle(prometheus, f"sum({family}:e2e_request_latency_seconds_count)", len(loads[family]))
    missing = [
        name for name in wanted if not query(prometheus, f'{name}{{model_name="tokenpipe-tiny"}}')
    ]
    assert missing == [], missing
    # And the load was observed in each histogram the dashboards read.
    empty = [
        name
        for name in wanted
        if name.endswith(("_count", "_sum")) and not scalar(prometheus, f"sum({name})")
    ]
    assert empty == [], empty
    # The server serves no name of the other peer.
    other = "sglang" if family == "vllm" else "vllm"
    assert (
        query(
            prometheus,
            f'{{__name__=~"{other}:.+", instance="127.0.0.1:{stack.servers[family].port}"}}',
        )
        == {}
    )


def test_tokenpipe_names_remain_only_where_the_peer_has_none(
    prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    settle(prometheus, "sum(vllm:request_success_total)", len(loads["vllm"]))
    # tokenpipe's own series neither peer has keep their names (3 reasons, on both servers) ...
    assert scalar(prometheus, "count(tokenpipe:num_rejected_requests_total)") == 2 * 3
    # ... and the renamed ones are served under the peer's name only.
    assert query(prometheus, "tokenpipe:prompt_tokens_total") == {}


def labels_of(prometheus: str, expr: str) -> list[dict[str, str]]:
    """The label sets of ``expr``'s series, without Prometheus's own job and instance."""
    return [
        {k: v for k, v in json.loads(key).items() if k not in ("job", "instance")}
        for key in query(prometheus, expr)
    ]


def test_vllm_iteration_tokens_count_each_steps_prompt_and_generated_tokens(
    prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    """vLLM's per-step histogram counts the prompt tokens a step processes, those served from
    the prefix cache too, and the generated ones: over the run its sum is the prompt plus
    generated tokens the clients were told of."""
    usage = loads["vllm"]
    settle(prometheus, "sum(vllm:request_success_total)", len(usage))
    hits = scalar(prometheus, "vllm:prefix_cache_hits_total")
    assert hits is not None and hits > 0  # a prompt was served from the cache
    expected = sum(p + c for p, c in usage)
    settle(prometheus, "vllm:iteration_tokens_total_sum", expected)
    # And the prompt tokens by source add up as vLLM's do.
    source = "vllm:prompt_tokens_by_source_total"
    by = {
        json.loads(k)["source"]: v
        for k, v in query(prometheus, f"sum by (source) ({source})").items()
    }
    recomputed = scalar(prometheus, "vllm:prompt_tokens_recomputed_total")
    prompt = sum(p for p, _ in usage)
    assert recomputed is not None
    assert by["local_compute"] + by["local_cache_hit"] + by["external_kv_transfer"] == (
        prompt + recomputed
    )
    cached = scalar(prometheus, "vllm:prompt_tokens_cached_total")
    assert cached == hits
    assert scalar(prometheus, "vllm:request_prefill_kv_computed_tokens_sum") == prompt - cached


def test_vllm_series_carry_vllms_labels(
    prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    settle(prometheus, "sum(vllm:request_success_total)", len(loads["vllm"]))
    # The cache config info: engine and config labels (no model name), from the server's own.
    pool = SMALL_SERVER_ARGS[SMALL_SERVER_ARGS.index("--max-total-tokens") + 1]
    assert labels_of(prometheus, "vllm:cache_config_info") == [
        {
            "__name__": "vllm:cache_config_info",
            "engine": "0",
            "block_size": "1",
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": pool,
        }
    ]
    assert scalar(prometheus, "vllm:cache_config_info") == 1
    reasons = labels_of(prometheus, "vllm:num_requests_waiting_by_reason")
    assert sorted(r["reason"] for r in reasons) == ["capacity", "deferred"]
    assert all(r["engine"] == "0" and r["model_name"] == "tokenpipe-tiny" for r in reasons)


def test_sglang_series_carry_sglangs_labels_and_meaning(
    prometheus: str, loads: dict[str, list[tuple[int, int]]]
) -> None:
    usage = loads["sglang"]
    settle(prometheus, "sum(sglang:num_requests_total)", len(usage))
    # The scheduler's series carry its parallel ranks; the tokenizer's split no streaming.
    scheduler = {"tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0", "engine_type": "unified"}
    for name in ("sglang:num_queue_reqs", "sglang:num_grammar_queue_reqs",
                 "sglang:decode_sum_seq_lens", "sglang:num_running_reqs"):  # fmt: skip
        (labels,) = labels_of(prometheus, name)
        assert scheduler.items() <= labels.items(), (name, labels)
    for name in ("sglang:num_requests_total", "sglang:time_to_first_token_seconds_count"):
        (labels,) = labels_of(prometheus, name)
        assert "is_streaming" not in labels and "tp_rank" not in labels, (name, labels)
    # Tokens by mode add up to what the clients were told of.
    prompt = sum(p for p, _ in usage)
    settle(prometheus, "sum(sglang:realtime_tokens_total)", prompt + sum(c for _, c in usage))
    cache = scalar(prometheus, 'sglang:realtime_tokens_total{mode="prefill_cache"}')
    compute = scalar(prometheus, 'sglang:realtime_tokens_total{mode="prefill_compute"}')
    assert cache is not None and cache > 0 and compute == prompt - cache


def _histogram(srv: ServerProcess, name: str) -> tuple[float, float]:
    """(count, sum) of a histogram on the server's /metrics, over its labels."""
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    total = {"_count": 0.0, "_sum": 0.0}
    for line in text.splitlines():
        for suffix in total:
            if line.startswith(name + suffix + "{"):
                total[suffix] += float(line.rsplit(" ", 1)[1])
    return total["_count"], total["_sum"]


def test_vllm_counts_a_request_of_n_choices_once_with_its_n(
    stack: Stack, loads: dict[str, list[tuple[int, int]]]
) -> None:
    """vLLM's n and longest choice are per request: n=3 is one observation of 3, and the
    longest choice's tokens one observation too; max_tokens is per choice, as vLLM observes it
    per child request. (Last in the module: the totals above count the load alone.)"""
    srv = stack.servers["vllm"]
    names = (
        "vllm:request_params_n",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
    )
    before = {name: _histogram(srv, name) for name in names}
    model = httpx.get(f"{srv.url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": "Count with me:",
        "n": 3,
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
    }
    answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
    assert len(answer["choices"]) == 3 and answer["usage"]["completion_tokens"] == 15
    after = {name: _histogram(srv, name) for name in names}
    grew = {
        name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in names
    }
    # max_tokens is vLLM's per child request: once per choice.
    assert grew == {names[0]: (1, 3), names[1]: (3, 15), names[2]: (1, 5)}
