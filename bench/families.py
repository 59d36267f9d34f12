"""Decode step time of each model family beside the Llama baseline of the same size.

Writes one checkpoint per family with ``bench/family_checkpoints.py`` (transformers' own
configs; the default model's shape: hidden 256, 4 layers, heads 8/4, the shipped
vocabulary), then runs ``bench/scheduler_step.py --model-path DIR`` on each, greedy, at
``--batch-sizes`` (default 64,256), each in its own child process. Families alternate within
each of ``--rounds`` rounds, so a slow spell of a noisy machine falls on all of them; the
table gives each family's median over rounds and its ratio to ``llama`` (the plain Llama
checkpoint, same size) from the same run.

Usage: ``python bench/families.py [--families llama,llama3,qwen2,qwen3,mistral]
[--batch-sizes 64,256] [--rounds 3] [--steps 20] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import family_checkpoints  # noqa: E402

BASELINE = "llama"
STEP_BENCH = Path(__file__).resolve().parent / "scheduler_step.py"


def _one_run(
    directory: Path, batch_sizes: Sequence[int], steps: int, out: Path
) -> list[dict[str, Any]]:
    command = [
        sys.executable, str(STEP_BENCH), "--model-path", str(directory), "--sampling", "greedy",
        "--batch-sizes", ",".join(map(str, batch_sizes)), "--steps", str(steps), "--json", str(out),
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    rows: list[dict[str, Any]] = json.loads(out.read_text())["results"]
    return rows


def run(
    families: Sequence[str], batch_sizes: Sequence[int], rounds: int, steps: int
) -> dict[str, Any]:
    if BASELINE not in families:
        families = [BASELINE, *families]
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="tp-families-") as tmp:
        dirs = {f: Path(tmp) / f for f in families}
        for family, directory in dirs.items():
            family_checkpoints.write(directory, family)
        for r in range(rounds):
            order = list(families) if r % 2 == 0 else list(reversed(families))
            for family in order:
                for row in _one_run(
                    dirs[family], batch_sizes, steps, Path(tmp) / f"{family}-{r}.json"
                ):
                    samples.setdefault((family, row["batch_size"]), []).append(
                        {
                            "ms_per_step": row["ms/step"],
                            "tokens_per_s": row["tokens/s"],
                            "fwd_ms": row["fwd_ms"],
                        }
                    )
    table = []
    for (family, b), runs in sorted(
        samples.items(), key=lambda kv: (kv[0][1], families.index(kv[0][0]))
    ):
        tokens = statistics.median(x["tokens_per_s"] for x in runs)
        base = statistics.median(x["tokens_per_s"] for x in samples[(BASELINE, b)])
        table.append(
            {
                "family": family,
                "batch_size": b,
                "ms_per_step": statistics.median(x["ms_per_step"] for x in runs),
                "fwd_ms": statistics.median(x["fwd_ms"] for x in runs),
                "tokens_per_s": tokens,
                "vs_llama": tokens / base,
            }
        )
    return {
        "families": list(families),
        "batch_sizes": list(batch_sizes),
        "rounds": rounds,
        "steps": steps,
        "rows": table,
    }


def format_report(report: dict[str, Any]) -> str:
    lines = [
        f"decode step per family, default model size (hidden 256, 4 layers, heads 8/4), greedy, "
        f"median of {report['rounds']} alternating rounds of {report['steps']} steps",
        "",
        f"{'family':>8}{'batch':>7}{'ms/step':>10}{'fwd_ms':>10}{'tokens/s':>11}{'vs_llama':>10}",
    ]
    for row in report["rows"]:
        lines.append(
            f"{row['family']:>8}{row['batch_size']:>7d}"
            f"{row['ms_per_step']:>10.3f}{row['fwd_ms']:>10.3f}"
            f"{row['tokens_per_s']:>11.1f}{row['vs_llama']:>9.3f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(family_checkpoints.FAMILIES))
    p.add_argument("--batch-sizes", default="64,256")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(families) - set(family_checkpoints.FAMILIES))
    if unknown:
        p.error(f"unknown families {unknown}; choose from {', '.join(family_checkpoints.FAMILIES)}")
    report = run(families, [int(b) for b in args.batch_sizes.split(",")], args.rounds, args.steps)
    print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
