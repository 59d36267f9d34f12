"""``--compare-forward``: the decode forward before and after the running batch's dense KV copy
and head-major decode attention, in one run. Each arm runs in a child process of
``bench/scheduler_step.py`` (``--forward before`` or ``after``), the order alternating each
round, so the machine's drift and the other processes' load fall on both; a child per arm
because the allocator setting is process-wide and has no undo."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.scheduler_step_report import COLUMN_HELP, cells, columns_of, header

FORWARD_ARMS = ("before", "after")
STEP_BENCH = Path(__file__).resolve().parent / "scheduler_step.py"


def forward_before_problems() -> list[str]:
    """What ``use_forward_before`` could not find. Checked, not assumed: if the decoder
    stopped calling pool_attention by that name, or the runner the allocator setting or the
    KV copy's budget, "before" would silently run the new forward."""
    from scheduler_proc.model import attention, llama, runner

    problems = [
        f"runner.py has no {name}"
        for name in ("keep_freed_host_memory", "row_kv_budget")
        if not hasattr(runner, name)
    ]
    if getattr(llama, "pool_attention", None) is not attention.pool_attention:
        problems.append("llama.py no longer calls attention.pool_attention by that name")
    return problems


def use_forward_before() -> None:
    """Puts this process's forward back as it was before the dense KV copy: every pass
    through the padded gather and masked SDPA (``attention.padded_attention``), no dense KV
    copy of the running batch (``scheduler_proc.cache.row_kv``), and glibc's default
    allocator thresholds. Call it before the first scheduler is built: a
    ``ModelRunner`` sets the thresholds when it is made, and they cannot be unset."""
    from scheduler_proc.model import attention, llama, runner

    problems = forward_before_problems()
    if problems:
        raise RuntimeError(
            f"--forward before: {'; '.join(problems)}; "
            "update use_forward_before in bench/scheduler_step_forward.py"
        )

    def padded_everywhere(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        layer: int,
    ) -> torch.Tensor:
        return attention.padded_attention(q, k, v, layout, k_cache, v_cache, scale)

    def default_thresholds() -> bool:
        return False

    def no_row_kv(config: Any, device: Any) -> int:
        return 0

    # setattr: swapping a module's function is what the types forbid.
    for owner, name, value in (
        (llama, "pool_attention", padded_everywhere),
        (runner, "keep_freed_host_memory", default_thresholds),
        (runner, "row_kv_budget", no_row_kv),
    ):
        setattr(owner, name, value)


def compare_forward(child_args: list[str], rounds: int) -> dict[str, Any]:
    """Runs ``bench/scheduler_step.py`` with ``--forward before`` and ``--forward after``
    (and ``child_args``) in child processes, ``rounds`` times, the order alternating."""
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    reports: dict[str, list[dict[str, Any]]] = {arm: [] for arm in FORWARD_ARMS}
    with tempfile.TemporaryDirectory(prefix="scheduler_step_") as tmp:
        for r in range(rounds):
            for arm in FORWARD_ARMS if r % 2 == 0 else FORWARD_ARMS[::-1]:
                out = Path(tmp) / f"{arm}-{r}.json"
                cmd = [
                    sys.executable,
                    str(STEP_BENCH),
                    *child_args,
                    "--forward",
                    arm,
                    "--json",
                    str(out),
                ]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                reports[arm].append(json.loads(out.read_text()))
    return {"rounds": rounds, "arms": reports}


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The arm's median round, by tokens/s."""
    ranked = sorted(rows, key=lambda r: r["tokens/s"])
    return ranked[(len(ranked) - 1) // 2]


def ratio_line(
    row: dict[str, Any], after: list[dict[str, Any]], before: list[dict[str, Any]]
) -> str:
    """The after/before tokens/s of each round (its two arms ran back to back) and their
    median."""
    rounds = [a["tokens/s"] / b["tokens/s"] for a, b in zip(after, before)]
    each = ", ".join(f"{x:.2f}" for x in rounds)
    return (
        f"B={row['batch_size']} {row['sampling']}: "
        f"{statistics.median(rounds):.2f}x (rounds: {each})"
    )


def format_comparison(comparison: dict[str, Any]) -> str:
    """Each arm's median row (by tokens/s over the rounds) per batch size and sampling, then
    the after/before tokens/s ratio of each round and their median."""
    arms: dict[str, list[dict[str, Any]]] = comparison["arms"]
    first = arms["after"][0]
    columns = columns_of(first["config"])
    lines = [
        *header(first),
        f"forward before/after (dense KV copy and head-major decode attention): "
        f"{comparison['rounds']} rounds, the arms alternating in child processes; "
        "before = padded gather + masked SDPA, glibc default allocator thresholds; "
        "each row is the arm's median round",
        "",
        "batch".rjust(6) + f"{'sampling':>10}{'forward':>9}" + "".join(f"{c:>12}" for c in columns),
    ]
    ratios: list[str] = []
    for i, row in enumerate(first["results"]):
        per_arm = {arm: [report["results"][i] for report in arms[arm]] for arm in FORWARD_ARMS}
        for arm in FORWARD_ARMS:
            median = median_row(per_arm[arm])
            lines.append(
                f"{median['batch_size']:>6d}{median['sampling']:>10}{arm:>9}"
                + cells(median, columns)
            )
        ratios.append(ratio_line(row, per_arm["after"], per_arm["before"]))
    lines += [
        "",
        "after/before tokens/s, median of the rounds' ratios: " + "; ".join(ratios),
        "",
        COLUMN_HELP,
    ]
    return "\n".join(lines)


def child_args(args: argparse.Namespace) -> list[str]:
    """The flags a --compare-forward child runs with: this run's, without the comparison."""
    out = [
        "--batch-sizes", ",".join(map(str, args.batch_sizes)),
        "--sampling", ",".join(args.sampling),
        "--steps", str(args.steps),
        "--max-seconds", str(args.max_seconds),
        "--warmup", str(args.warmup),
        "--context", str(args.context),
        "--device", args.device,
        "--seed", str(args.seed),
    ]  # fmt: skip
    if args.torch_threads is not None:
        out += ["--torch-threads", str(args.torch_threads)]
    if args.model_path is not None:
        out += ["--model-path", args.model_path]
    if args.constrained:
        out.append("--constrained")
    if args.deterministic:
        out.append("--deterministic")
    return out
