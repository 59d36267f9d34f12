"""Smoke test of ``bench/scheduler_step.py --constrained``: every row follows the nested JSON
schema, each step stays a pure decode of every row (no answer ends during the run), and the
table and the JSON add the grammar's columns, whose parts add up. It does not judge the
timings (a shared CI machine says nothing about them)."""

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
def test_constrained_rows_add_the_grammar_columns(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = [
        "--constrained",
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
    assert bench.main([*argv, "--device", "cpu", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "every row constrained by a nested JSON schema" in lines[2]
    header = next(line for line in lines if line.lstrip().startswith("batch"))
    assert header.split() == [
        "batch",
        "sampling",
        "threads",
        *bench.COLUMNS,
        *bench.GRAMMAR_COLUMNS,
    ]
    assert any(
        line.startswith("--constrained: every row follows a nested JSON schema") for line in lines
    )

    data = json.loads(out.read_text())
    assert data["config"]["constrained"] is True
    results = data["results"]
    assert [(r["batch_size"], r["sampling"]) for r in results] == [
        (1, "greedy"),
        (1, "sampled"),
        (4, "greedy"),
        (4, "sampled"),
    ]
    for r in results:
        assert r["constrained"] is True and r["steps"] == 3
        grammar = [r[c] for c in bench.GRAMMAR_COLUMNS]
        assert all(v > 0 and math.isfinite(v) for v in grammar), r
        assert r["fill_ms"] + r["apply_ms"] + r["accept_ms"] == pytest.approx(
            r["grammar_ms"], rel=1e-6
        )
        # The apply runs inside the sampler, the fill and the accept in the host work.
        assert r["apply_ms"] <= r["sample_ms"] and r["fill_ms"] + r["accept_ms"] <= r["host_ms"]
