"""scripts/train_tokenizer.py, run as a program, writes exactly the shipped tokenizer files
(the unit tests of pipeline.tokenizer_loader are in tests/unit/test_tokenizer_loader.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pipeline.tokenizer_loader import DEFAULT_TOKENIZER_DIR
from tests.server_harness import REPO

TRAIN_SCRIPT = REPO / "scripts" / "train_tokenizer.py"


def test_training_reproduces_shipped_files(tmp_path: Path) -> None:
    """The shipped assets must be exactly what the script produces (takes a few seconds)."""
    subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_TOKENIZER_DIR / name).read_bytes(), name
