"""``--torch-threads 1,2``: the step table at several torch thread counts, one child process of
``bench/scheduler_step.py`` per count, in the order given, merged into one report whose rows
are ordered by batch size, sampling mode, then thread count.

A child per count, not ``torch.set_num_threads`` between counts in one process: the first
count's run would hand the next its OpenMP pool (threads once started stay), a heap shaped
under the allocator thresholds the runner sets (process-wide, no undo) and warm imports and
caches, so each later count would start from another state than the first.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.scheduler_step_forward import STEP_BENCH, child_args


def sweep_args(args: argparse.Namespace) -> list[str]:
    """The flags every child runs with: this run's, less the thread counts and the JSON."""
    plain = copy.copy(args)
    plain.torch_threads = None
    out = child_args(plain) + ["--forward", args.forward]
    out += ["--op-steps", str(args.op_steps)] + (["--op-groups"] if args.op_groups else [])
    if args.profile:
        out += ["--profile", "--profile-steps", str(args.profile_steps)]
        out += ["--profile-top", str(args.profile_top)]
    return out


def sweep_threads(base: list[str], counts: Sequence[int]) -> dict[str, Any]:
    """Runs ``bench/scheduler_step.py`` with ``base`` once per thread count, each in its own
    child process; returns the merged report."""
    reports = []
    with tempfile.TemporaryDirectory(prefix="scheduler_step_threads_") as tmp:
        for n in counts:
            out = Path(tmp) / f"threads-{n}.json"
            cmd = [sys.executable, str(STEP_BENCH), *base, "--torch-threads", str(n)]
            subprocess.run([*cmd, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
            reports.append(json.loads(out.read_text()))
    return merge(reports, counts)


def merge(reports: Sequence[dict[str, Any]], counts: Sequence[int]) -> dict[str, Any]:
    """One report: the first's header, every count's rows side by side (each report runs the
    same (batch size, sampling) rows in the same order)."""
    merged = copy.deepcopy(reports[0])
    merged["config"]["torch_threads"] = list(counts)
    merged["machine"]["torch_threads"] = ",".join(
        str(r["machine"]["torch_threads"]) for r in reports
    )
    merged["machine"]["threads_note"] = "a child process per count"
    rows = [r["results"] for r in reports]
    if len({len(r) for r in rows}) != 1:
        raise RuntimeError("the thread counts' children ran different rows")
    merged["results"] = [report_rows[i] for i in range(len(rows[0])) for report_rows in rows]
    return merged
