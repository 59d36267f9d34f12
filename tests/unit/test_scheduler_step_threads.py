"""``bench/scheduler_step.py --torch-threads 1,2``: a child process per count, its rows merged
into one table with a threads column, each row run at its count. Timings are not judged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import scheduler_step


@pytest.mark.timeout(120)
def test_a_list_of_thread_counts_runs_each_in_its_own_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "result.json"
    argv = ["--batch-sizes", "1,2", "--sampling", "greedy", "--steps", "2", "--warmup", "1"]
    argv += ["--context", "8", "--device", "cpu", "--torch-threads", "2,1"]
    assert scheduler_step.main([*argv, "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "torch_threads=2,1 (a child process per count)" in lines[0]
    header = next(line for line in lines if line.lstrip().startswith("batch"))
    assert header.split()[:3] == ["batch", "sampling", "threads"]
    start = lines.index(header) + 1
    rows = [line.split()[:3] for line in lines[start : start + 4]]
    # Side by side: each (batch size, sampling) at every count, in the order given.
    assert rows == [
        ["1", "greedy", "2"],
        ["1", "greedy", "1"],
        ["2", "greedy", "2"],
        ["2", "greedy", "1"],
    ]
    data = json.loads(out.read_text())
    assert data["config"]["torch_threads"] == [2, 1]
    assert [(r["batch_size"], r["threads"]) for r in data["results"]] == [
        (1, 2),
        (1, 1),
        (2, 2),
        (2, 1),
    ]


def test_a_comparison_takes_one_thread_count() -> None:
    for comparison in ("--compare-forward", "--compare-deterministic"):
        with pytest.raises(SystemExit):
            scheduler_step.main(["--torch-threads", "1,2", comparison])
    with pytest.raises(SystemExit):
        scheduler_step.main(["--torch-threads", "0"])
