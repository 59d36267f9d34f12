"""The attached run of bench/serve.py: the ``--concurrency`` clients of
``bench.serve_client`` against one server (``run_load``), with the readings of
``bench.serve_readings`` over its steady part, and the summary of its requests.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from bench.serve_client import LoadConfig, ReqResult, make_body, send_one
from bench.serve_readings import (
    SETTLE_TIMEOUT,
    CpuReading,
    Sample,
    latest_steps,
    prepare,
    read_cpu,
    run_step_rate,
    sample_loop,
    settle,
    window_cpu,
)


# --- the attached run -------------------------------------------------------------------------


@dataclass
class SteadyWindow:
    """The steady part of a run: from when every client first has a request in flight
    (``full_at``) to when the first client finds no work left (``dry_at``), in seconds since
    the run's start, with the processes' CPU read at each end."""

    full_at: float | None = None
    dry_at: float | None = None
    cpu_full: CpuReading | None = None
    cpu_dry: CpuReading | None = None


def request_details(results: Sequence[ReqResult]) -> list[dict[str, Any]]:
    """Each request's figures for the JSON, without its per-event lists."""
    return [{k: v for k, v in asdict(r).items() if k not in ("itl", "arrivals")} for r in results]


async def run_load(
    url: str,
    cfg: LoadConfig,
    info_url: str | None = None,
    procs: dict[str, int] | None = None,
    vocab: int | None = None,
) -> dict[str, Any]:
    """The workload ``cfg`` against ``url``; with ``procs`` (the server's processes by name)
    their CPU over the steady part too (``window_cpu``). ``vocab`` given: ``url`` is a peer
    server (vLLM) with that vocabulary, no /server_info and so no step rate."""
    peer = vocab is not None
    vocab, start = await prepare(url, info_url=info_url, vocab=vocab)
    rng = random.Random(cfg.seed)
    streams = [rng.random() < cfg.stream_ratio for _ in range(cfg.requests)]
    results: list[ReqResult] = []
    samples: list[Sample] = []
    next_i = 0
    in_flight = 0
    window = SteadyWindow()
    last_sent = 0.0
    watched = procs or {}
    target = min(cfg.concurrency, cfg.requests)
    limits = httpx.Limits(
        max_connections=cfg.concurrency + 8, max_keepalive_connections=cfg.concurrency + 8
    )
    bar = tqdm(
        total=cfg.requests, file=sys.stderr, disable=not cfg.progress, desc="requests", unit="req"
    )
    stop = asyncio.Event()
    t0 = time.perf_counter()

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal next_i, in_flight, last_sent
        while next_i < cfg.requests:
            i = next_i
            next_i += 1
            in_flight += 1
            last_sent = time.perf_counter() - t0
            if window.full_at is None and in_flight >= target:
                window.full_at = last_sent
                # no event is handled in between: one thread
                window.cpu_full = read_cpu(watched, t0)
            res = await send_one(client, url, make_body(i, cfg, vocab, streams[i]), t0, api=cfg.api)
            in_flight -= 1
            results.append(res)
            bar.update(1)
        if window.dry_at is None:
            window.dry_at = time.perf_counter() - t0
            window.cpu_dry = read_cpu(watched, t0)

    sampler = None if peer else asyncio.create_task(sample_loop(url, t0, samples, stop))
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(600.0, connect=30.0), limits=limits
    ) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(cfg.concurrency)))
    duration = time.perf_counter() - t0
    stop.set()
    if sampler is not None:
        await sampler
    bar.close()
    end = None
    if start is not None:
        async with httpx.AsyncClient(timeout=10.0) as client:
            end = await settle(client, url, latest_steps(start, samples, last_sent), SETTLE_TIMEOUT)
    summary = summarize(results, duration)
    lo, hi = window.full_at or 0.0, window.dry_at or duration
    rate = run_step_rate(start, samples, end, duration, lo, hi)
    cpu = (
        window_cpu(window.cpu_full, window.cpu_dry, watched, results)
        if window.cpu_full is not None and window.cpu_dry is not None
        else None
    )
    if cpu is not None and procs is None:
        cpu["note"] = "server processes not measured: give --pids (or use --launch)"
    summary.update(
        config=asdict(cfg),
        url=url,
        steady_s=[lo, hi],
        scheduler_steps=rate,
        cpu=cpu,
        samples=[asdict(s) for s in samples],
        requests_detail=request_details(results),
    )
    summary["_results"] = results  # for the plot; dropped before the JSON
    return summary


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def pick(q: float) -> float | None:
        if not ordered:
            return None
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] * 1000.0

    return {
        "p50": pick(0.50),
        "p90": pick(0.90),
        "p99": pick(0.99),
        "mean": sum(ordered) * 1000.0 / len(ordered) if ordered else None,
    }


def summarize(results: Sequence[ReqResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    lost = [r for r in ok if r.completion_tokens is not None and r.completion_tokens != r.tokens]
    logprobs_lost = sum(abs(r.tokens - r.logprobs) for r in ok if r.logprobs is not None)
    tokens = sum(r.tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "requests": len(results),
        "completed": len(ok),
        "streaming": sum(r.stream for r in results),
        "duration_s": duration,
        "requests_per_s": len(ok) / duration,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / duration,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2e_ms": percentiles([r.e2e for r in ok if r.e2e is not None]),
        "errors": len(errors),
        "error_examples": sorted(set(e for e in errors if e))[:5],
        "tokens_lost": sum(abs((r.completion_tokens or 0) - r.tokens) for r in lost),
        "requests_with_lost_tokens": len(lost),
        "logprobs_lost": logprobs_lost,
        "tool_calls": sum(r.tool_calls for r in ok),
    }
