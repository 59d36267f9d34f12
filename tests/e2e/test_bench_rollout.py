"""Smoke test of the rollout benchmark (bench/rollout.py) on its real path at tiny sizes: a
one-layer checkpoint pair written by transformers, one update trial, and two rounds of
1.5-second throughput runs (one update in each run with updates). Checks the rows and
fields it reports and its checks, never its timings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.hf_checkpoints import require_transformers


@pytest.mark.timeout(120)
def test_a_tiny_run_reports_every_row_and_passes_its_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The update trial goes to B as step-1, the throughput runs' updates back to A as
    step-2 and to B as step-3 (the second round runs with updates first); every stream
    ends and counts its tokens; the parameter count is the one-layer Llama's (hidden 64,
    2 heads of 32, 1 KV head, MLP 128, vocabulary 4096)."""
    require_transformers()
    from bench import rollout

    out = tmp_path / "r.json"
    argv = ["--sizes", "64x1", "--trials", "1", "--streams", "2", "--max-new-tokens", "16"]
    argv += ["--clients", "2", "--duration", "1.5", "--update-every", "1", "--rounds", "2"]
    argv += ["--workdir", str(tmp_path / "checkpoints"), "--json", str(out)]
    assert rollout.main(argv) == 0

    r = json.loads(out.read_text())
    assert r["ok"] is True
    (size,) = r["sizes"]
    embeddings, attention, mlp = 2 * 4096 * 64, 2 * 64 * 64 + 2 * 64 * 32, 3 * 64 * 128
    assert size["parameters"] == embeddings + attention + mlp + 3 * 64  # + 3 RMSNorms
    assert size["checkpoint_bytes"] >= 4 * size["parameters"]  # float32
    (trial,) = size["trials"]
    assert trial["version"] == trial["fresh_version"] == trial["server_version"] == "step-1"
    assert trial["streams_finished"] == 2 and trial["faults"] == []
    for key in ("pause_to_continue_s", "update_call_s", "pause_call_s", "continue_call_s"):
        assert set(size[key]) == {"median", "min", "max"}, key
    assert size["all_streams_finished"] and size["versions_ok"]
    assert size["server_updates_counted"] == 1

    throughput = size["throughput"]
    rounds = throughput["rounds"]
    assert [row["first"] for row in rounds] == ["without", "with_updates"]
    for row in rounds:
        assert [row["without"]["updates"], row["with_updates"]["updates"]] == [0, 1]
        for run in (row["without"], row["with_updates"]):
            assert run["errors"] == 0 and run["versions_ok"], run
            assert run["tokens"] == run["tokens_finished"] + run["tokens_cut"]
            assert run["tokens_finished"] == 16 * run["requests_finished"]
        assert "ratio" in row
    for key in ("without_tokens_per_s", "with_updates_tokens_per_s", "ratio"):
        assert key in throughput

    table = capsys.readouterr().out
    assert "| 64x1 | 561,344 |" in table
    for k in (1, 2):
        assert f"| {k} | no updates | 0 |" in table and f"| {k} | update every 1 s | 1 |" in table
    assert "with updates / without:" in table and "per round" in table
