"""Smoke test of the output-path micro benchmark (bench/output_path.py, docs/design.md section 9):
tiny rounds, checks the shape of the table and that every number is positive. It does
not check the targets (timings on a shared CI machine say nothing)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("bench.output_path")


def test_run_returns_every_row_and_column(bench: ModuleType) -> None:
    report = bench.run(requests=16, rounds=3)
    assert list(report["results"]) == list(bench.ROWS)
    for name, row in report["results"].items():
        assert list(row) == list(bench.COLUMNS), name
        assert all(value > 0 for value in row.values()), (name, row)
        assert row["build+encode_us"] >= max(row["build_us"], row["encode_us"])
    for key in ("metrics=on", "metrics=off", "top5 logprobs"):
        assert list(report["ratios"][key]) == list(bench.COLUMNS)
        assert all(value > 0 for value in report["ratios"][key].values())
    assert all(value > 0 for value in report["logprobs_cost"]["metrics=off"].values())
    assert report["metrics_on_off"] > 0
    assert len(report["targets"]) == 7 and all(
        isinstance(t["pass"], bool) for t in report["targets"]
    )
    results = report["results"]
    # Sizes are deterministic: columnar frames do not grow with metrics on (no stats in a
    # steady step), the baseline's time stats lists do.
    assert results["tokenpipe metrics=on"]["msg_KB"] == results["tokenpipe metrics=off"]["msg_KB"]
    assert (
        results["baseline(pickle) metrics=on"]["msg_KB"]
        > results["baseline(pickle) metrics=off"]["msg_KB"]
    )
    # Top-5 logprobs on every row: the logprob columns add exactly 4 (chosen) + 5 x 8 (top
    # ids and values) + 12 (row index, k, ids count) bytes a row, plus their framing.
    extra = (
        results["tokenpipe top5 logprobs"]["msg_KB"] - results["tokenpipe metrics=off"]["msg_KB"]
    )
    assert 16 * 56 / 1000 <= extra < 16 * 56 / 1000 + 0.1, extra
    assert (
        results["baseline(pickle) top5 logprobs"]["msg_KB"]
        > results["baseline(pickle) metrics=off"]["msg_KB"]
    )


def test_main_prints_table_and_writes_json(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    assert bench.main(["--requests", "8", "--rounds", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("variant"))
    assert header.split()[1:] == list(bench.COLUMNS)
    for name in bench.ROWS:
        row = next(line for line in lines if line.startswith(name + " "))
        numbers = [float(v) for v in row[len(name) :].split()]
        assert len(numbers) == len(bench.COLUMNS) and all(v > 0 for v in numbers), row
    for key in ("metrics=on", "metrics=off", "top5 logprobs"):
        row = next(line for line in lines if line.startswith(key))
        assert len(row[len(key) :].split()) == len(bench.COLUMNS)
    cost = lines.index(next(line for line in lines if line.startswith("tokenpipe top5 / without")))
    assert lines[cost + 1].startswith("metrics=off") and all(
        float(v.rstrip("x")) > 0 for v in lines[cost + 1].split()[1:]
    )
    assert sum(("PASS" in line) or ("MISS" in line) for line in lines) == 7
    assert "707" in text and "38.3" in text and "492" in text and "22.3" in text
    data = json.loads(out.read_text())
    assert data["config"] == {**data["config"], "requests": 8, "rounds": 2}
    assert list(data["results"]) == list(bench.ROWS)
