"""The comparisons of bench/serve.py: each runs the main run's workload again against a
variant of it, because on a shared machine only a ratio measured in one run says anything.

``run_discard`` (``--compare-discard``): the scheduler's step rate with the pipeline attached
against a second server started with ``--discard-output``, what the output path costs the
scheduler. ``run_rounds`` runs arms in rounds, the order swapped (or rotated) each round so
none always goes first, every run with prompts of its own so none finds another's in the
prefix cache; built on it: ``run_sampling`` (``--compare-sampling``: greedy against
sampled), ``run_logprobs`` (``--top-logprobs K``: without against top-K logprobs on every
request) and ``run_api_workers`` (``--compare-api-workers N``: one API process against N,
two servers up at once). Usage, targets and figures: bench/README.md.
"""

from __future__ import annotations

import asyncio
import bisect
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx

from bench.serve_client import LoadConfig, ReqResult, make_body, send_one
from bench.serve_load import run_load
from bench.serve_readings import (
    POLL_INTERVAL,
    SETTLE_TIMEOUT,
    Sample,
    latest_steps,
    prepare,
    ratio,
    run_step_rate,
    sample_loop,
    settle,
)

# --compare-sampling's sampled parameters, unless given.
SAMPLED_TEMPERATURE = 0.7
SAMPLED_TOP_P = 0.9
SAMPLED_SEEDED = True


# --- the discarded run ------------------------------------------------------------------------


def step_seconds(samples: Sequence[Sample], seen: Sample | None) -> float:
    """The scheduler's step time between the report ``seen`` and the latest (0.5 s before
    any)."""
    if seen is None:
        return 0.5
    return (samples[-1].answered - seen.answered) / (samples[-1].steps - seen.steps)


async def await_reached(
    tasks: list[asyncio.Task[ReqResult]], acked: list[tuple[float, asyncio.Task[ReqResult]]]
) -> None:
    """Waits (up to ``SETTLE_TIMEOUT``) until every request sent was acknowledged (``acked``
    grows meanwhile), so has reached the scheduler, or is done (one done before its
    acknowledgement failed)."""
    deadline = time.perf_counter() + SETTLE_TIMEOUT
    while time.perf_counter() < deadline and any(
        not t.done() for t in set(tasks) - {t for _, t in acked}
    ):
        await asyncio.sleep(POLL_INTERVAL / 2)


async def run_discard(url: str, cfg: LoadConfig, window_s: float) -> dict[str, Any]:
    """Keeps ``concurrency`` streaming requests live in a ``--discard-output`` scheduler for
    ``window_s`` after they are first all sent, then aborts everything.

    The clients never get an answer, so the top-up reads the scheduler's ``live_reqs``. A
    stream's headers come back once the server has handed the request to the scheduler, so
    every request acknowledged before the poll that preceded a new report is counted in that
    report, or finished (allowing two scheduler steps for the request to be taken in).
    Requests sent later are assumed live. The oldest acknowledged streams that the
    scheduler has finished (they finish in arrival order: same prompt length, same
    max_new_tokens) are closed, so connections do not pile up. The abort waits until
    every request sent has reached the scheduler (or failed): one still on its way would
    run after it."""
    vocab, start = await prepare(url, discarding=True)
    samples: list[Sample] = []
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sampler = asyncio.create_task(sample_loop(url, t0, samples, stop))
    tasks: list[asyncio.Task[ReqResult]] = []
    acked: list[tuple[float, asyncio.Task[ReqResult]]] = []  # in acknowledgement order
    closed = 0
    last_sent = 0.0
    seen: Sample | None = None  # the sample that first showed the latest report
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=30.0), limits=limits
    ) as client:

        def send(n: int) -> None:
            nonlocal last_sent
            for _ in range(n):
                last_sent = time.perf_counter() - t0
                i = len(tasks)
                body = make_body(i, cfg, vocab, True)

                def on_headers(i: int = i) -> None:
                    acked.append((time.perf_counter() - t0, tasks[i]))

                tasks.append(asyncio.create_task(send_one(client, url, body, t0, on_headers)))

        send(cfg.concurrency)
        full_at = time.perf_counter() - t0
        while time.perf_counter() - t0 < full_at + window_s:
            await asyncio.sleep(POLL_INTERVAL / 2)
            if len(samples) < 2 or (seen is not None and samples[-1].steps == seen.steps):
                continue
            # The scheduler takes in new requests between steps, so one that arrived during
            # the step before the report is not in it yet: allow two steps, plus transit.
            step_s = step_seconds(samples, seen)
            seen = samples[-1]
            cut = samples[-2].asked - 0.02 - min(1.0, 2 * step_s)
            counted = bisect.bisect_left([t for t, _ in acked], cut)
            live = samples[-1].live
            while closed < counted - live:
                acked[closed][1].cancel()
                closed += 1
            send(max(0, cfg.concurrency - live - (len(tasks) - counted)))
        await await_reached(tasks, acked)
        async with httpx.AsyncClient(timeout=10.0) as ctl:
            await ctl.post(f"{url}/abort_request", json={"abort_all": True})
            end_t = time.perf_counter() - t0
            stop.set()
            await sampler
            end = (
                await settle(ctl, url, latest_steps(start, samples, last_sent), SETTLE_TIMEOUT)
                if start is not None
                else None
            )
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    rate = run_step_rate(start, samples, end, end_t, full_at, full_at + window_s)
    return {
        "requests_sent": len(tasks),
        "window_s": window_s,
        "scheduler_steps": rate,
        "samples": [asdict(s) for s in samples],
    }


# --- greedy against sampled ------------------------------------------------------------------


def sampling_variants(
    cfg: LoadConfig, temperature: float | None, top_p: float | None, seeded: bool | None
) -> dict[str, LoadConfig]:
    """The workload of ``cfg`` greedy and sampled; the sampled one takes ``SAMPLED_*`` for
    each parameter not given (None)."""
    return {
        "greedy": replace(cfg, temperature=0.0, top_p=None, seeded=False),
        "sampled": replace(
            cfg,
            temperature=SAMPLED_TEMPERATURE if temperature is None else temperature,
            top_p=SAMPLED_TOP_P if top_p is None else top_p,
            seeded=SAMPLED_SEEDED if seeded is None else seeded,
        ),
    }


BRIEF_KEYS: tuple[str, ...] = (
    "requests",
    "completed",
    "duration_s",
    "requests_per_s",
    "output_tokens",
    "output_tokens_per_s",
)
BRIEF_KEYS += (
    "ttft_ms",
    "itl_ms",
    "errors",
    "error_examples",
    "tokens_lost",
    "logprobs_lost",
    "tool_calls",
    "scheduler_steps",
    "cpu",
)


def brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run's summary without its per-request and per-sample detail."""
    return {k: run[k] for k in BRIEF_KEYS}


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: a workload, the server it runs on and that server's
    processes by name (None: not measured)."""

    cfg: LoadConfig
    url: str
    procs: dict[str, int] | None = None


def same_server(
    variants: dict[str, LoadConfig], url: str, procs: dict[str, int] | None
) -> dict[str, Arm]:
    return {name: Arm(cfg, url, procs) for name, cfg in variants.items()}


async def run_rounds(arms: dict[str, Arm], rounds: int, prompt_set: int) -> dict[str, Any]:
    """``rounds`` rounds, each one run of each of the ``arms`` (the first is the base, the
    others are compared with it), the order rotated from round to round (with two arms:
    swapped), so no arm always goes first; every run has prompts of its own (``prompt_set``
    on). Output tokens/s of each (``<name>_output_tokens_per_s``) and each compared arm's
    ratio to the base (``ratios``; ``ratio`` is the first compared arm's) are medians over
    rounds."""
    names = list(arms)
    base, others = names[0], names[1:]
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        shift = r % len(names)
        order = names[shift:] + names[:shift]
        row: dict[str, Any] = {"first": order[0]}
        for name in order:
            arm = arms[name]
            row[name] = brief(
                await run_load(arm.url, replace(arm.cfg, prompt_set=prompt_set), procs=arm.procs)
            )
            prompt_set += 1
        row["ratios"] = {
            name: ratio(row[name]["output_tokens_per_s"], row[base]["output_tokens_per_s"])
            for name in others
        }
        row["ratio"] = row["ratios"][others[0]]
        runs.append(row)
    ratios = {name: [row["ratios"][name] for row in runs] for name in others}
    medians = {
        name: statistics.median(values) if None not in values else None
        for name, values in ratios.items()
    }
    return {
        "rounds": runs,
        **{
            f"{name}_output_tokens_per_s": statistics.median(
                [row[name]["output_tokens_per_s"] for row in runs]
            )
            for name in arms
        },
        "ratios": medians,
        "ratio": medians[others[0]],
        "errors": sum(row[name]["errors"] for row in runs for name in arms),
        "tokens_lost": sum(row[name]["tokens_lost"] for row in runs for name in arms),
        "logprobs_lost": sum(row[name]["logprobs_lost"] for row in runs for name in arms),
    }


async def run_sampling(
    url: str, variants: dict[str, LoadConfig], rounds: int, procs: dict[str, int] | None = None
) -> dict[str, Any]:
    """Greedy against sampled (``sampling_variants``), in ``run_rounds``."""
    result = await run_rounds(
        same_server(variants, url, procs), rounds, prompt_set=1
    )  # the main run had set 0
    params = {
        name: {k: getattr(v, k) for k in ("temperature", "top_p", "seeded")}
        for name, v in variants.items()
    }
    return {"params": params, **result}


def logprobs_variants(cfg: LoadConfig, top_logprobs: int) -> dict[str, LoadConfig]:
    """The workload of ``cfg`` without logprobs, and with ``top_logprobs`` on every request."""
    return {
        "without": replace(cfg, top_logprobs=None),
        "logprobs": replace(cfg, top_logprobs=top_logprobs),
    }


async def run_logprobs(
    url: str,
    cfg: LoadConfig,
    top_logprobs: int,
    rounds: int,
    prompt_set: int,
    procs: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Without logprobs against with top ``top_logprobs`` on every request, in ``run_rounds``."""
    result = await run_rounds(
        same_server(logprobs_variants(cfg, top_logprobs), url, procs), rounds, prompt_set
    )
    return {"top_logprobs": top_logprobs, **result}


# --- one API process against N ---------------------------------------------------------------

# The arms of --compare-api-workers: the main server (one API process) and one with N.
SINGLE, MULTI = "single", "multi"


def api_workers_flags(workers: int) -> list[str]:
    """The extra ``tokenpipe serve`` flags of the N-worker server. With N = 1 none: one API
    process is the default, and a server without the flag can run this comparison (two
    alike servers) to check the machinery."""
    return ["--api-workers", str(workers)] if workers > 1 else []


def median_cpu(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per process, the median over ``runs`` of its cores in each run's steady window, and
    the median of the runs' tokens per API CPU-second."""
    cpus = [run["cpu"] for run in runs if run.get("cpu")]
    names = [
        name
        for name in (cpus[0]["processes"] if cpus else {})
        if all(name in c["processes"] for c in cpus)
    ]
    cores = {name: [c["processes"][name]["cores"] for c in cpus] for name in names}
    per_token = [c["tokens_per_api_cpu_s"] for c in cpus]
    client = [c["client"]["cores"] for c in cpus]
    return {
        "cores": {
            name: statistics.median(v) if None not in v else None for name, v in cores.items()
        },
        "client_cores": statistics.median(client) if cpus and None not in client else None,
        "tokens_per_api_cpu_s": statistics.median(per_token)
        if cpus and None not in per_token
        else None,
    }


async def run_api_workers(
    arms: dict[str, Arm], workers: int, rounds: int, prompt_set: int
) -> dict[str, Any]:
    """The same workload on the one-API-process server and the ``workers`` one, in
    ``run_rounds``, with each arm's per-process CPU (``median_cpu``)."""
    result = await run_rounds(arms, rounds, prompt_set)
    cpu = {name: median_cpu([row[name] for row in result["rounds"]]) for name in arms}
    return {"workers": workers, "flags": api_workers_flags(workers), **result, "cpu": cpu}
