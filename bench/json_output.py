"""``--json PATH`` of the benchmarks that take it: the result written to PATH, or printed
when PATH is ``-``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_json(destination: str | None, result: Any) -> None:
    """Writes ``result`` as indented JSON to ``destination`` (``-``: stdout; None: nowhere)."""
    if not destination:
        return
    text = json.dumps(result, indent=2)
    if destination == "-":
        print(text)
    else:
        Path(destination).write_text(text + "\n")
