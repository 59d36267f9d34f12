"""Smoke test of bench/serve.py --lora-adapters N --compare-lora against the servers it
launches itself (a LoRA server and a base one): tiny numbers; checks the JSON, the printed
table and that the server counted the requests each adapter ran. It does not judge the
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
    pytest.importorskip("tqdm")
    pytest.importorskip("matplotlib")
    return importlib.import_module("bench.serve")


@pytest.mark.timeout(120)
def test_compare_lora_reports_both_arms_and_the_adapters_requests(
    bench: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "r.json"
    argv = ["--launch", "--concurrency", "4", "--requests", "9", "--max-new-tokens", "8"]
    argv += ["--stream-ratio", "1", "--lora-adapters", "2", "--lora-rank", "8", "--compare-lora"]
    argv += ["--no-progress", "--json", str(out), "--server-args", "--max-total-tokens 4096"]
    assert bench.main(argv) == 0

    r = json.loads(out.read_text())
    names = ["bench-lora-0", "bench-lora-1"]
    assert r["config"]["lora_names"] == [*names, None]
    assert r["errors"] == 0 and r["tokens_lost"] == 0 and r["output_tokens"] == 9 * 8
    lora = r["lora"]
    assert lora["adapters"] == names and lora["rank"] == 8
    assert lora["errors"] == 0 and lora["tokens_lost"] == 0
    assert [row["first"] for row in lora["rounds"]] == ["base", "lora"]
    for row in lora["rounds"]:
        assert row["base"]["output_tokens"] == row["lora"]["output_tokens"] == 9 * 8
        assert 0 < row["ratio"] < math.inf
    assert 0 < lora["base_output_tokens_per_s"] < math.inf
    assert 0 < lora["lora_output_tokens_per_s"] < math.inf
    assert 0 < lora["ratio"] < math.inf
    # Request i names names[i % 3] (the third: the base), in the main run and each LoRA round:
    # 3 requests per adapter in each of those 3 runs, as the server counted them.
    assert lora["adapter_requests"] == {name: 9 for name in names}

    table = capsys.readouterr().out
    assert "in turn over bench-lora-0, bench-lora-1, base" in table
    for label in ("base against LoRA", "base tok/s", "lora tok/s", "lora/base", "median"):
        assert label in table
    assert "PASS" in table or "MISS" in table
    assert "finished requests per adapter (the LoRA server's /metrics): bench-lora-0 9" in table


def test_lora_flags_are_checked(bench: ModuleType) -> None:
    for argv in (
        ["--compare-lora"],  # needs --lora-adapters
        ["--lora-adapters", "2"],  # needs --launch
        ["--launch", "--lora-adapters", "0"],
        ["--launch", "--lora-adapters", "2", "--server-args", "--max-loras 4"],
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
