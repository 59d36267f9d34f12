"""The scheduler decode-step benchmark's measurement: for each batch size and sampling mode a
fresh scheduler, its requests submitted and brought to decoding, a warm-up, then the timed
decode steps with the stages' timers in place, each checked to be a pure decode step that
emitted one frame of B rows. ``--op-groups`` then splits the forward by op group
(``bench.scheduler_step_ops``); ``--profile`` adds steps of the largest batch under cProfile."""

from __future__ import annotations

import cProfile
import gc
import io
import json
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bench.scheduler_step_ops import measure_op_groups, op_decode_steps
from bench.scheduler_step_timers import GrammarTimers, instrument, instrument_grammar
from bench.scheduler_step_workload import (
    SAMPLED_TEMPERATURE,
    SAMPLED_TOP_P,
    SAMPLING_MODES,
    await_grammars,
    bench_schema,
    build,
    decode_step,
    prompts,
    submit,
)
from pipeline.config import ServerConfig
from pipeline.io_struct import Constraint
from scheduler_proc.scheduler import Scheduler

# The step's own functions, whose callees show where the time outside the forward goes.
CALLEE_PATTERNS = (
    r"scheduler\.py:\d+\((step|_decode|append_tokens)\)",
    r"decode_pass\.py:\d+\(step\)",
    r"forward_batch\.py:\d+\((build|_cat_cpu)\)",
    r"sampler\.py:\d+\(sample\)",
    r"output_builder\.py:\d+\(build_token_output\)",
)


@dataclass(frozen=True)
class Lengths:
    """How many tokens each request may generate, and how many steps its prefill may take."""

    max_new: int
    prefill_steps_bound: int


def lengths(batch_size: int, context: int, warmup: int, steps: int, extra_steps: int) -> Lengths:
    # Decode tokens a request may see: warm-up, timed, op-group and profiled steps, plus the ones
    # emitted while the other requests' prefills were still running (each prefill step
    # fills the chunk budget, so the prompts take about B * context / chunk steps).
    chunk = ServerConfig().chunked_prefill_size
    prefill_steps_bound = (-(-batch_size * context // chunk) if chunk > 0 else 1) + 2
    max_new = warmup + steps + extra_steps + prefill_steps_bound + 8
    return Lengths(max_new, prefill_steps_bound)


def fit_context(scheduler: Scheduler, context: int, needed_steps: int, max_new: int) -> int:
    """``max_new`` cut to the model's context length; raises if the run cannot fit it."""
    if context + max_new >= scheduler.context_length:
        max_new = scheduler.context_length - context - 1
    if context + needed_steps + 2 >= scheduler.context_length:
        raise ValueError(
            f"context ({context}) + warm-up + steps + profile steps does not fit the model's "
            f"context length ({scheduler.context_length})"
        )
    return max_new


def reach_decoding(scheduler: Scheduler, batch_size: int, bound: int, warmup: int) -> int:
    """Steps until every request is prefilled and decoding, then ``warmup`` decode steps;
    returns the prefill steps taken."""
    prefill_steps = 0
    while scheduler.waiting or scheduler.prefilling or len(scheduler.running) < batch_size:
        scheduler.step()
        prefill_steps += 1
        if prefill_steps > bound:
            raise RuntimeError("requests did not all reach decoding")
    for _ in range(warmup):
        decode_step(scheduler, batch_size)
    return prefill_steps


def timed_steps(scheduler: Scheduler, batch_size: int, steps: int, max_seconds: float) -> list[int]:
    """Each timed step's wall time (ns), stopping early after ``max_seconds``."""
    gc.collect()
    step_ns: list[int] = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(steps):
        t = time.perf_counter_ns()
        decode_step(scheduler, batch_size)
        step_ns.append(time.perf_counter_ns() - t)
        if time.perf_counter() > deadline:
            break
    if scheduler.num_retracted_total:
        raise RuntimeError("a retraction happened during the benchmark; the KV pool is too small")
    return step_ns


def split_step(
    batch_size: int, step_ns: list[int], extend_ns: int, forward_ns: int, sample_ns: int
) -> dict[str, float]:
    """The table's figures: a step split into forward, batch build, sampler and host work."""
    n = len(step_ns)
    total_s = sum(step_ns) / 1e9
    extend_s = extend_ns / 1e9
    forward_s = forward_ns / 1e9
    sample_s = sample_ns / 1e9
    outside_s = total_s - extend_s
    return {
        "steps": n,
        "steps/s": n / total_s,
        "tokens/s": batch_size * n / total_s,
        "ms/step": total_s * 1e3 / n,
        "p50_ms": statistics.median(step_ns) / 1e6,
        "fwd_ms": forward_s * 1e3 / n,
        "build_ms": (extend_s - forward_s) * 1e3 / n,
        "sample_ms": sample_s * 1e3 / n,
        "host_ms": (outside_s - sample_s) * 1e3 / n,
        "outside_ms": outside_s * 1e3 / n,
        "outside_%": 100.0 * outside_s / total_s,
    }


def grammar_split(grammar: GrammarTimers, steps: int) -> dict[str, float]:
    fill, apply, accept, _ = grammar
    parts = {"fill_ms": fill.take(), "apply_ms": apply.take(), "accept_ms": accept.take()}
    split = {name: ns / 1e6 / steps for name, ns in parts.items()}
    split["grammar_ms"] = sum(parts.values()) / 1e6 / steps
    return split


def run_batch(
    batch_size: int,
    *,
    steps: int,
    context: int,
    sampling: str = "greedy",
    warmup: int = 3,
    max_seconds: float = 60.0,
    torch_threads: int | None = None,
    device: str = "auto",
    profile_steps: int = 0,
    profile_top: int = 25,
    seed: int = 0,
    constrained: bool = False,
    model_path: str | None = None,
    deterministic: bool = False,
    op_steps: int = 0,
) -> dict[str, Any]:
    if batch_size < 1 or steps < 1 or context < 1 or warmup < 0:
        raise ValueError("batch size, steps and context must be >= 1, warmup >= 0")
    extra_steps = profile_steps + op_decode_steps(op_steps)
    sizes = lengths(batch_size, context, warmup, steps, extra_steps)
    scheduler = build(
        batch_size, context + sizes.max_new, torch_threads, device, model_path, deterministic
    )
    max_new = fit_context(scheduler, context, warmup + steps + extra_steps, sizes.max_new)
    constraint = (
        Constraint("json_schema", json.dumps(bench_schema(max_new)), "bench")
        if constrained
        else None
    )
    requests = prompts(batch_size, context, scheduler.vocab_size, seed)
    submit(scheduler, requests, max_new, sampling, seed, constraint)
    if len(scheduler.live) != batch_size:
        raise RuntimeError("the scheduler refused some benchmark requests")
    await_grammars(scheduler)

    t0 = time.perf_counter()
    prefill_steps = reach_decoding(scheduler, batch_size, sizes.prefill_steps_bound, warmup)
    warmup_s = time.perf_counter() - t0

    extend, forward, sample = instrument(scheduler)
    grammar = instrument_grammar(scheduler) if constrained else None
    step_ns = timed_steps(scheduler, batch_size, steps, max_seconds)
    split = split_step(batch_size, step_ns, extend.take(), forward.take(), sample.take())
    result: dict[str, Any] = {
        "batch_size": batch_size,
        "sampling": sampling,
        "threads": torch.get_num_threads(),
        **split,
        "prefill_steps": prefill_steps,
        "warmup_s": warmup_s,
        "kv_pool_tokens": scheduler.kv.capacity,
        "constrained": constrained,
    }
    if grammar is not None:
        result.update(grammar_split(grammar, len(step_ns)))
    if op_steps > 0:
        result["op_groups"] = measure_op_groups(scheduler, batch_size, op_steps, forward)
    if profile_steps > 0:
        result["profile"] = profile_decode(scheduler, batch_size, profile_steps, profile_top)
    if grammar is not None:
        grammar[3]()
    return result


def profile_decode(scheduler: Scheduler, batch_size: int, steps: int, top: int) -> dict[str, str]:
    # The timers stay in place (they show up as Timer.__call__); their cost is two clock
    # reads per call.
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        decode_step(scheduler, batch_size)
    profiler.disable()
    out: dict[str, str] = {}
    for key in ("tottime", "cumulative"):
        buf = io.StringIO()
        stats = pstats.Stats(profiler, stream=buf)
        stats.strip_dirs().sort_stats(key).print_stats(top)
        out[key] = buf.getvalue()
    # Where the time outside the model forward goes: what the step's own functions call.
    buf = io.StringIO()
    stats = pstats.Stats(profiler, stream=buf)
    stats.strip_dirs().sort_stats("cumulative")
    for pattern in CALLEE_PATTERNS:
        stats.print_callees(pattern)
    out["callees"] = buf.getvalue()
    return out


def machine_info(device: str = "auto") -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    info: dict[str, Any] = {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "device": device,
    }
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def model_info(device: str, model_path: str | None = None) -> dict[str, Any]:
    from pipeline.model_config import load_model_config
    from pipeline.tokenizer_loader import load_tokenizer

    config = ServerConfig(device=device, model_path=model_path)
    mc = load_model_config(config, load_tokenizer(config.model_path).vocab_size)
    return {
        "name": "built-in seeded (model_path=None)" if model_path is None else model_path,
        "hidden": mc.hidden_size,
        "layers": mc.num_hidden_layers,
        "heads": f"{mc.num_attention_heads}/{mc.num_key_value_heads}",
        "vocab": mc.vocab_size,
    }


def run(
    batch_sizes: Sequence[int] = (1, 16, 64, 256),
    *,
    samplings: Sequence[str] = SAMPLING_MODES,
    steps: int = 50,
    context: int = 32,
    warmup: int = 3,
    max_seconds: float = 60.0,
    torch_threads: int | None = None,
    device: str = "auto",
    profile: bool = False,
    profile_steps: int = 20,
    profile_top: int = 25,
    seed: int = 0,
    constrained: bool = False,
    model_path: str | None = None,
    deterministic: bool = False,
    op_steps: int = 0,
) -> dict[str, Any]:
    results = []
    profiled = max(batch_sizes) if profile else None
    machine: dict[str, Any] = {}
    model: dict[str, Any] = {}
    for b in batch_sizes:
        for sampling in samplings:  # the modes of one batch size run back to back
            row = run_batch(
                b,
                steps=steps,
                context=context,
                sampling=sampling,
                warmup=warmup,
                max_seconds=max_seconds,
                torch_threads=torch_threads,
                device=device,
                profile_steps=profile_steps if b == profiled else 0,
                profile_top=profile_top,
                seed=seed,
                constrained=constrained,
                model_path=model_path,
                deterministic=deterministic,
                op_steps=op_steps,
            )
            results.append(row)
        if not machine:  # after the first build: build_scheduler sets the torch threads
            from scheduler_proc.model.runner import resolve_device

            machine = machine_info(str(resolve_device(device)))
            model = model_info(device, model_path)
    return {
        "config": {
            "batch_sizes": list(batch_sizes),
            "samplings": list(samplings),
            "sampled_params": {
                "temperature": SAMPLED_TEMPERATURE,
                "top_p": SAMPLED_TOP_P,
                "seeded": True,
            },
            "steps": steps,
            "context": context,
            "warmup": warmup,
            "max_seconds": max_seconds,
            "torch_threads": torch_threads,
            "device": device,
            "seed": seed,
            "constrained": constrained,
            "model_path": model_path,
            "deterministic": deterministic,
            "op_steps": op_steps,
        },
        "machine": machine,
        "model": model,
        "results": results,
    }
