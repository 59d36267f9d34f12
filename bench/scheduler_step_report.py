"""The scheduler decode-step benchmark's printed table: the machine and model header, a row
per (batch size, sampling mode, torch threads), what each column holds, the op-group tables
(``bench.scheduler_step_ops``) and the profile sections."""

from __future__ import annotations

from typing import Any

from bench.scheduler_step_ops import format_op_groups, lead_header, row_label
from bench.scheduler_step_workload import SAMPLED_TEMPERATURE, SAMPLED_TOP_P

COLUMNS = (
    "steps",
    "steps/s",
    "tokens/s",
    "ms/step",
    "p50_ms",
    "fwd_ms",
    "build_ms",
    "sample_ms",
    "host_ms",
    "outside_ms",
    "outside_%",
)
COLUMN_HELP = (
    "threads: torch intra-op threads; steps: timed steps; ms/step: mean; p50_ms: median step; "
    "fwd_ms: model.forward; "
    "build_ms: ForwardBatch build (extend minus forward); sample_ms: runner.sample (the sampler's "
    "tensor math); host_ms: step time outside extend and sample (scheduling, slot bookkeeping, "
    "stop checks, output frame); outside_ms / outside_%: step time outside runner.extend "
    "(sample_ms + host_ms). Host time outside the forward is build_ms + host_ms."
)
GRAMMAR_COLUMNS = ("fill_ms", "apply_ms", "accept_ms", "grammar_ms")
GRAMMAR_HELP = (
    "--constrained: every row follows a nested JSON schema. fill_ms: the constrained rows' "
    "bitmask (TokenMasks.fill, in host_ms); apply_ms: the masked copy of the logits "
    "(GrammarMask.apply, in sample_ms); accept_ms: the drawn tokens into the matchers "
    "(TokenMasks.accept, in host_ms); grammar_ms: their sum."
)


def columns_of(config: dict[str, Any]) -> tuple[str, ...]:
    """The table's columns: the grammar's added when every row was constrained."""
    return COLUMNS + (GRAMMAR_COLUMNS if config.get("constrained") else ())


def digits(column: str) -> int:
    return 1 if column in ("steps/s", "tokens/s", "outside_%") else 3


def cells(row: dict[str, Any], columns: tuple[str, ...]) -> str:
    """A row's figures, right-aligned under ``columns`` (the first is the step count)."""
    figures = [f"{row['steps']:>12d}"] + [f"{row[c]:>12.{digits(c)}f}" for c in columns[1:]]
    return "".join(figures)


def machine_and_model(report: dict[str, Any]) -> list[str]:
    """The machine and the model a report ran on: two lines."""
    m, model = report["machine"], report["model"]
    return [
        f"machine: cpu_count={m['cpu_count']} (usable {m['cpus_usable']}), "
        f"torch_threads={m['torch_threads']}"
        + (f" ({m['threads_note']})" if "threads_note" in m else "")
        + f", torch {m['torch']}, device={m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + (f", python {m['python']}" if "python" in m else ""),
        f"model: {model['name']}, hidden {model['hidden']}, {model['layers']} layers, "
        f"heads {model['heads']}, vocab {model['vocab']}",
    ]


def header(report: dict[str, Any]) -> list[str]:
    """The machine, the model and the workload: three lines."""
    cfg = report["config"]
    constrained = (
        "; every row constrained by a nested JSON schema" if cfg.get("constrained") else ""
    ) + ("; --enable-deterministic-inference" if cfg.get("deterministic") else "")
    return [
        *machine_and_model(report),
        f"scheduler decode step: prompt {cfg['context']} tokens, {cfg['warmup']} warm-up + up to "
        f"{cfg['steps']} timed steps per batch size and sampling (at most "
        f"{cfg['max_seconds']:g} s), stream_interval 1; sampled: temperature "
        f"{SAMPLED_TEMPERATURE}, top_p {SAMPLED_TOP_P}, a seed per request" + constrained,
    ]


def profile_sections(row: dict[str, Any]) -> list[str]:
    prof = row.get("profile")
    if not prof:
        return []
    which = f"B={row['batch_size']} {row['sampling']}"
    threads = f" ({row['threads']} torch threads)"
    return [
        "",
        f"cProfile, {which}: top entries by own time{threads}",
        prof["tottime"].strip(),
        "",
        f"cProfile, {which}: top entries by cumulative time{threads}",
        prof["cumulative"].strip(),
        "",
        f"cProfile, {which}: callees of the step's own functions{threads}",
        prof["callees"].strip(),
    ]


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    columns = columns_of(cfg)
    lines = [*header(report), ""]
    lines.append(lead_header() + "".join(f"{c:>12}" for c in columns))
    for row in report["results"]:
        lines.append(row_label(row) + cells(row, columns))
    lines += ["", COLUMN_HELP] + ([GRAMMAR_HELP] if cfg.get("constrained") else [])
    lines += format_op_groups(report["results"])
    for row in report["results"]:
        lines += profile_sections(row)
    return "\n".join(lines)
