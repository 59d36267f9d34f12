"""Smoke tests of the LoRA benchmarks' parts that need no server: the PEFT-format adapters
bench/lora_adapters.py writes (read back by the server's own reader), the request bodies that
name them, and bench/scheduler_step.py --lora on tiny batches (the table's rows and figures,
the JSON). They do not judge the timings (a shared CI machine says nothing about them)."""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

from bench.lora_adapters import served_model_config, server_flags, write_adapters
from bench.serve_client import LoadConfig, make_body
from scheduler_proc.lora.adapter_files import PROJECTIONS, read_adapter


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return importlib.import_module("bench.scheduler_step")


def test_written_adapters_are_read_by_the_server(tmp_path: Path) -> None:
    adapters = write_adapters(tmp_path, 2, 8, None, seed=3)
    assert list(adapters) == ["bench-lora-0", "bench-lora-1"]
    cfg = served_model_config(None)
    weights = [read_adapter(path, cfg, max_rank=8) for path in adapters.values()]
    for w in weights:
        assert w.rank == 8 and w.scaling == 2.0  # lora_alpha is twice the rank
        assert set(w.pairs) == {(i, p) for i in range(cfg.num_hidden_layers) for p in PROJECTIONS}
    # Seeded per adapter: the two differ.
    assert not weights[0].pairs[0, "q_proj"].a.equal(weights[1].pairs[0, "q_proj"].a)
    flags = server_flags(adapters, 8)
    assert flags[:2] == ["--enable-lora", "--lora-modules"]
    assert flags[-4:] == ["--max-loras", "2", "--max-lora-rank", "8"]


def test_requests_name_their_adapter_in_turn() -> None:
    names = ("a", "b", None)
    for api, key in (("generate", "lora_path"), ("completions", "model"), ("chat", "model")):
        cfg = LoadConfig(api=api, lora_names=names)
        bodies = [make_body(i, cfg, 4096, True) for i in range(6)]
        assert [body.get(key) for body in bodies] == ["a", "b", None] * 2
    plain = make_body(0, LoadConfig(), 4096, True)
    assert "lora_path" not in plain and "model" not in plain


@pytest.mark.timeout(120)
def test_lora_prints_a_row_per_arm_and_batch(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "lora.json"
    argv = ["--lora", "--lora-counts", "off,0,1,2", "--lora-rank", "4", "--batch-sizes", "1,4"]
    argv += ["--sampling", "greedy", "--steps", "3", "--warmup", "1", "--context", "8"]
    assert bench.main([*argv, "--torch-threads", "1", "--device", "cpu", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("machine:") and "torch_threads=1" in lines[0]
    columns = importlib.import_module("bench.scheduler_step_lora").COLUMNS
    header = next(line for line in lines if line.lstrip().startswith("adapters"))
    assert header.split() == ["adapters", "batch", "sampling", *columns]
    start = lines.index(header) + 1
    rows = [line.split() for line in lines[start : start + 8]]
    assert [(row[0], int(row[1])) for row in rows] == [
        (arm, b) for b in (1, 4) for arm in ("off", "0", "1", "2")
    ]
    for row in rows:
        assert row[2] == "greedy"
        values = dict(zip(columns, (float(v) for v in row[3:])))
        assert values["steps"] == 3
        assert all(v > 0 and math.isfinite(v) for v in values.values()), row
        if row[0] == "0":
            assert values["x0"] == 1.0

    data = json.loads(out.read_text())
    assert data["config"]["counts"] == ["off", "0", "1", "2"] and data["config"]["rank"] == 4
    assert data["config"]["slots"] is None  # each arm's --max-loras is its count
    results = data["results"]
    assert len(results) == 8
    for r in results:
        assert r["tok/s"] == pytest.approx(r["batch_size"] * 1e3 / r["step_ms"])
        assert r["fwd_ms"] < r["step_ms"]  # each step's forward is part of it


def test_lora_counts_must_include_zero(bench: ModuleType) -> None:
    for bad in ("1,4", "0,x", "0,-1"):
        with pytest.raises(SystemExit):
            bench.main(["--lora", "--lora-counts", bad])
