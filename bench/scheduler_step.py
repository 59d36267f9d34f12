"""Scheduler decode-step benchmark: the scheduler alone, no sockets.

For each batch size and sampling mode a fresh scheduler (``build_scheduler``) decodes B
streamed requests that never finish during the run; each timed ``Scheduler.step()`` is split
into the model forward, the batch build, the sampler and the host work left;
``--torch-threads 1,2`` runs each count in a child process, ``--op-groups`` splits the forward
by op group. ``--constrained`` adds the grammar's cost per step, ``--profile`` a cProfile of the
largest batch, ``--compare-forward`` the forward before and after the dense KV copy,
``--compare-deterministic`` the step with deterministic inference off and on, ``--lora`` the
step with requests bound to 0, 1 and 4 LoRA adapters. The jobs live in
``bench.scheduler_step_workload``, ``_timers``, ``_run``, ``_report``, ``_ops``, ``_threads``,
``_forward``, ``_deterministic`` and ``_lora``; this module reads the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.scheduler_step_deterministic import (  # noqa: E402
    compare_deterministic,
    format_deterministic,
)
from bench.scheduler_step_forward import (  # noqa: E402
    FORWARD_ARMS,
    child_args,
    compare_forward,
    format_comparison,
    use_forward_before,
)
from bench.scheduler_step_report import (  # noqa: E402
    COLUMNS,
    GRAMMAR_COLUMNS,
    format_report,
)
from bench.scheduler_step_lora import DEFAULT_COUNTS, OFF, compare_lora, format_lora  # noqa: E402
from bench.scheduler_step_run import run  # noqa: E402
from bench.scheduler_step_threads import sweep_args, sweep_threads  # noqa: E402
from bench.scheduler_step_workload import (  # noqa: E402
    SAMPLED_TEMPERATURE,
    SAMPLED_TOP_P,
    SAMPLING_MODES,
)

__all__ = ["COLUMNS", "GRAMMAR_COLUMNS", "main"]


def _positive_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be positive integers")
    return values


def _batch_sizes(text: str) -> list[int]:
    return _positive_ints(text, "batch sizes")


def _thread_counts(text: str) -> list[int]:
    # In the order given, each once.
    return list(dict.fromkeys(_positive_ints(text, "torch thread counts")))


def _samplings(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [m for m in modes if m not in SAMPLING_MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(SAMPLING_MODES)}; got {text!r}"
        )
    return list(dict.fromkeys(modes))  # in the order given, each once


def _lora_counts(text: str) -> list[str]:
    """Adapter counts (and ``off``), in the order given, each once; 0 must be one of them."""
    counts = list(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    if any(c != OFF and not (c.isdigit() and int(c) >= 0) for c in counts) or "0" not in counts:
        raise argparse.ArgumentTypeError(
            f"expected a comma list of adapter counts (and {OFF}) that includes 0; got {text!r}"
        )
    return [c if c == OFF else str(int(c)) for c in counts]


def add_lora_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora",
        action="store_true",
        help="time the step with its requests spread over LoRA adapters (--lora-counts), "
        "schedulers in this process taking turns step by step; print each and its ratio to 0",
    )
    parser.add_argument(
        "--lora-counts",
        type=_lora_counts,
        default=list(DEFAULT_COUNTS),
        help=f"--lora: adapter counts to time, and {OFF} for a scheduler without "
        "--enable-lora; must include 0 (default %(default)s)",
    )
    parser.add_argument(
        "--lora-rank", type=int, default=16, help="--lora: the adapters' rank (default 16)"
    )
    parser.add_argument(
        "--lora-slots",
        type=int,
        default=None,
        metavar="N",
        help="--lora: every LoRA arm's --max-loras (default: its adapter count, at least 1)",
    )


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--batch-sizes", type=_batch_sizes, default=[1, 16, 64, 256], help="default 1,16,64,256"
    )
    parser.add_argument(
        "--sampling",
        type=_samplings,
        default=list(SAMPLING_MODES),
        help=f"comma list of greedy (temperature 0) and sampled (temperature "
        f"{SAMPLED_TEMPERATURE}, top_p {SAMPLED_TOP_P}, a seed per request); "
        "default greedy,sampled",
    )
    parser.add_argument(
        "--constrained",
        action="store_true",
        help="every request follows a nested JSON schema; adds the grammar's cost per step",
    )
    parser.add_argument(
        "--steps", type=int, default=50, help="timed decode steps per batch size (default 50)"
    )
    parser.add_argument(
        "--max-seconds",
        type=float,
        default=60.0,
        help="stop timing a batch size after this (default 60)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="decode steps after every request is decoding (default 3)",
    )
    parser.add_argument(
        "--context", type=int, default=32, help="prompt tokens per request (default 32)"
    )


def add_machine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--torch-threads",
        type=_thread_counts,
        default=None,
        metavar="N[,N...]",
        help="torch intra-op threads; a comma list runs each count in its own child process "
        "and the table gets a row per count; default: the server's (cores - 2, at least 1)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="serve this checkpoint instead of the built-in model",
    )


def add_forward_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compare-forward",
        action="store_true",
        help="time the forward before and after the dense KV copy and head-major decode "
        "attention in alternating child processes; print both and the ratio",
    )
    parser.add_argument(
        "--compare-deterministic",
        action="store_true",
        help="time the step with --enable-deterministic-inference off and on, two schedulers "
        "in this process taking turns step by step; print both and the ratio",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="--compare-forward: rounds of both arms (default 3)"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="build the schedulers with --enable-deterministic-inference",
    )
    parser.add_argument(
        "--forward",
        choices=FORWARD_ARMS,
        default="after",
        help="before: the padded-SDPA forward with glibc's default allocator thresholds; "
        "after (default): as the code is",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_flags(parser)
    add_machine_flags(parser)
    add_forward_flags(parser)
    add_lora_flags(parser)
    parser.add_argument(
        "--op-groups",
        action="store_true",
        help="after the timed steps, split the forward by op group (module hooks and wrapped "
        "functions, bench/scheduler_step_ops.py): --op-steps steps with the hooks and as many "
        "without, alternating; prints ms a step and %% of the hooked forward per group",
    )
    parser.add_argument(
        "--op-steps", type=int, default=30, help="--op-groups: steps of each arm (default 30)"
    )
    parser.add_argument(
        "--profile", action="store_true", help="cProfile extra steps of the largest batch size"
    )
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write the results as JSON"
    )
    return parser


def write_json(path: Path | None, data: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")


def one_count(parser: argparse.ArgumentParser, counts: list[int] | None) -> int | None:
    """The single thread count of a run that takes one (None: the server's)."""
    if counts is not None and len(counts) > 1:
        parser.error("--compare-forward, --compare-deterministic, --lora take one --torch-threads")
    return None if counts is None else counts[0]


def compare_in_turns(args: argparse.Namespace) -> dict[str, Any]:
    """``--compare-deterministic`` or ``--lora``: schedulers in this process taking turns."""
    common: dict[str, Any] = {
        "samplings": args.sampling,
        "steps": args.steps,
        "context": args.context,
        "warmup": args.warmup,
        "torch_threads": args.torch_threads,
        "device": args.device,
        "seed": args.seed,
        "model_path": args.model_path,
    }
    if args.lora:
        return compare_lora(
            args.batch_sizes,
            counts=args.lora_counts,
            rank=args.lora_rank,
            slots=args.lora_slots,
            **common,
        )
    return compare_deterministic(args.batch_sizes, **common)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    counts: list[int] | None = args.torch_threads
    comparing = args.compare_forward or args.compare_deterministic or args.lora
    if counts is not None and len(counts) > 1 and not comparing:
        report = sweep_threads(sweep_args(args), counts)
        print(format_report(report))
        write_json(args.json, report)
        return 0
    args.torch_threads = one_count(parser, counts)
    if args.compare_forward:
        if args.profile or args.compare_deterministic or args.lora:
            parser.error(
                "--compare-forward runs alone: no --profile, --compare-deterministic, --lora"
            )
        comparison = compare_forward(child_args(args), args.rounds)
        print(format_comparison(comparison))
        write_json(args.json, comparison)
        return 0
    if args.compare_deterministic or args.lora:
        if (
            args.profile
            or args.constrained
            or args.deterministic
            or args.compare_deterministic == args.lora
        ):
            parser.error("--compare-deterministic and --lora run alone, unconstrained, unprofiled")
        report = compare_in_turns(args)
        print(format_lora(report) if args.lora else format_deterministic(report))
        write_json(args.json, report)
        return 0
    if args.forward == "before":
        use_forward_before()
    report = run(
        args.batch_sizes,
        samplings=args.sampling,
        steps=args.steps,
        context=args.context,
        warmup=args.warmup,
        max_seconds=args.max_seconds,
        torch_threads=args.torch_threads,
        device=args.device,
        profile=args.profile,
        profile_steps=args.profile_steps,
        profile_top=args.profile_top,
        seed=args.seed,
        constrained=args.constrained,
        model_path=args.model_path,
        deterministic=args.deterministic,
        op_steps=args.op_steps if args.op_groups else 0,
    )
    print(format_report(report))
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
