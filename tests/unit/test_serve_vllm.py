"""bench/serve.py --compare-vllm without vLLM: its flags, the vocabulary a peer server's
prompts are drawn from, the processes whose CPU is read, and the medians and ratios of the
table."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.serve import parse_args
from bench.serve_client import LoadConfig
from bench.serve_readings import checkpoint_vocab, process_title, tree_processes
from bench.serve_vllm import format_table, model_path, run_figures, summarize

MODES = ("greedy", "sampled")


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 4099, "hidden_size": 128}))
    return tmp_path


def test_peer_vocabulary_comes_from_the_checkpoint_config(checkpoint: Path) -> None:
    assert checkpoint_vocab(checkpoint) == 4099


def test_model_path_is_the_last_given() -> None:
    assert model_path(["--model-path", "/a", "--port", "1", "--model-path=/b"]) == Path("/b")
    assert model_path(["--model-path", "/a"]) == Path("/a")
    assert model_path(["--port", "1"]) is None


def test_compare_vllm_flags(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--compare-vllm", "--launch", "--server-args", f"--model-path {checkpoint}"]
    args = parse_args([*base, "--api", "completions"])
    assert args.compare_vllm and args.vllm_dtype == ["float32"]
    args = parse_args([*base, "--api", "completions", "--vllm-dtype", "auto"])
    assert args.vllm_dtype == ["auto"]
    refused = (
        (base, "--api completions"),
        (["--compare-vllm", "--api", "completions"], "needs --launch"),
        ([*base[:2], "--api", "completions"], "--model-path"),
        ([*base, "--api", "completions", "--compare-sampling"], "--compare-sampling"),
    )
    for argv, why in refused:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert why in capsys.readouterr().err


def test_tree_processes_names_every_process_under_the_root() -> None:
    spawn = (
        "import subprocess, sys, time\n"
        "kids = [subprocess.Popen(['sleep', '60']) for _ in range(2)]\n"
        "print('up', flush=True)\n"
        "sys.stdin.read()\n"
        "for k in kids: k.kill()\n"
    )
    root = subprocess.Popen(
        [sys.executable, "-c", spawn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert root.stdout is not None and root.stdout.readline() == "up\n"
        names = tree_processes(root.pid, "api")
        deadline = time.monotonic() + 30.0  # the children exist once "up" is printed
        while len(names) < 3 and time.monotonic() < deadline:
            names = tree_processes(root.pid, "api")
        assert names["api"] == root.pid
        assert sorted(names) == ["api", "sleep", "sleep-1"]
    finally:
        assert root.stdin is not None
        root.stdin.close()
        root.wait()


def test_process_title_reads_vllm_titles() -> None:
    assert process_title([b"VLLM::EngineCore", b""]) == "vllm-enginecore"
    assert process_title([b"/usr/bin/python3", b"-c", b"x"]) == "python3"


def a_run(tokens_per_s: float, ttft: float, cpu_s: float, output_tokens: int) -> dict[str, Any]:
    """A run_load summary with the keys ``run_figures`` reads, 4 requests of 8 tokens."""
    return {
        "requests": 4,
        "completed": 4,
        "duration_s": 1.0,
        "requests_per_s": 4.0,
        "output_tokens": output_tokens,
        "output_tokens_per_s": tokens_per_s,
        "ttft_ms": {"p50": ttft},
        "itl_ms": {"p50": 2.0, "mean": 3.0},
        "errors": 0,
        "error_examples": [],
        "tokens_lost": 0,
        "logprobs_lost": 0,
        "tool_calls": 0,
        "scheduler_steps": None,
        "cpu": {
            "processes": {"api": {"cpu_s": cpu_s / 2}, "engine": {"cpu_s": cpu_s / 2}},
            "tokens_in_window": 2000,
        },
    }


def test_run_figures_sum_every_process_and_check_every_token() -> None:
    cfg = LoadConfig(requests=4, max_new_tokens=8)
    full = run_figures(a_run(100.0, 50.0, cpu_s=0.5, output_tokens=32), cfg)
    assert full["server_cpu_s"] == 0.5
    assert full["cpu_s_per_1k_tokens"] == 0.25
    assert full["exact"]
    assert not run_figures(a_run(100.0, 50.0, cpu_s=0.5, output_tokens=31), cfg)["exact"]


def test_summary_takes_medians_and_the_median_of_each_rounds_ratio() -> None:
    cfg = LoadConfig(requests=4, max_new_tokens=8)
    speeds = {"tokenpipe": (100.0, 300.0, 200.0), "vllm-float32": (100.0, 100.0, 400.0)}
    rows = [
        {
            arm: {mode: run_figures(a_run(s[r], 10.0 * (r + 1), 1.0, 32), cfg) for mode in MODES}
            for arm, s in speeds.items()
        }
        for r in range(3)
    ]
    summary = summarize(rows, list(speeds), MODES)
    tp = summary["arms"]["tokenpipe"]["greedy"]
    assert tp["output_tokens_per_s"] == 200.0
    assert tp["rounds_output_tokens_per_s"] == [100.0, 300.0, 200.0]
    assert tp["ttft_p50_ms"] == 20.0 and tp["exact"]
    ratios = summary["ratios"]["tokenpipe/vllm-float32"]["sampled"]
    assert ratios["output_tokens_per_s"] == 1.0  # rounds: 1.0, 3.0, 0.5
    assert ratios["cpu_s_per_1k_tokens"] == 1.0
    report = {
        "config": {"requests": 4, "max_new_tokens": 8, "concurrency": 4, "stream_ratio": 1.0},
        "together": True,
        "idle_cores": {"tokenpipe": [0.0], "vllm-float32": [0.01]},
        "rounds": rows,
        "summary": summary,
    }
    table = format_table(report)
    assert "100 300 200" in table
    assert "tokenpipe/vllm-float32 greedy: tok/s 1.00x" in table
