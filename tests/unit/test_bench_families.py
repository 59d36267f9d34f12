"""bench/families.py end to end on its smallest run: the Llama baseline's checkpoint written by
transformers, served by scheduler_step.py --model-path in a child process, read back into
the table."""

from __future__ import annotations

from bench import families
from tests.hf_checkpoints import require_transformers


def test_a_one_family_run_reports_its_steps_against_itself() -> None:
    require_transformers()
    report = families.run(["llama"], [4], rounds=1, steps=2)
    (row,) = report["rows"]
    assert (row["family"], row["batch_size"]) == ("llama", 4)
    assert row["tokens_per_s"] > 0 and row["ms_per_step"] > row["fwd_ms"] > 0
    assert row["vs_llama"] == 1.0
    assert "   llama      4" in families.format_report(report)
