"""The task's documents, read from the JSONL beside this file: lm-eval's ``dataset_path:
json`` with ``data_files`` resolves a relative path against the working directory, not the
YAML, so the task would only load when run from here."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

QUESTIONS = Path(__file__).with_name("questions.jsonl")


def load(**_metadata: object) -> datasets.DatasetDict:
    """lm-eval's ``custom_dataset`` hook; it passes the task's metadata, unused here."""
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
