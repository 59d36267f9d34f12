"""``--lora``: the decode step with its requests bound to LoRA adapters, against the same step
with none. For each batch size and sampling mode one scheduler per arm (``--lora-counts``,
default 0,1,4: ``--enable-lora``, k adapters of ``--lora-rank`` written by
``bench.lora_adapters``, ``--max-loras`` max(k, 1) or ``--lora-slots``, the requests spread
round-robin over the adapters, each named by a ``LoraRef`` as the API worker sends it;
``off``: no ``--enable-lora``) gets the same prompts; their prefill steps take turns until
every request decodes, then the timed decode steps take turns, the order rotating every step,
so the machine's drift falls on every arm alike. Per arm: the median step, forward and batch
build (the LoRA mask is built there), tokens/s and the median over the steps of the tokens/s
ratio to 0 adapters.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lora_adapters import write_adapters
from bench.scheduler_step_run import fit_context, lengths, machine_info, model_info
from bench.scheduler_step_timers import Timer, instrument
from bench.scheduler_step_report import machine_and_model
from bench.scheduler_step_workload import (
    LoraSetup,
    adapter_refs,
    build,
    decode_step,
    prompts,
    submit,
)
from scheduler_proc.scheduler import Scheduler

OFF = "off"  # the arm without --enable-lora
DEFAULT_COUNTS = ("0", "1", "4")
COLUMNS = ("steps", "step_ms", "fwd_ms", "build_ms", "tok/s", "x0")


@dataclass(frozen=True)
class Arm:
    """One scheduler of the comparison: its label (a count of adapters, or ``off``), its LoRA
    flags (None: LoRA off) and how many adapters its requests are spread over."""

    label: str
    lora: LoraSetup | None
    adapters: int


def make_arms(
    counts: Sequence[str], adapters: dict[str, Path], rank: int, slots: int | None = None
) -> list[Arm]:
    """An arm per count; ``slots``: every LoRA arm's ``--max-loras`` (None: max(k, 1))."""
    arms = []
    for label in counts:
        if label == OFF:
            arms.append(Arm(OFF, None, 0))
            continue
        k = int(label)
        modules = tuple(f"{name}={path}" for name, path in list(adapters.items())[:k])
        arms.append(Arm(label, LoraSetup(modules, slots or max(1, k), rank), k))
    return arms


@dataclass
class Decoding:
    """An arm's scheduler with every request decoding, and its stage timers."""

    arm: Arm
    scheduler: Scheduler
    extend: Timer
    forward: Timer


def start_arm(arm: Arm, batch_size: int, sampling: str, opts: dict[str, Any]) -> Scheduler:
    """The arm's scheduler with its requests submitted (bound to its adapters)."""
    sizes = lengths(batch_size, opts["context"], opts["warmup"], opts["steps"], 0)
    s = build(
        batch_size,
        opts["context"] + sizes.max_new,
        opts["torch_threads"],
        opts["device"],
        opts["model_path"],
        lora=arm.lora,
    )
    max_new = fit_context(s, opts["context"], opts["warmup"] + opts["steps"], sizes.max_new)
    refs = adapter_refs(s) if arm.adapters else []
    requests = prompts(batch_size, opts["context"], s.vocab_size, opts["seed"])
    submit(s, requests, max_new, sampling, opts["seed"], loras=refs)
    return s


def _decoding(s: Scheduler, batch_size: int) -> bool:
    return not (s.waiting or s.prefilling or s.loras or len(s.running) < batch_size)


def check_bound(arm: Arm, s: Scheduler) -> None:
    """Every request of an arm with adapters holds a slot, and the arm's adapters are all in
    use (as many as there are requests): the timed steps run the real LoRA path."""
    slots = {req.lora_slot for req in s.live.values()}
    if arm.adapters and (-1 in slots or len(slots) != min(arm.adapters, len(s.live))):
        raise RuntimeError(f"arm {arm.label}: requests run on slots {sorted(slots)}")
    if not arm.adapters and slots != {-1}:
        raise RuntimeError(f"arm {arm.label}: a request runs with an adapter")


def reach_decoding(
    arms: Sequence[Arm], batch_size: int, sampling: str, opts: dict[str, Any]
) -> list[Decoding]:
    """Every arm's scheduler decoding, their prefill steps in turns, then ``warmup`` decode
    steps each, then the timers in place."""
    schedulers = [start_arm(arm, batch_size, sampling, opts) for arm in arms]
    bound = lengths(batch_size, opts["context"], 0, 0, 0).prefill_steps_bound
    for i in range(bound + 1):
        pending = [s for s in schedulers if not _decoding(s, batch_size)]
        if not pending:
            break
        for s in pending if i % 2 == 0 else pending[::-1]:
            s.step()
    out = []
    for arm, s in zip(arms, schedulers):
        if not _decoding(s, batch_size):
            raise RuntimeError(f"arm {arm.label}: requests did not all reach decoding")
        check_bound(arm, s)
        for _ in range(opts["warmup"]):
            decode_step(s, batch_size)
        extend, forward, _ = instrument(s)
        out.append(Decoding(arm, s, extend, forward))
    return out


def turns(decoding: Sequence[Decoding], batch_size: int, steps: int) -> list[dict[str, list[int]]]:
    """``steps`` timed decode steps of each arm, in turns rotating every step; per arm each
    step's wall, forward and extend (forward plus batch build) time in ns."""
    gc.collect()
    times: list[dict[str, list[int]]] = [{"step": [], "fwd": [], "ext": []} for _ in decoding]
    n = len(decoding)
    for i in range(steps):
        for j in [(i + k) % n for k in range(n)]:
            d = decoding[j]
            t = time.perf_counter_ns()
            decode_step(d.scheduler, batch_size)
            times[j]["step"].append(time.perf_counter_ns() - t)
            times[j]["fwd"].append(d.forward.take())
            times[j]["ext"].append(d.extend.take())
    if any(d.scheduler.num_retracted_total for d in decoding):
        raise RuntimeError("a retraction happened during the benchmark; the KV pool is too small")
    return times


def arm_rows(
    decoding: Sequence[Decoding], times: list[dict[str, list[int]]], batch_size: int, sampling: str
) -> list[dict[str, Any]]:
    labels = [d.arm.label for d in decoding]
    base = times[labels.index("0")]["step"]
    rows = []
    for d, t in zip(decoding, times):
        step = statistics.median(t["step"])
        rows.append(
            {
                "adapters": d.arm.label,
                "batch_size": batch_size,
                "sampling": sampling,
                "steps": len(t["step"]),
                "step_ms": step / 1e6,
                "fwd_ms": statistics.median(t["fwd"]) / 1e6,
                "build_ms": statistics.median(e - f for e, f in zip(t["ext"], t["fwd"])) / 1e6,
                "tok/s": batch_size * 1e9 / step,
                "x0": statistics.median(b / s for b, s in zip(base, t["step"])),
            }
        )
    return rows


def compare_lora(
    batch_sizes: Sequence[int],
    *,
    counts: Sequence[str],
    rank: int,
    slots: int | None = None,
    samplings: Sequence[str],
    steps: int,
    context: int,
    warmup: int,
    torch_threads: int | None,
    device: str,
    seed: int,
    model_path: str | None,
) -> dict[str, Any]:
    opts = {
        "context": context,
        "warmup": warmup,
        "steps": steps,
        "torch_threads": torch_threads,
        "device": device,
        "model_path": model_path,
        "seed": seed,
    }
    most = max((int(c) for c in counts if c != OFF), default=0)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as root:
        adapters = write_adapters(Path(root), most, rank, model_path, seed)
        arms = make_arms(counts, adapters, rank, slots)
        for b in batch_sizes:
            for sampling in samplings:
                decoding = reach_decoding(arms, b, sampling, opts)
                results += arm_rows(decoding, turns(decoding, b, steps), b, sampling)
                del decoding
    from scheduler_proc.model.runner import resolve_device

    config = {"batch_sizes": list(batch_sizes), "counts": list(counts), "rank": rank}
    config["slots"] = slots
    return {
        "config": {**config, "samplings": list(samplings), **opts},
        "machine": machine_info(str(resolve_device(device))),
        "model": model_info(device, model_path),
        "results": results,
    }


def format_lora(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        *machine_and_model(report),
        f"LoRA adapters of rank {cfg['rank']} on all seven projections, --max-loras "
        f"{cfg['slots'] or 'max(adapters, 1)'}: prompt "
        f"{cfg['context']} tokens, {cfg['steps']} decode steps per arm, the arms taking turns "
        "in one process",
        "",
        f"{'adapters':>8}{'batch':>7}{'sampling':>10}" + "".join(f"{c:>10}" for c in COLUMNS),
    ]
    for row in report["results"]:
        cells = [f"{row['steps']:>10d}"] + [f"{row[c]:>10.3f}" for c in COLUMNS[1:]]
        lines.append(
            f"{row['adapters']:>8}{row['batch_size']:>7d}{row['sampling']:>10}" + "".join(cells)
        )
    lines += [
        "",
        "adapters: the requests spread round-robin over that many adapters (0: LoRA on, every "
        "request on the base model; off: no --enable-lora); "
        "step_ms, fwd_ms, build_ms: medians of the decode step, the model forward and the batch "
        "build (ForwardBatch and LoRA mask); tok/s: batch over step_ms; x0: median over the "
        "steps of the tokens/s ratio to 0 adapters (below 1: the adapters cost that much)",
    ]
    return "\n".join(lines)
