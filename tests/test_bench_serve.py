"""Smoke tests of the end-to-end serving benchmark (bench/serve.py) against servers it
launches itself: tiny numbers; checks the JSON, the printed table and the PNG. They do not
judge the timings (a shared CI machine says nothing about them)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest

@pytest.fixture(scope="module")
def bench() -> ModuleType:
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    return importlib.import_module("bench.serve")


@pytest.mark.timeout(60)
def test_launch_run_writes_json_and_png(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    argv = ["--launch", "--concurrency", "4", "--requests", "8", "--max-new-tokens", "8", "--no-progress"]
    assert bench.main([*argv, "--json", str(out), "--plot", str(png), "--server-args", "--max-total-tokens 4096"]) == 0

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
    for label in ("requests/s", "output tokens/s", "TTFT ms", "ITL ms", "e2e ms", "errors", "tokens lost", "scheduler steps/s"):
        assert label in table


def test_step_rate_needs_no_report_inside_the_run(bench: ModuleType) -> None:
    """The counts before and after a run bound it, so a run shorter than the scheduler's
    report interval (no report seen while it ran) still has a rate, over the whole run; a
    longer one gets it between the reports that bound its steady part."""
    start, end = bench.Settled(10, True), bench.Settled(110, True)
    short = bench.phase_readings(start, [bench.Sample(0.05, 0.06, 10, 0)], end, 0.4)
    assert short == [(0.0, 10), (0.4, 110)]
    assert bench.step_rate(short, 0.01, 0.39) == {"steps_per_s": 250.0, "steps": 100, "window_s": [0.0, 0.4]}

    samples = [bench.Sample(t - 0.01, t, n, 4) for t, n in ((0.5, 20), (0.6, 20), (1.0, 40), (1.5, 60), (2.0, 80))]
    long = bench.phase_readings(start, samples, end, 2.6)
    assert long == [(0.0, 10), (0.5, 20), (1.0, 40), (1.5, 60), (2.0, 80), (2.6, 110)]
    assert bench.step_rate(long, 0.55, 1.9) == {"steps_per_s": 40.0, "steps": 60, "window_s": [0.5, 2.0]}


@pytest.mark.timeout(90)
def test_compare_discard_reports_a_ratio(bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both step rates exist however fast the runs go: each is bounded by the scheduler's
    step count before the run and the one it reports when the run's work is done."""
    out = tmp_path / "r.json"
    argv = ["--launch", "--compare-discard", "--concurrency", "4", "--requests", "8", "--max-new-tokens", "96"]
    assert bench.main([*argv, "--stream-ratio", "1", "--no-progress", "--json", str(out), "--server-args", "--max-total-tokens 4096"]) == 0

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
