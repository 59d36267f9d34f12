"""Smoke test of the scheduler decode-step benchmark (bench/scheduler_step.py): tiny
batch sizes and steps; checks the machine header, the table's rows and columns, that
every number is positive, the profile sections and the JSON. It does not judge the
timings (a shared CI machine says nothing about them)."""

from __future__ import annotations

import importlib
import json
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
    argv = ["--batch-sizes", "1,4", "--steps", "3", "--warmup", "1", "--context", "8", "--torch-threads", "1"]
    assert bench.main([*argv, "--device", "cpu", "--profile", "--profile-steps", "2", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()

    machine = lines[0]
    assert machine.startswith("machine:")
    for key in ("cpu_count=", "torch_threads=1", "torch ", "device=cpu"):
        assert key in machine, machine

    header = next(line for line in lines if line.lstrip().startswith("batch"))
    assert header.split() == ["batch", *bench.COLUMNS]
    start = lines.index(header) + 1
    rows = [line.split() for line in lines[start : start + 2]]
    assert [int(row[0]) for row in rows] == [1, 4]
    for row in rows:
        numbers = [float(v) for v in row[1:]]
        assert len(numbers) == len(bench.COLUMNS) and all(v > 0 for v in numbers), row
        values = dict(zip(bench.COLUMNS, numbers))
        assert values["steps"] == 3
        assert 0 < values["outside_%"] < 100
    tokens_per_s = {int(row[0]): float(row[1 + bench.COLUMNS.index("tokens/s")]) for row in rows}
    steps_per_s = {int(row[0]): float(row[1 + bench.COLUMNS.index("steps/s")]) for row in rows}
    for b in (1, 4):  # tokens/s = B * steps/s (up to the table's rounding)
        assert tokens_per_s[b] == pytest.approx(b * steps_per_s[b], rel=0.01, abs=0.2)
    # The largest batch size is profiled.
    assert any(line.startswith("cProfile, B=4: top entries by own time") for line in lines)
    assert any("scheduler.py" in line and "(step)" in line for line in lines)

    data = json.loads(out.read_text())
    assert data["config"]["batch_sizes"] == [1, 4] and data["config"]["context"] == 8
    assert data["machine"]["torch_threads"] == 1 and data["machine"]["device"] == "cpu"
    results = data["results"]
    assert [r["batch_size"] for r in results] == [1, 4]
    for r in results:
        assert all(r[c] > 0 for c in bench.COLUMNS), r
        # The split adds up: forward + batch build + outside = the step.
        assert r["fwd_ms"] + r["build_ms"] + r["outside_ms"] == pytest.approx(r["ms/step"], rel=1e-6)
        assert r["kv_pool_tokens"] >= r["batch_size"] * (8 + 1 + 3)
    assert "profile" not in results[0] and set(results[1]["profile"]) == {"tottime", "cumulative", "callees"}
