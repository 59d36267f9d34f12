"""Scheduler decode-step benchmark: the scheduler alone, no sockets.

For each batch size B (``--batch-sizes``, default 1,16,64,256) and each sampling mode
(``--sampling``, default greedy,sampled) a fresh scheduler is built with
``scheduler_proc.main.build_scheduler(ServerConfig(...))`` on the default model (the
built-in seeded model and the shipped tokenizer), with a KV pool sized to hold every
request for the whole run. Then:

1. B requests are submitted: ``--context`` (default 32) prompt tokens each, the first
   token distinct per request so the prefix cache cannot share them; ``ignore_eos``,
   streamed with stream_interval 1 (every step emits a row per request),
   ``max_new_tokens`` large enough that none finishes during the run; "greedy" asks for
   temperature 0, "sampled" for temperature 0.7 and top_p 0.9 with a distinct seed per
   request;
2. warm-up: ``Scheduler.step()`` until every request is prefilled and decoding (no
   waiting or mid-chunk request), then ``--warmup`` (default 3) more decode steps;
3. timed: ``--steps`` (default 50) calls of ``Scheduler.step()``, each one batched decode
   over the B requests plus the output frame build, stopping early after
   ``--max-seconds`` (default 60) per batch size. Every step is checked to be a pure
   decode step that emitted one frame of B rows.

``scheduler.runner.extend`` and ``runner.decode`` (ForwardBatch build + model forward),
``scheduler.runner.model.forward`` and ``scheduler.runner.sample`` (the sampler's tensor
math over the [B, vocab] logits) are wrapped with timers for the timed steps, so the
table splits a step into the forward, the host-side batch build, the sampler and the
host work left (retraction check, scheduling, KV alloc, slot bookkeeping, stop checks,
output frame build); ``outside`` is everything outside ``extend`` (sampler included).
On CUDA the wrappers synchronize before reading the clock, so kernel time is charged to
the call that launched it rather than to a later ``.tolist()``.

``--constrained`` gives every request a structured output (a nested JSON schema: an array
of at least as many objects as the run has tokens, each object nested two deep, so no
answer can end during the run; one compile, shared through the cache, before the
warm-up). The table then adds the grammar's cost per step: ``fill_ms`` (the constrained
rows' bitmask, ``TokenMasks.fill``), ``apply_ms`` (the masked copy of the logits,
``GrammarMask.apply``, part of sample_ms), ``accept_ms`` (the drawn tokens into the
matchers, ``TokenMasks.accept``) and ``grammar_ms`` (their sum); fill and accept are part of
host_ms.

``--profile`` then runs ``--profile-steps`` more decode steps of the largest batch size
(each sampling mode) under cProfile and prints the top entries (by own time and by
cumulative time).

``--model-path DIR`` serves that checkpoint instead of the built-in model (prompt ids are
drawn from its vocabulary).

``--compare-forward`` times the forward before and after issue 31's item 5 in one run:
``--rounds`` rounds (default 3), each running both arms in child processes of this script,
in alternating order (before first in even rounds), so the machine's drift and the other
processes' load fall on both. "before" is the padded gather and masked SDPA for every pass,
no dense KV copy of the running batch, and glibc's default allocator thresholds
(``--forward before``); "after" is the code as it is. It prints each arm's median row and
the after/before tokens/s ratios, per round and their median.

Usage: ``python bench/scheduler_step.py [--batch-sizes 1,16,64,256]
[--sampling greedy,sampled] [--constrained] [--steps 50] [--context 32] [--torch-threads N]
[--device auto] [--model-path DIR] [--profile] [--json PATH]
[--compare-forward [--rounds 3]]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import platform
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pipeline.config import ServerConfig  # noqa: E402
from pipeline.io_struct import (
    REQ_ID_DTYPE,
    Constraint,
    SamplingParams,
    TokenizedGenerateReqInput,
    from_column,
)  # noqa: E402
from scheduler_proc.main import build_scheduler  # noqa: E402
from scheduler_proc.sampling.grammar import GrammarMask  # noqa: E402
from scheduler_proc.scheduler import Scheduler  # noqa: E402

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
    "steps: timed steps; ms/step: mean; p50_ms: median step; fwd_ms: model.forward; "
    "build_ms: ForwardBatch build (extend minus forward); sample_ms: runner.sample (the sampler's "
    "tensor math); host_ms: step time outside extend and sample (scheduling, slot bookkeeping, "
    "stop checks, output frame); outside_ms / outside_%: step time outside runner.extend "
    "(sample_ms + host_ms). Host time outside the forward is build_ms + host_ms."
)
GRAMMAR_COLUMNS = ("fill_ms", "apply_ms", "accept_ms", "grammar_ms")
GRAMMAR_HELP = (
    "--constrained: every row follows a nested JSON schema. fill_ms: the constrained rows' bitmask "
    "(TokenMasks.fill, in host_ms); apply_ms: the masked copy of the logits (GrammarMask.apply, in "
    "sample_ms); accept_ms: the drawn tokens into the matchers (TokenMasks.accept, in host_ms); "
    "grammar_ms: their sum."
)
SAMPLING_MODES = ("greedy", "sampled")
SAMPLED_TEMPERATURE = 0.7
SAMPLED_TOP_P = 0.9
FIRST_TOKEN = 16  # prompt ids start above the tokenizer's special tokens
FORWARD_ARMS = ("before", "after")


# --- timing wrappers ---------------------------------------------------------------------


class _Timer:
    """Wraps a callable; sums the wall time of its calls (synchronizing CUDA first)."""

    def __init__(self, fn: Callable[..., Any], sync: Callable[[], None] | None) -> None:
        self.fn = fn
        self.sync = sync
        self.total_ns = 0
        self.calls = 0
        self._others: list[_Timer] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        out = self.fn(*args, **kwargs)
        if self.sync is not None:
            self.sync()
        self.total_ns += time.perf_counter_ns() - t0
        self.calls += 1
        return out

    def also(self, other: _Timer) -> None:
        """``take`` also takes ``other``'s time: two entry points to one stage."""
        self._others.append(other)

    def take(self) -> int:
        total, self.total_ns = self.total_ns, 0
        return total + sum(other.take() for other in self._others)


def _instrument_grammar(scheduler: Scheduler) -> tuple[_Timer, _Timer, _Timer, Callable[[], None]]:
    """Timers of the mask fill, apply and accept, and the undo of the apply's wrapper (a
    class attribute: a mask is a new object every step)."""
    masks = scheduler.masks
    if masks is None:
        raise RuntimeError("--constrained needs a scheduler with a tokenizer")
    sync = torch.cuda.synchronize if scheduler.runner.device.type == "cuda" else None
    fill, accept = _Timer(masks.fill, sync), _Timer(masks.accept, sync)
    original = GrammarMask.apply
    apply = _Timer(original, sync)

    def timed_apply(mask: GrammarMask, logits: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = apply(mask, logits)
        return result

    # setattr, as in _instrument: instance attributes shadow the two methods, and the
    # apply's wrapper goes on the class (a mask is a new object every step).
    shadowed: tuple[tuple[object, str, Callable[..., Any]], ...] = (
        (masks, "fill", fill),
        (masks, "accept", accept),
        (GrammarMask, "apply", timed_apply),
    )
    for owner, name, timer in shadowed:
        setattr(owner, name, timer)
    return fill, apply, accept, lambda: setattr(GrammarMask, "apply", original)


def _instrument(scheduler: Scheduler) -> tuple[_Timer, _Timer, _Timer]:
    """Instance attributes shadow the bound methods the scheduler and runner call: returns
    the timers of extend, forward and sample."""
    runner = scheduler.runner
    sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
    extend = _Timer(runner.extend, sync)
    # A steady decode step's pass is runner.decode (the running batch's columns); it counts
    # as the extend: the ForwardBatch build plus the forward.
    decode = _Timer(runner.decode, sync)
    extend.also(decode)
    forward = _Timer(runner.model.forward, sync)
    sample = _Timer(runner.sample, sync)
    # setattr: replacing a method of one instance is what the types forbid, and the point here.
    shadowed = (
        (runner, "extend", extend),
        (runner, "decode", decode),
        (runner.model, "forward", forward),
        (runner, "sample", sample),
    )
    for owner, name, timer in shadowed:
        setattr(owner, name, timer)
    return extend, forward, sample


# --- set-up ------------------------------------------------------------------------------


def _prompts(batch_size: int, context: int, vocab_size: int, seed: int) -> list[list[int]]:
    span = vocab_size - FIRST_TOKEN
    if batch_size > span:
        raise ValueError(f"at most {span} requests get distinct first tokens with this vocabulary")
    rng = random.Random(seed)
    return [
        [FIRST_TOKEN + i] + [rng.randrange(FIRST_TOKEN, vocab_size) for _ in range(context - 1)]
        for i in range(batch_size)
    ]


def _build(
    batch_size: int,
    tokens_per_req: int,
    torch_threads: int | None,
    device: str,
    model_path: str | None = None,
) -> Scheduler:
    # Headroom beyond the requests' own KV: the pool also leaves slots for the next decode
    # step during admission, and nothing here may ever trigger a retraction.
    pool = batch_size * tokens_per_req + 2 * batch_size + 64
    config = ServerConfig(
        max_total_tokens=max(pool, 16),
        max_running_requests=max(batch_size, ServerConfig().max_running_requests),
        torch_threads=torch_threads,
        device=device,
        model_path=model_path,
    )
    return build_scheduler(config)


def _sampling_params(sampling: str, max_new_tokens: int, seed: int) -> SamplingParams:
    if sampling == "greedy":
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    if sampling == "sampled":
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=SAMPLED_TEMPERATURE,
            top_p=SAMPLED_TOP_P,
            seed=seed,
            ignore_eos=True,
        )
    raise ValueError(
        f"unknown sampling mode {sampling!r}; expected one of {', '.join(SAMPLING_MODES)}"
    )


def bench_schema(min_items: int) -> dict[str, Any]:
    """An array of at least ``min_items`` objects, each nested two deep (an object holding an
    object): every object takes several tokens, so no answer ends within ``min_items``
    tokens."""
    owner = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "since": {"type": "integer"}},
        "required": ["name", "since"],
    }
    meta = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}, "owner": owner},
        "required": ["ok", "score", "owner"],
    }
    item = {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "meta": meta,
        },
        "required": ["id", "name", "tags", "meta"],
    }
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": item, "minItems": min_items}},
        "required": ["items"],
    }


def _submit(
    scheduler: Scheduler,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: str,
    seed: int,
    constraint: Constraint | None = None,
) -> None:
    now = time.time()
    for i, ids in enumerate(prompts):
        params = _sampling_params(
            sampling, max_new_tokens, seed * 1_000_003 + i
        )  # a distinct seed per request
        scheduler.add_request(
            TokenizedGenerateReqInput(
                rid=f"bench-{i}",
                req_id=i,
                input_ids=ids,
                sampling_params=params,
                stream=True,
                arrival_time=now,
                constraint=constraint,
            )
        )


def _await_grammars(scheduler: Scheduler, timeout: float = 60.0) -> None:
    """Steps until no request waits for its grammar (one compile, before the warm-up)."""
    deadline = time.monotonic() + timeout
    while scheduler.grammars:
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark's grammar did not compile")
        scheduler.step()
        time.sleep(0.001)


def _decode_step(scheduler: Scheduler, batch_size: int) -> None:
    """One step that must be a pure decode over every request, emitting B rows."""
    frames = scheduler.step()
    if len(frames) != 1 or len(from_column(frames[0].req_ids, REQ_ID_DTYPE)) != batch_size:
        raise RuntimeError("a timed step was not one frame with a row per request")


# --- one batch size ----------------------------------------------------------------------


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
) -> dict[str, Any]:
    if batch_size < 1 or steps < 1 or context < 1 or warmup < 0:
        raise ValueError("batch size, steps and context must be >= 1, warmup >= 0")
    # Decode tokens a request may see: warm-up, timed and profiled steps, plus the ones
    # emitted while the other requests' prefills were still running (each prefill step
    # fills the chunk budget, so the prompts take about B * context / chunk steps).
    chunk = ServerConfig().chunked_prefill_size
    prefill_steps_bound = (-(-batch_size * context // chunk) if chunk > 0 else 1) + 2
    max_new = warmup + steps + profile_steps + prefill_steps_bound + 8
    scheduler = _build(batch_size, context + max_new, torch_threads, device, model_path)
    if context + max_new >= scheduler.context_length:
        max_new = scheduler.context_length - context - 1
    needed = context + warmup + steps + profile_steps + 2
    if needed >= scheduler.context_length:
        raise ValueError(
            f"context ({context}) + warm-up + steps + profile steps does not fit the model's "
            f"context length ({scheduler.context_length})"
        )
    constraint = (
        Constraint("json_schema", json.dumps(bench_schema(max_new)), "bench")
        if constrained
        else None
    )
    _submit(
        scheduler,
        _prompts(batch_size, context, scheduler.vocab_size, seed),
        max_new,
        sampling,
        seed,
        constraint,
    )
    if len(scheduler.live) != batch_size:
        raise RuntimeError("the scheduler refused some benchmark requests")
    _await_grammars(scheduler)

    t0 = time.perf_counter()
    prefill_steps = 0
    while scheduler.waiting or scheduler.prefilling or len(scheduler.running) < batch_size:
        scheduler.step()
        prefill_steps += 1
        if prefill_steps > prefill_steps_bound:
            raise RuntimeError("requests did not all reach decoding")
    for _ in range(warmup):
        _decode_step(scheduler, batch_size)
    warmup_s = time.perf_counter() - t0

    extend, forward, sample = _instrument(scheduler)
    grammar = _instrument_grammar(scheduler) if constrained else None
    gc.collect()
    step_ns: list[int] = []
    deadline = time.perf_counter() + max_seconds
    for _ in range(steps):
        t = time.perf_counter_ns()
        _decode_step(scheduler, batch_size)
        step_ns.append(time.perf_counter_ns() - t)
        if time.perf_counter() > deadline:
            break
    if scheduler.num_retracted_total:
        raise RuntimeError("a retraction happened during the benchmark; the KV pool is too small")
    n = len(step_ns)
    total_s = sum(step_ns) / 1e9
    extend_s = extend.take() / 1e9
    forward_s = forward.take() / 1e9
    sample_s = sample.take() / 1e9
    outside_s = total_s - extend_s
    result: dict[str, Any] = {
        "batch_size": batch_size,
        "sampling": sampling,
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
        "prefill_steps": prefill_steps,
        "warmup_s": warmup_s,
        "kv_pool_tokens": scheduler.kv.capacity,
        "constrained": constrained,
    }
    if grammar is not None:
        fill, apply, accept, undo = grammar
        parts = {"fill_ms": fill.take(), "apply_ms": apply.take(), "accept_ms": accept.take()}
        result.update({name: ns / 1e6 / n for name, ns in parts.items()})
        result["grammar_ms"] = sum(parts.values()) / 1e6 / n
    if profile_steps > 0:
        result["profile"] = _profile(scheduler, batch_size, profile_steps, profile_top)
    if grammar is not None:
        grammar[3]()
    return result


def _profile(scheduler: Scheduler, batch_size: int, steps: int, top: int) -> dict[str, str]:
    # The timers stay in place (they show up as _Timer.__call__); their cost is two clock
    # reads per call.
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        _decode_step(scheduler, batch_size)
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
    for pattern in _CALLEE_PATTERNS:
        stats.print_callees(pattern)
    out["callees"] = buf.getvalue()
    return out


_CALLEE_PATTERNS = (
    r"scheduler\.py:\d+\((step|_decode|append_tokens)\)",
    r"decode_pass\.py:\d+\(step\)",
    r"forward_batch\.py:\d+\((build|_cat_cpu)\)",
    r"sampler\.py:\d+\(sample\)",
    r"output_builder\.py:\d+\(build_token_output\)",
)


# --- the whole run -----------------------------------------------------------------------


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
            )
            results.append(row)
        if not machine:  # after the first build: build_scheduler sets the torch threads
            from scheduler_proc.model.runner import resolve_device

            machine = machine_info(str(resolve_device(device)))
            model = _model_info(device, model_path)
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
        },
        "machine": machine,
        "model": model,
        "results": results,
    }


def _model_info(device: str, model_path: str | None = None) -> dict[str, Any]:
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


def format_report(report: dict[str, Any]) -> str:
    m, cfg, model = report["machine"], report["config"], report["model"]
    lines = [
        f"machine: cpu_count={m['cpu_count']} (usable {m['cpus_usable']}), torch_threads={m['torch_threads']}, "
        f"torch {m['torch']}, device={m['device']}"
        + (f" ({m['gpu']})" if "gpu" in m else "")
        + f", python {m['python']}",
        f"model: {model['name']}, hidden {model['hidden']}, {model['layers']} layers, heads {model['heads']}, "
        f"vocab {model['vocab']}",
        f"scheduler decode step: prompt {cfg['context']} tokens, {cfg['warmup']} warm-up + up to {cfg['steps']} "
        f"timed steps per batch size and sampling (at most {cfg['max_seconds']:g} s), stream_interval 1; "
        f"sampled: temperature {SAMPLED_TEMPERATURE}, top_p {SAMPLED_TOP_P}, a seed per request"
        + ("; every row constrained by a nested JSON schema" if cfg.get("constrained") else ""),
        "",
    ]
    columns = COLUMNS + (GRAMMAR_COLUMNS if cfg.get("constrained") else ())
    lines.append("batch".rjust(6) + f"{'sampling':>10}" + "".join(f"{c:>12}" for c in columns))
    for row in report["results"]:
        cells = [f"{row['steps']:>12d}"] + [f"{row[c]:>12.{_digits(c)}f}" for c in columns[1:]]
        lines.append(f"{row['batch_size']:>6d}{row['sampling']:>10}" + "".join(cells))
    lines += ["", COLUMN_HELP] + ([GRAMMAR_HELP] if cfg.get("constrained") else [])
    for row in report["results"]:
        prof = row.get("profile")
        if prof:
            which = f"B={row['batch_size']} {row['sampling']}"
            lines += ["", f"cProfile, {which}: top entries by own time", prof["tottime"].strip()]
            lines += [
                "",
                f"cProfile, {which}: top entries by cumulative time",
                prof["cumulative"].strip(),
            ]
            lines += [
                "",
                f"cProfile, {which}: callees of the step's own functions",
                prof["callees"].strip(),
            ]
    return "\n".join(lines)


# --- before and after the forward change (issue 31, item 5) ------------------------------


def use_forward_before() -> None:
    """Puts this process's forward back as it was before issue 31's item 5: every pass
    through the padded gather and masked SDPA (``attention.padded_attention``), no dense KV
    copy of the running batch (``scheduler_proc.cache.row_kv``), and glibc's default
    allocator thresholds. Call it before the first scheduler is built: a
    ``ModelRunner`` sets the thresholds when it is made, and they cannot be unset."""
    from scheduler_proc.model import attention, llama, runner

    # Checked, not assumed: if the decoder stopped calling pool_attention by that name, or
    # the runner the allocator setting or the KV copy's budget, "before" would silently run
    # the new forward.
    problems = [
        f"runner.py has no {name}"
        for name in ("keep_freed_host_memory", "row_kv_budget")
        if not hasattr(runner, name)
    ]
    if getattr(llama, "pool_attention", None) is not attention.pool_attention:
        problems.append("llama.py no longer calls attention.pool_attention by that name")
    if problems:
        raise RuntimeError(
            f"--forward before: {'; '.join(problems)}; update use_forward_before in bench/scheduler_step.py"
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

    # setattr, as in _instrument: swapping a module's function is what the types forbid.
    for owner, name, value in (
        (llama, "pool_attention", padded_everywhere),
        (runner, "keep_freed_host_memory", default_thresholds),
        (runner, "row_kv_budget", no_row_kv),
    ):
        setattr(owner, name, value)


def compare_forward(child_args: list[str], rounds: int) -> dict[str, Any]:
    """Runs this script with ``--forward before`` and ``--forward after`` (and
    ``child_args``) in child processes, ``rounds`` times, the order alternating. A child
    per arm: the allocator setting is process-wide and has no undo."""
    if rounds < 1:
        raise ValueError("--rounds must be >= 1")
    reports: dict[str, list[dict[str, Any]]] = {arm: [] for arm in FORWARD_ARMS}
    with tempfile.TemporaryDirectory(prefix="scheduler_step_") as tmp:
        for r in range(rounds):
            for arm in FORWARD_ARMS if r % 2 == 0 else FORWARD_ARMS[::-1]:
                out = Path(tmp) / f"{arm}-{r}.json"
                cmd = [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    *child_args,
                    "--forward",
                    arm,
                    "--json",
                    str(out),
                ]
                subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
                reports[arm].append(json.loads(out.read_text()))
    return {"rounds": rounds, "arms": reports}


def format_comparison(comparison: dict[str, Any]) -> str:
    """Each arm's median row (by tokens/s over the rounds) per batch size and sampling, then
    the after/before tokens/s ratio of each round (the two arms of a round ran back to
    back) and their median."""
    arms: dict[str, list[dict[str, Any]]] = comparison["arms"]
    first = arms["after"][0]
    header = format_report({**first, "results": []}).split("\n")[:3]
    columns = COLUMNS + (GRAMMAR_COLUMNS if first["config"].get("constrained") else ())
    lines = [
        *header,
        f"forward before/after (issue 31, item 5): {comparison['rounds']} rounds, the arms alternating in child processes; "
        "before = padded gather + masked SDPA, glibc default allocator thresholds; each row is the arm's median round",
        "",
        "batch".rjust(6) + f"{'sampling':>10}{'forward':>9}" + "".join(f"{c:>12}" for c in columns),
    ]
    ratios: list[str] = []
    for i, row in enumerate(first["results"]):
        per_arm = {arm: [report["results"][i] for report in arms[arm]] for arm in FORWARD_ARMS}
        for arm in FORWARD_ARMS:
            rows = sorted(per_arm[arm], key=lambda r: r["tokens/s"])
            median = rows[(len(rows) - 1) // 2]
            cells = [f"{median['steps']:>12d}"] + [
                f"{median[c]:>12.{_digits(c)}f}" for c in columns[1:]
            ]
            lines.append(
                f"{median['batch_size']:>6d}{median['sampling']:>10}{arm:>9}" + "".join(cells)
            )
        rounds = [
            a["tokens/s"] / b["tokens/s"] for a, b in zip(per_arm["after"], per_arm["before"])
        ]
        ratios.append(
            f"B={row['batch_size']} {row['sampling']}: {statistics.median(rounds):.2f}x (rounds: {', '.join(f'{x:.2f}' for x in rounds)})"
        )
    lines += [
        "",
        "after/before tokens/s, median of the rounds' ratios: " + "; ".join(ratios),
        "",
        COLUMN_HELP,
    ]
    return "\n".join(lines)


def _child_args(args: argparse.Namespace) -> list[str]:
    """The flags a --compare-forward child runs with: this run's, without the comparison."""
    out = [
        "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--sampling", ",".join(args.sampling),
        "--steps", str(args.steps), "--max-seconds", str(args.max_seconds), "--warmup", str(args.warmup),
        "--context", str(args.context), "--device", args.device, "--seed", str(args.seed),
    ]  # fmt: skip
    if args.torch_threads is not None:
        out += ["--torch-threads", str(args.torch_threads)]
    if args.model_path is not None:
        out += ["--model-path", args.model_path]
    if args.constrained:
        out.append("--constrained")
    return out


def _digits(column: str) -> int:
    return 1 if column in ("steps/s", "tokens/s", "outside_%") else 3


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}"
        ) from exc
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive integers")
    return sizes


def _samplings(text: str) -> list[str]:
    modes = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [m for m in modes if m not in SAMPLING_MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(SAMPLING_MODES)}; got {text!r}"
        )
    return list(dict.fromkeys(modes))  # in the order given, each once


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch-sizes", type=_batch_sizes, default=[1, 16, 64, 256], help="default 1,16,64,256"
    )
    parser.add_argument(
        "--sampling",
        type=_samplings,
        default=list(SAMPLING_MODES),
        help=f"comma list of greedy (temperature 0) and sampled (temperature {SAMPLED_TEMPERATURE}, "
        f"top_p {SAMPLED_TOP_P}, a seed per request); default greedy,sampled",
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
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="default: the server's (cores - 2, at least 1)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N (default auto)")
    parser.add_argument(
        "--model-path",
        default=None,
        metavar="DIR",
        help="serve this checkpoint instead of the built-in model",
    )
    parser.add_argument(
        "--compare-forward",
        action="store_true",
        help="time the forward before and after issue 31's item 5 in alternating child processes; print both and the ratio",
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="--compare-forward: rounds of both arms (default 3)"
    )
    parser.add_argument(
        "--forward",
        choices=FORWARD_ARMS,
        default="after",
        help="before: the padded-SDPA forward with glibc's default allocator thresholds; after (default): as the code is",
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
    args = parser.parse_args(argv)
    if args.compare_forward:
        if args.profile:
            parser.error("--compare-forward does not profile; run --profile on its own")
        comparison = compare_forward(_child_args(args), args.rounds)
        print(format_comparison(comparison))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(comparison, indent=2) + "\n")
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
    )
    print(format_report(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
