"""Smoke tests of the end-to-end serving benchmark (bench/serve.py) against servers it
launches itself: tiny numbers; checks the JSON, the printed table and the PNG. They do not
judge the timings (a shared CI machine says nothing about them)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    return importlib.import_module("bench.serve")


# The helpers live in the modules bench/serve.py is split into; importing bench.serve first
# (the fixture above) skips them the same way when the bench extras are not installed.
@pytest.fixture(scope="module")
def client(bench: ModuleType) -> ModuleType:
    return importlib.import_module("bench.serve_client")


@pytest.fixture(scope="module")
def readings(bench: ModuleType) -> ModuleType:
    return importlib.import_module("bench.serve_readings")


@pytest.fixture(scope="module")
def compare(bench: ModuleType) -> ModuleType:
    return importlib.import_module("bench.serve_compare")


@pytest.mark.timeout(60)
def test_launch_run_writes_json_and_png(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    argv = [
        "--launch",
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--max-new-tokens",
        "8",
        "--no-progress",
    ]
    assert (
        bench.main(
            [
                *argv,
                "--json",
                str(out),
                "--plot",
                str(png),
                "--server-args",
                "--max-total-tokens 4096",
            ]
        )
        == 0
    )

    r = json.loads(out.read_text())
    assert r["requests"] == r["completed"] == 8
    assert r["errors"] == 0 and r["tokens_lost"] == 0 and r["requests_with_lost_tokens"] == 0
    assert r["output_tokens"] == 8 * 8
    assert r["output_tokens_per_s"] > 0 and r["requests_per_s"] > 0
    for key in ("ttft_ms", "e2e_ms"):
        assert all(r[key][p] is not None and r[key][p] > 0 for p in ("p50", "p90", "p99")), r[key]
    assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
    if r["streaming"]:  # the seeded 50/50 split has streams, which have ITLs
        assert all(r["itl_ms"][p] is not None for p in ("p50", "p90", "p99"))
    assert len(r["requests_detail"]) == 8
    assert all(d["tokens"] == d["completion_tokens"] == 8 for d in r["requests_detail"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = capsys.readouterr().out
    for label in (
        "requests/s",
        "output tokens/s",
        "TTFT ms",
        "ITL ms",
        "e2e ms",
        "errors",
        "tokens lost",
        "scheduler steps/s",
    ):
        assert label in table


def test_step_rate_needs_no_report_inside_the_run(readings: ModuleType) -> None:
    """The counts before and after a run bound it, so a run shorter than the scheduler's
    report interval (no report seen while it ran) still has a rate, over the whole run; a
    longer one gets it between the reports that bound its steady part."""
    start, end = readings.Settled(10, True), readings.Settled(110, True)
    short = readings.phase_readings(start, [readings.Sample(0.05, 0.06, 10, 0)], end, 0.4)
    assert short == [(0.0, 10), (0.4, 110)]
    assert readings.step_rate(short, 0.01, 0.39) == {
        "steps_per_s": 250.0,
        "steps": 100,
        "window_s": [0.0, 0.4],
    }

    samples = [
        readings.Sample(t - 0.01, t, n, 4)
        for t, n in ((0.5, 20), (0.6, 20), (1.0, 40), (1.5, 60), (2.0, 80))
    ]
    long = readings.phase_readings(start, samples, end, 2.6)
    assert long == [(0.0, 10), (0.5, 20), (1.0, 40), (1.5, 60), (2.0, 80), (2.6, 110)]
    assert readings.step_rate(long, 0.55, 1.9) == {
        "steps_per_s": 40.0,
        "steps": 60,
        "window_s": [0.5, 2.0],
    }


@pytest.mark.timeout(90)
def test_compare_discard_reports_a_ratio(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both step rates exist however fast the runs go: each is bounded by the scheduler's
    step count before the run and the one it reports when the run's work is done."""
    out = tmp_path / "r.json"
    argv = [
        "--launch",
        "--compare-discard",
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--max-new-tokens",
        "96",
    ]
    assert (
        bench.main(
            [
                *argv,
                "--stream-ratio",
                "1",
                "--no-progress",
                "--json",
                str(out),
                "--server-args",
                "--max-total-tokens 4096",
            ]
        )
        == 0
    )

    r = json.loads(out.read_text())
    assert r["errors"] == 0 and r["tokens_lost"] == 0 and r["streaming"] == 8
    assert r["scheduler_steps"]["steps_per_s"] > 0
    d = r["discard"]
    assert d["requests_sent"] >= 4 and d["scheduler_steps"]["steps_per_s"] > 0
    # Both rates rest on the scheduler's idle reports before and after each run.
    assert r["scheduler_steps"]["confirmed"] and d["scheduler_steps"]["confirmed"]
    assert r["steps_ratio"] > 0
    table = capsys.readouterr().out
    assert "discarded steps/s" in table and "attached/discarded" in table
    assert "PASS" in table or "MISS" in table


def test_request_options_reach_the_request_body(
    bench: ModuleType, client: ModuleType, compare: ModuleType
) -> None:
    """Today's body by default (temperature 0.7, a seed per request, no top_p); the options
    replace their parts; --compare-sampling's greedy runs send temperature 0 and no seed,
    its sampled runs temperature 0.7, top_p 0.9 and a seed unless told otherwise."""
    cfg = client.LoadConfig(seed=5)
    default = {"max_new_tokens": 64, "temperature": 0.7, "ignore_eos": True, "seed": 8}
    assert client.make_body(3, cfg, 4096, True)["sampling_params"] == default
    args = bench.parse_args(["--temperature", "0.5", "--top-p", "0.8", "--no-seeded"])
    assert (args.temperature, args.top_p, args.seeded) == (0.5, 0.8, False)
    custom = client.LoadConfig(temperature=0.5, top_p=0.8, seeded=False)
    given = {"max_new_tokens": 64, "temperature": 0.5, "ignore_eos": True, "top_p": 0.8}
    assert client.make_body(0, custom, 4096, False)["sampling_params"] == given

    variants = compare.sampling_variants(cfg, None, None, None)
    seeds = set()
    for i in range(4):
        greedy, sampled = (
            client.make_body(i, variants[k], 4096, True)["sampling_params"]
            for k in ("greedy", "sampled")
        )
        assert greedy["temperature"] == 0.0 and "seed" not in greedy and "top_p" not in greedy
        assert (sampled["temperature"], sampled["top_p"]) == (0.7, 0.9)
        seeds.add(sampled["seed"])
    assert len(seeds) == 4  # a distinct seed per request
    sampled_given = compare.sampling_variants(cfg, 1.0, 0.5, False)["sampled"]
    assert (sampled_given.temperature, sampled_given.top_p, sampled_given.seeded) == (
        1.0,
        0.5,
        False,
    )
    # Runs with different prompt sets share no prompt (the prefix cache serves neither).
    other_set = dataclasses.replace(cfg, prompt_set=1)
    assert (
        client.make_body(0, cfg, 4096, True)["input_ids"]
        != client.make_body(0, other_set, 4096, True)["input_ids"]
    )

    refused = (
        ["--compare-sampling"],  # needs --launch
        ["--launch", "--compare-sampling", "--temperature", "0"],  # nothing sampled to compare
        ["--launch", "--compare-sampling", "--sampling-rounds", "1"],
        ["--top-p", "0"],
    )
    for argv in refused:
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


@pytest.mark.timeout(60)
def test_compare_sampling_reports_a_ratio(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Greedy and sampled runs alternate on the one launched server; each completes every
    request with no token lost, and the medians and their ratio are there. The ratio's
    value is not judged (a shared CI machine says nothing about it)."""
    out = tmp_path / "r.json"
    argv = [
        "--launch",
        "--compare-sampling",
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--max-new-tokens",
        "8",
        "--top-p",
        "0.95",
    ]
    assert (
        bench.main(
            [*argv, "--no-progress", "--json", str(out), "--server-args", "--max-total-tokens 4096"]
        )
        == 0
    )

    r = json.loads(out.read_text())
    assert r["errors"] == 0 and r["tokens_lost"] == 0 and r["config"]["top_p"] == 0.95
    s = r["sampling"]
    assert s["params"] == {
        "greedy": {"temperature": 0.0, "top_p": None, "seeded": False},
        "sampled": {
            "temperature": 0.7,
            "top_p": 0.95,
            "seeded": True,
        },  # the --top-p given replaces 0.9
    }
    assert [row["first"] for row in s["rounds"]] == ["greedy", "sampled"]
    for row in s["rounds"]:
        for name in ("greedy", "sampled"):
            run = row[name]
            assert run["completed"] == 8 and run["output_tokens"] == 8 * 8, run
            assert run["errors"] == 0 and run["tokens_lost"] == 0
            assert 0 < run["output_tokens_per_s"] < math.inf
        assert 0 < row["ratio"] < math.inf
    assert s["errors"] == 0 and s["tokens_lost"] == 0
    for key in ("greedy_output_tokens_per_s", "sampled_output_tokens_per_s", "ratio"):
        assert 0 < s[key] < math.inf, key
    assert s["ratio"] == pytest.approx(
        sum(row["ratio"] for row in s["rounds"]) / 2
    )  # the median of two

    table = capsys.readouterr().out
    assert "greedy tok/s" in table and "sampled tok/s" in table and "sampled/greedy" in table
    assert "PASS" in table or "MISS" in table


@pytest.mark.timeout(60)
def test_top_logprobs_reports_both_arms_and_a_ratio(
    bench: ModuleType,
    client: ModuleType,
    compare: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Runs without and with top-5 logprobs alternate on the one launched server; every
    request of the logprobs arm gets one logprob entry per token, and the medians and
    their ratio are there (its value is not judged)."""
    out = tmp_path / "r.json"
    argv = [
        "--launch",
        "--top-logprobs",
        "5",
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--max-new-tokens",
        "8",
        "--no-progress",
    ]
    assert bench.main([*argv, "--json", str(out), "--server-args", "--max-total-tokens 4096"]) == 0

    lp = json.loads(out.read_text())["logprobs"]
    assert lp["top_logprobs"] == 5 and [row["first"] for row in lp["rounds"]] == [
        "without",
        "logprobs",
    ]
    for row in lp["rounds"]:
        for name in ("without", "logprobs"):
            assert row[name]["completed"] == 8 and row[name]["output_tokens"] == 8 * 8, row[name]
            assert (
                row[name]["errors"] == row[name]["tokens_lost"] == row[name]["logprobs_lost"] == 0
            )
        assert 0 < row["ratio"] < math.inf
    for key in ("without_output_tokens_per_s", "logprobs_output_tokens_per_s", "ratio"):
        assert 0 < lp[key] < math.inf, key
    table = capsys.readouterr().out
    assert "without tok/s" in table and "logprobs tok/s" in table and "logprobs/without" in table
    assert (
        client.make_body(
            0, compare.logprobs_variants(client.LoadConfig(), 5)["logprobs"], 4096, True
        )["top_logprobs_num"]
        == 5
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--top-logprobs", "5"])  # needs --launch


@pytest.mark.timeout(90)
def test_json_schema_reports_both_arms_a_ratio_and_the_compile_cost(
    bench: ModuleType, client: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Runs without and with the schema on every request alternate on the one launched
    server, then the compile probe times a new schema against a cached one; the shipped
    schema asks for four order lines, so no constrained answer ends within 8 tokens."""
    out = tmp_path / "r.json"
    schema = Path(__file__).resolve().parents[2] / "bench" / "schemas" / "order.json"
    argv = [
        "--launch",
        "--json-schema",
        str(schema),
        "--concurrency",
        "4",
        "--requests",
        "8",
        "--max-new-tokens",
        "8",
        "--no-progress",
    ]
    assert bench.main([*argv, "--json", str(out)]) == 0

    st = json.loads(out.read_text())["structured"]
    assert [row["first"] for row in st["rounds"]] == ["unconstrained", "constrained"]
    for row in st["rounds"]:
        for name in ("unconstrained", "constrained"):
            assert row[name]["completed"] == 8 and row[name]["output_tokens"] == 8 * 8, row[name]
            assert row[name]["errors"] == row[name]["tokens_lost"] == 0
    assert 0 < st["ratio"] < math.inf
    k = st["compile"]
    assert all(
        len(k["ttft_ms"][name]) == k["trials"] for name in ("new", "cached", "unconstrained")
    )
    assert k["compile_ms"] == pytest.approx(k["new_ttft_ms"] - k["cached_ttft_ms"])
    table = capsys.readouterr().out
    assert "constrained/unconstrained" in table and "a compile adds" in table

    text = json.dumps(json.loads(schema.read_text()), separators=(",", ":"))
    constrained = dataclasses.replace(client.LoadConfig(), json_schema=text)
    assert client.make_body(0, constrained, 4096, True)["sampling_params"]["json_schema"] == text
    format_ = client.make_body(0, dataclasses.replace(constrained, api="completions"), 4096, True)[
        "response_format"
    ]
    assert format_["type"] == "json_schema" and format_["json_schema"]["schema"] == json.loads(text)
    with pytest.raises(SystemExit):
        bench.parse_args(["--json-schema", str(schema)])  # needs --launch
    with pytest.raises(SystemExit):
        bench.parse_args(["--launch", "--json-schema", str(tmp_path / "missing.json")])


@pytest.mark.timeout(90)
def test_completions_run_reports_cpu_per_process(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Streaming /v1/completions on a launched server, then the same workload on it and on a
    second server (--compare-api-workers 1: no --api-workers flag, so it runs on a server
    without it too). Every run has each process's CPU over its steady window, named by
    role, and tokens per API CPU-second; their values are not judged, only that they were
    measured (about 0.1 s of API CPU a run: ten clock ticks or more)."""
    out = tmp_path / "r.json"
    argv = [
        "--launch",
        "--api",
        "completions",
        "--stream-ratio",
        "1",
        "--concurrency",
        "8",
        "--requests",
        "16",
        "--max-new-tokens",
        "32",
    ]
    argv += [
        "--compare-api-workers",
        "1",
        "--no-progress",
        "--json",
        str(out),
        "--server-args",
        "--max-total-tokens 4096",
    ]
    assert bench.main(argv) == 0

    r = json.loads(out.read_text())
    assert r["config"]["api"] == "completions" and r["streaming"] == 16
    assert r["errors"] == 0 and r["tokens_lost"] == 0 and r["output_tokens"] == 16 * 32
    runs = [r] + [row[name] for row in r["api_workers"]["rounds"] for name in ("single", "multi")]
    for run in runs:
        cpu = run["cpu"]
        assert set(cpu["processes"]) == {"scheduler", "detokenizer", "api"}, cpu
        lo, hi = cpu["window_s"]
        assert 0 <= lo < hi <= run["duration_s"]
        for p in [*cpu["processes"].values(), cpu["client"]]:
            assert p["cpu_s"] > 0 and 0 < p["cores"] < math.inf, cpu
        assert 0 < cpu["tokens_in_window"] <= run["output_tokens"]
        assert cpu["api_cpu_s"] == cpu["processes"]["api"]["cpu_s"]
        assert 0 < cpu["tokens_per_api_cpu_s"] < math.inf
    w = r["api_workers"]
    assert w["workers"] == 1 and w["flags"] == [] and w["errors"] == 0 and w["tokens_lost"] == 0
    assert [row["first"] for row in w["rounds"]] == ["single", "multi"]
    pids = {
        name: {row[name]["cpu"]["processes"]["api"]["pid"] for row in w["rounds"]}
        for name in ("single", "multi")
    }
    assert (
        len(pids["single"]) == len(pids["multi"]) == 1 and pids["single"] != pids["multi"]
    )  # two servers
    for name in ("single", "multi"):
        assert 0 < w[f"{name}_output_tokens_per_s"] < math.inf
        assert (
            0 < w["cpu"][name]["cores"]["api"] < math.inf
            and 0 < w["cpu"][name]["tokens_per_api_cpu_s"] < math.inf
        )

    table = capsys.readouterr().out
    for label in (
        "through /v1/completions",
        "CPU, steady window",
        "scheduler",
        "detokenizer",
        "bench client",
        "tokens/API CPU-s",
    ):
        assert label in table
    assert "single tok/s" in table and "multi/single" in table and "API cores: api" in table


def test_completions_bodies_and_chunk_counts(bench: ModuleType, client: ModuleType) -> None:
    """--api completions sends the /generate workload as a completions body (token-id
    prompt, usage on every chunk), and counts each chunk's tokens from the usage so far."""
    cfg = client.LoadConfig(seed=5, api="completions", max_new_tokens=16)
    body = client.make_body(3, cfg, 4096, True)
    assert (
        body["prompt"]
        == client.make_body(3, dataclasses.replace(cfg, api="generate"), 4096, True)["input_ids"]
    )
    assert {k: body[k] for k in ("max_tokens", "temperature", "ignore_eos", "seed", "stream")} == {
        "max_tokens": 16,
        "temperature": 0.7,
        "ignore_eos": True,
        "seed": 8,
        "stream": True,
    }
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "stream_options" not in client.make_body(3, cfg, 4096, False)

    res = client.ReqResult(stream=True)
    for so_far in (1, 3, 3, 4):  # a chunk may carry several tokens, or none yet
        res.tokens += client.usage_event_tokens(
            {"choices": [{"text": "x"}], "usage": {"completion_tokens": so_far}}, res
        )
    assert res.tokens == 4 and res.completion_tokens is None
    assert client.usage_event_tokens({"choices": [], "usage": {"completion_tokens": 5}}, res) == 0
    assert (
        res.completion_tokens == 5
    )  # the final usage: one token more than the chunks said, so lost
    with pytest.raises(ValueError):
        client.usage_event_tokens({"choices": [{"text": "x"}], "usage": None}, res)

    for argv in (
        ["--api", "completions", "--launch", "--top-logprobs", "5"],
        ["--api", "completions", "--launch", "--compare-discard"],
        ["--compare-api-workers", "2"],  # needs --launch
        ["--launch", "--compare-api-workers", "2", "--server-args", "--api-workers 2"],
        ["--launch", "--pids", "1"],
        ["--pids", "x"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    assert bench.parse_args(["--pids", "12,34"]).pids == [12, 34]


@pytest.mark.timeout(120)
def test_tools_reports_three_arms_and_the_api_cpu_per_token(
    bench: ModuleType, client: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--api chat --tools: the chat workload without tools, with the shipped four tools and
    tool_choice none, and with required, in rotating rounds on one launched server. Every
    arm counts its tokens from the chunks' usage (nothing lost); the required arm's answers
    are tool calls (a random model opens one in most of its 64 tokens: the grammar forces
    the call's name early) and no other arm has any; each arm has its API CPU per token."""
    out = tmp_path / "r.json"
    tools = Path(__file__).resolve().parents[2] / "bench" / "schemas" / "tools.json"
    argv = [
        "--launch",
        "--api",
        "chat",
        "--tools",
        str(tools),
        # Enough tokens per arm that its API CPU over the rounds is many 10 ms clock ticks.
        "--concurrency",
        "8",
        "--requests",
        "8",
        "--max-new-tokens",
        "64",
    ]
    assert bench.main([*argv, "--rounds", "3", "--no-progress", "--json", str(out)]) == 0

    r = json.loads(out.read_text())
    assert (
        r["config"]["api"] == "chat"
        and r["errors"] == 0
        and r["tokens_lost"] == 0
        and r["output_tokens"] == 8 * 64
    )
    tc = r["tool_calling"]
    assert tc["tools"] == 4
    assert [row["first"] for row in tc["rounds"]] == ["no_tools", "tools_none", "tools"]
    for row in tc["rounds"]:
        for name in ("no_tools", "tools_none", "tools"):
            assert (
                row[name]["completed"] == 8 and row[name]["errors"] == row[name]["tokens_lost"] == 0
            ), row[name]
        assert row["no_tools"]["output_tokens"] == row["tools_none"]["output_tokens"] == 8 * 64
        assert 0 < row["tools"]["output_tokens"] <= 8 * 64  # a call list may close before 64 tokens
        assert row["no_tools"]["tool_calls"] == row["tools_none"]["tool_calls"] == 0
    assert tc["tool_calls_per_answer"]["tools"] > 0
    for name in ("tools_none", "tools"):
        assert 0 < tc["ratios"][name] < math.inf
    for name in ("no_tools", "tools_none", "tools"):
        assert 0 < tc["api_us_per_token"][name] < math.inf, tc["api_us_per_token"]
    table = capsys.readouterr().out
    assert (
        "tools/tools_none" in table
        and "API CPU us per streamed token" in table
        and "tool calls per answer" in table
    )

    text = json.dumps(json.loads(tools.read_text()), separators=(",", ":"))
    cfg = client.LoadConfig(api="chat", prompt_len=12, max_new_tokens=16, tools=text)
    body = client.make_body(2, cfg, 4096, True)
    assert body["tools"] == json.loads(text) and body["tool_choice"] == "required"
    assert (
        body["messages"][0]["role"] == "user" and len(body["messages"][0]["content"].split()) == 12
    )
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "tools" not in client.make_body(2, dataclasses.replace(cfg, tools=None), 4096, True)
    res = client.ReqResult(stream=True)
    call = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": ""},
    }
    more = {"index": 0, "function": {"arguments": "{}"}}
    for so_far, calls in ((2, [call]), (3, [more])):
        res.tokens += client.usage_event_tokens(
            {"choices": [{"delta": {"tool_calls": calls}}], "usage": {"completion_tokens": so_far}},
            res,
        )
    assert res.tokens == 3 and res.tool_calls == 1
    for argv in (
        ["--launch", "--tools", str(tools)],  # needs --api chat
        ["--api", "chat", "--tools", str(tools)],  # needs --launch
        ["--launch", "--api", "chat", "--tools", str(tmp_path / "missing.json")],
        ["--launch", "--api", "chat", "--top-logprobs", "5"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)


@pytest.mark.parametrize("cumulative", [True, False], ids=["sglang-default", "incremental"])
def test_generate_events_count_their_new_tokens_in_either_stream_mode(
    client: ModuleType, cumulative: bool
) -> None:
    """A /generate stream's events hold the ids so far (SGLang's default) or only their new
    ones (--incremental-streaming-output): either way each event counts its new tokens, and
    a lost one shows as a count that disagrees with completion_tokens."""
    rows = [[7], [8, 9], [], [10]]  # an event may carry several tokens, or none (a finish)

    def read(rows: list[list[int]], counts: list[int]) -> tuple[list[int], object]:
        res = client.ReqResult(stream=True, logprobs=0)
        seen: list[int] = []
        so_far: list[int] = []
        for ids, count in zip(rows, counts):
            so_far += ids
            shown = list(so_far) if cumulative else ids
            event = {
                "output_ids": shown,
                "meta_info": {
                    "completion_tokens": count,
                    "output_token_logprobs": [[0.0, t, None] for t in shown],
                },
            }
            n = client.generate_event_tokens(event, res)
            res.tokens += n
            seen.append(n)
        assert res.logprobs == res.tokens
        return seen, res

    seen, res = read(rows, [1, 3, 3, 4])
    assert seen == [1, 2, 0, 1]
    assert res.tokens == res.completion_tokens == 4  # type: ignore[attr-defined]
    _, lossy = read([[7], [8], [10]], [1, 3, 4])  # token 9 never arrived
    assert lossy.tokens != lossy.completion_tokens  # type: ignore[attr-defined]


def test_several_processes_of_a_role_are_numbered_by_start(readings: ModuleType) -> None:
    """--api-workers N gives N API processes: api-0, api-1, ... in the order they started;
    one process of a role keeps its plain name."""
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.05)  # a later start time (clock ticks), not only a higher pid
        second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            roles = {second.pid: "api", os.getpid(): "scheduler", first.pid: "api", 1: None}
            assert readings.name_processes(roles) == {
                "scheduler": os.getpid(),
                "api-0": first.pid,
                "api-1": second.pid,
            }
            assert readings.cpu_seconds(os.getpid()) > 0
        finally:
            second.kill()
            second.wait()
    finally:
        first.kill()
        first.wait()
