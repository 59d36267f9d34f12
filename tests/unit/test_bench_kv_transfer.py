"""Smoke test of the PD KV transfer benchmark (bench/kv_transfer.py): tiny lengths and
rounds over both transports; checks the table and the JSON, that every figure is positive,
and that the KV size is what the model's layout says. It does not judge the timings."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest


@pytest.mark.timeout(120)
def test_prints_both_transports_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = importlib.import_module("bench.kv_transfer")
    out = tmp_path / "kv.json"
    assert (
        bench.main(
            ["--lengths", "8,32", "--rounds", "2", "--torch-threads", "1", "--json", str(out)]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "transport=ipc" in text and "transport=tcp" in text
    result = json.loads(out.read_text())
    assert set(result) == {"ipc", "tcp"}
    for rows in result.values():
        assert [row["tokens"] for row in rows] == [8, 32]
        assert all(row[c] > 0 for row in rows for c in bench.COLUMNS)
        # K and V, float32, of every layer and KV head: 32 tokens hold 4x the bytes of 8.
        assert rows[1]["kv_MB"] == pytest.approx(4 * rows[0]["kv_MB"])
