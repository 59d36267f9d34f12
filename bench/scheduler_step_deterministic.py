"""``--compare-deterministic``: the decode step with ``--enable-deterministic-inference`` off
and on, in one process. For each batch size and sampling mode two schedulers (the same model,
the same requests) are brought to decoding, then their timed steps take turns, the order
swapping every pair, so the machine's drift and the other processes' load fall on both arms
alike; the figure to read is the median over the pairs of the on/off tokens/s ratio. The
prompts' prefill steps take turns the same way, and their time is reported too. Holds two
models at once (``--model-path``: twice its weights)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import Any

from bench.scheduler_step_run import (
    fit_context,
    lengths,
    machine_info,
    model_info,
    reach_decoding,
)
from bench.scheduler_step_report import machine_and_model
from bench.scheduler_step_workload import build, decode_step, prompts, submit
from scheduler_proc.scheduler import Scheduler

ARMS = ("off", "on")
COLUMNS = ("steps", "off_ms", "on_ms", "off_tok/s", "on_tok/s", "on/off", "prefill_x")


def decoding_pair(
    batch_size: int,
    sampling: str,
    *,
    steps: int,
    context: int,
    warmup: int,
    torch_threads: int | None,
    device: str,
    seed: int,
    model_path: str | None,
) -> tuple[dict[str, Scheduler], dict[str, int]]:
    """Both arms' schedulers, every request decoding and ``warmup`` steps done; and each
    arm's time (ns) in the steps until every request decoded (its prompts' prefill)."""
    sizes = lengths(batch_size, context, warmup, steps, 0)
    pair: dict[str, Scheduler] = {}
    for arm in ARMS:
        s = build(
            batch_size,
            context + sizes.max_new,
            torch_threads,
            device,
            model_path,
            deterministic=arm == "on",
        )
        max_new = fit_context(s, context, warmup + steps, sizes.max_new)
        submit(s, prompts(batch_size, context, s.vocab_size, seed), max_new, sampling, seed)
        pair[arm] = s
    prefill_ns = dict.fromkeys(ARMS, 0)
    for i in range(sizes.prefill_steps_bound + 1):
        prefilling = [arm for arm in ARMS if not _decoding(pair[arm], batch_size)]
        if not prefilling:
            break
        for arm in prefilling if i % 2 == 0 else prefilling[::-1]:
            t = time.perf_counter_ns()
            pair[arm].step()
            prefill_ns[arm] += time.perf_counter_ns() - t
    for s in pair.values():  # the warm-up only: every request decodes by now, or this raises
        reach_decoding(s, batch_size, 0, warmup)
    return pair, prefill_ns


def _decoding(s: Scheduler, batch_size: int) -> bool:
    return not (s.waiting or s.prefilling or len(s.running) < batch_size)


def paired_steps(pair: dict[str, Scheduler], batch_size: int, steps: int) -> dict[str, Any]:
    """``steps`` timed decode steps of each arm, in turns; each arm's median step and the
    median of the pairs' on/off tokens/s ratios (off step time over on step time)."""
    gc.collect()
    ns: dict[str, list[int]] = {arm: [] for arm in ARMS}
    for i in range(steps):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            t = time.perf_counter_ns()
            decode_step(pair[arm], batch_size)
            ns[arm].append(time.perf_counter_ns() - t)
    if any(s.num_retracted_total for s in pair.values()):
        raise RuntimeError("a retraction happened during the benchmark; the KV pool is too small")
    off, on = (statistics.median(ns[arm]) for arm in ARMS)
    return {
        "steps": steps,
        "off_ms": off / 1e6,
        "on_ms": on / 1e6,
        "off_tok/s": batch_size * 1e9 / off,
        "on_tok/s": batch_size * 1e9 / on,
        "on/off": statistics.median(a / b for a, b in zip(ns["off"], ns["on"])),
    }


def compare_deterministic(
    batch_sizes: Sequence[int],
    *,
    samplings: Sequence[str],
    steps: int,
    context: int,
    warmup: int,
    torch_threads: int | None,
    device: str,
    seed: int,
    model_path: str | None,
) -> dict[str, Any]:
    results = []
    for b in batch_sizes:
        for sampling in samplings:
            pair, prefill_ns = decoding_pair(
                b,
                sampling,
                steps=steps,
                context=context,
                warmup=warmup,
                torch_threads=torch_threads,
                device=device,
                seed=seed,
                model_path=model_path,
            )
            row = {"batch_size": b, "sampling": sampling, **paired_steps(pair, b, steps)}
            row["prefill_x"] = prefill_ns["on"] / prefill_ns["off"]
            results.append(row)
            del pair
    from scheduler_proc.model.runner import resolve_device

    return {
        "config": {
            "batch_sizes": list(batch_sizes),
            "samplings": list(samplings),
            "steps": steps,
            "context": context,
            "warmup": warmup,
            "torch_threads": torch_threads,
            "device": device,
            "seed": seed,
            "model_path": model_path,
        },
        "machine": machine_info(str(resolve_device(device))),
        "model": model_info(device, model_path),
        "results": results,
    }


def format_deterministic(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        *machine_and_model(report),
        f"--enable-deterministic-inference off/on: prompt {cfg['context']} tokens, "
        f"{cfg['steps']} decode steps per arm, the arms taking turns in one process",
        "",
        "batch".rjust(6) + f"{'sampling':>10}" + "".join(f"{c:>11}" for c in COLUMNS),
    ]
    for row in report["results"]:
        cells = [f"{row['steps']:>11d}"] + [f"{row[c]:>11.3f}" for c in COLUMNS[1:]]
        lines.append(f"{row['batch_size']:>6d}{row['sampling']:>10}" + "".join(cells))
    lines += [
        "",
        "off_ms / on_ms: median decode step; *_tok/s: batch size over it; on/off: median over "
        "the step pairs of the on/off tokens/s ratio (below 1: the mode costs that much); "
        "prefill_x: the on/off time of the steps until every request decoded (the prompts' "
        "prefill, in chunks of --chunked-prefill-size)",
    ]
    return "\n".join(lines)
