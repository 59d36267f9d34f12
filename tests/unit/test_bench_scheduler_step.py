"""Smoke test of the scheduler decode-step benchmark (bench/scheduler_step.py): tiny
batch sizes and steps, greedy and sampled; checks the machine header, the table's rows and
columns, that every number is positive and finite, the profile sections and the JSON. It
does not judge the timings (a shared CI machine says nothing about them)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("bench.scheduler_step")


@pytest.mark.timeout(60)
def test_main_prints_table_and_writes_json(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = [
        "--batch-sizes",
        "1,4",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--context",
        "8",
        "--torch-threads",
        "1",
    ]
    assert (
        bench.main(
            [*argv, "--device", "cpu", "--profile", "--profile-steps", "2", "--json", str(out)]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()

    machine = lines[0]
    assert machine.startswith("machine:")
    for key in ("cpu_count=", "torch_threads=1", "torch ", "device=cpu"):
        assert key in machine, machine

    # A row per (batch size, sampling mode); both modes by default.
    header = next(line for line in lines if line.lstrip().startswith("batch"))
    assert header.split() == ["batch", "sampling", "threads", *bench.COLUMNS]
    start = lines.index(header) + 1
    rows = [line.split() for line in lines[start : start + 4]]
    assert [(int(row[0]), row[1]) for row in rows] == [
        (1, "greedy"),
        (1, "sampled"),
        (4, "greedy"),
        (4, "sampled"),
    ]
    for row in rows:
        assert row[2] == "1"  # --torch-threads 1
        numbers = [float(v) for v in row[3:]]
        assert len(numbers) == len(bench.COLUMNS) and all(
            v > 0 and math.isfinite(v) for v in numbers
        ), row
        values = dict(zip(bench.COLUMNS, numbers))
        assert values["steps"] == 3
        assert 0 < values["outside_%"] < 100
    tokens_per_s = {
        (int(row[0]), row[1]): float(row[3 + bench.COLUMNS.index("tokens/s")]) for row in rows
    }
    steps_per_s = {
        (int(row[0]), row[1]): float(row[3 + bench.COLUMNS.index("steps/s")]) for row in rows
    }
    for (
        b,
        mode,
    ), rate in tokens_per_s.items():  # tokens/s = B * steps/s (up to the table's rounding)
        assert rate == pytest.approx(b * steps_per_s[b, mode], rel=0.01, abs=0.2)
    # The largest batch size is profiled, in each mode.
    for mode in ("greedy", "sampled"):
        assert any(
            line.startswith(f"cProfile, B=4 {mode}: top entries by own time") for line in lines
        )
    assert any("scheduler.py" in line and "(step)" in line for line in lines)

    data = json.loads(out.read_text())
    assert data["config"]["batch_sizes"] == [1, 4] and data["config"]["context"] == 8
    assert data["config"]["samplings"] == ["greedy", "sampled"]
    assert data["machine"]["torch_threads"] == 1 and data["machine"]["device"] == "cpu"
    results = data["results"]
    assert [(r["batch_size"], r["sampling"]) for r in results] == [
        (1, "greedy"),
        (1, "sampled"),
        (4, "greedy"),
        (4, "sampled"),
    ]
    for r in results:
        assert all(r[c] > 0 and math.isfinite(r[c]) for c in bench.COLUMNS), r
        # The split adds up: forward + batch build + sampler + host = the step, and the
        # sampler + host = everything outside extend.
        assert r["fwd_ms"] + r["build_ms"] + r["sample_ms"] + r["host_ms"] == pytest.approx(
            r["ms/step"], rel=1e-6
        )
        assert r["sample_ms"] + r["host_ms"] == pytest.approx(r["outside_ms"], rel=1e-6)
        assert r["kv_pool_tokens"] >= r["batch_size"] * (8 + 1 + 3)
    assert "profile" not in results[0] and "profile" not in results[1]
    assert (
        set(results[2]["profile"])
        == set(results[3]["profile"])
        == {"tottime", "cumulative", "callees"}
    )


@pytest.mark.timeout(60)
def test_sampling_flag_selects_the_modes(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--sampling sampled`` runs seeded top-p requests only: one row per batch size, and
    the sampler's time is its own column."""
    out = tmp_path / "result.json"
    argv = [
        "--batch-sizes",
        "1,4",
        "--sampling",
        "sampled",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--context",
        "8",
    ]
    assert bench.main([*argv, "--torch-threads", "1", "--device", "cpu", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "temperature 0.7, top_p 0.9" in table
    results = json.loads(out.read_text())["results"]
    assert [(r["batch_size"], r["sampling"]) for r in results] == [(1, "sampled"), (4, "sampled")]
    assert all(
        r["sample_ms"] > 0 and r["host_ms"] > 0 and math.isfinite(r["sample_ms"]) for r in results
    )
    with pytest.raises(SystemExit):
        bench.main(["--sampling", "greedy,beam"])


@pytest.mark.timeout(60)
def test_compare_deterministic_prints_both_arms_and_their_ratio(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--compare-deterministic``: a row per (batch size, sampling mode) with each arm's
    median step, tokens/s, the pairs' on/off ratio and the prefill's; ``--deterministic``
    runs the plain table with the mode on."""
    out = tmp_path / "result.json"
    argv = ["--batch-sizes", "2", "--sampling", "greedy", "--steps", "3", "--warmup", "1"]
    argv += ["--context", "8", "--torch-threads", "1", "--device", "cpu"]
    assert bench.main([*argv, "--compare-deterministic", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("batch"))
    row = lines[lines.index(header) + 1].split()
    columns = header.split()[2:]
    assert row[:2] == ["2", "greedy"] and len(row) == 2 + len(columns)
    result = json.loads(out.read_text())["results"][0]
    assert result["steps"] == 3
    for column in columns[1:]:
        assert result[column] > 0 and math.isfinite(result[column]), column
    assert result["off_tok/s"] == pytest.approx(2e3 / result["off_ms"])
    assert bench.main([*argv, "--deterministic", "--json", str(out)]) == 0
    assert "--enable-deterministic-inference" in capsys.readouterr().out
    assert json.loads(out.read_text())["config"]["deterministic"] is True
    with pytest.raises(SystemExit):
        bench.main([*argv, "--compare-deterministic", "--compare-forward"])
