"""``--json-schema FILE`` of bench/serve.py: what structured output costs a serving run.

With ``--launch``, after the main run, three measurements on the same server. Throughput: the
workload unconstrained against every request constrained by the schema in FILE, in
``run_rounds``; the schema is compiled once and then cached, so the rounds measure the mask's
cost per step (``bench/schemas/order.json`` keeps every answer going past ``--max-new-tokens``).
Compile cost: on the idle server, the TTFT of a request whose schema is new to the server (a
fresh ``description``) against the same schema cached and no schema. Answer length: the median
completion tokens of constrained answers with room to end (``ANSWER_ROOM``), which the JSON
whitespace bound keeps short where a model spends tokens on blanks. Details: bench/README.md.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
import uuid
from dataclasses import replace
from typing import Any

import httpx

from bench.serve_client import LoadConfig, make_body, send_one
from bench.serve_compare import run_rounds, same_server

COMPILE_TRIALS = 5
COMPILE_PROBE_TOKENS = 4
ANSWER_REQUESTS = 64  # constrained answers sent at once to measure their length, at most
# Their budget: room for the grammar to end them, this many times --max-new-tokens (the
# README's 64 gives 1536), so a small test workload stays small; at most what the built-in
# model's 2048 positions leave beside a prompt.
ANSWER_ROOM = 24
ANSWER_TOKENS = 1536


def read_schema(text: str) -> str:
    """The schema FILE's text, checked to be a JSON object, compacted (one line in every
    request body)."""
    schema = json.loads(text)
    if not isinstance(schema, dict):
        raise ValueError("--json-schema FILE must hold a JSON object (a JSON schema)")
    return json.dumps(schema, separators=(",", ":"))


def structured_variants(cfg: LoadConfig, schema: str) -> dict[str, LoadConfig]:
    """The workload of ``cfg`` unconstrained, and with every request following ``schema``."""
    return {
        "unconstrained": replace(cfg, json_schema=None),
        "constrained": replace(cfg, json_schema=schema),
    }


def fresh_schema(schema: str) -> str:
    """``schema`` with a description no request has sent before: a cache miss everywhere,
    for the same grammar."""
    value = json.loads(schema)
    value["description"] = f"bench compile probe {uuid.uuid4().hex}"
    return json.dumps(value, separators=(",", ":"))


async def probe_ttft(
    url: str, cfg: LoadConfig, vocab: int, index: int, schema: str | None
) -> float:
    """The TTFT of one streaming request (prompt ``index`` of ``cfg.prompt_set``), in ms."""
    probe = replace(cfg, json_schema=schema, max_new_tokens=COMPILE_PROBE_TOKENS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        res = await send_one(
            client, url, make_body(index, probe, vocab, True), time.perf_counter(), api=cfg.api
        )
    if not res.ok or res.ttft is None:
        raise RuntimeError(f"compile probe failed: {res.error}")
    return res.ttft * 1000.0


async def measure_compile_cost(
    url: str, cfg: LoadConfig, schema: str, prompt_set: int
) -> dict[str, Any]:
    """TTFT of a request with a new schema, the same schema cached, and no schema
    (``COMPILE_TRIALS`` each, medians); see the module docstring."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        info = (await client.get(f"{url}/server_info")).raise_for_status().json()
    vocab = int(info["vocab_size"])
    probe_cfg = replace(cfg, prompt_set=prompt_set)
    new, cached, none = [], [], []
    for trial in range(COMPILE_TRIALS):
        this = fresh_schema(schema)
        new.append(await probe_ttft(url, probe_cfg, vocab, 3 * trial, this))
        cached.append(await probe_ttft(url, probe_cfg, vocab, 3 * trial + 1, this))
        none.append(await probe_ttft(url, probe_cfg, vocab, 3 * trial + 2, None))
    medians = {
        name: statistics.median(v)
        for name, v in (("new", new), ("cached", cached), ("unconstrained", none))
    }
    return {
        "trials": COMPILE_TRIALS,
        "ttft_ms": {"new": new, "cached": cached, "unconstrained": none},
        **{f"{name}_ttft_ms": value for name, value in medians.items()},
        "compile_ms": medians["new"] - medians["cached"],
    }


async def measure_answer_lengths(
    url: str, cfg: LoadConfig, schema: str, prompt_set: int
) -> dict[str, Any]:
    """The completion tokens of constrained answers (``ANSWER_REQUESTS``, or the workload's
    request count if smaller) with a budget ``ANSWER_ROOM`` times the workload's (at most
    ``ANSWER_TOKENS``): the median, and how many the grammar ended before the budget."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        info = (await client.get(f"{url}/server_info")).raise_for_status().json()
    vocab = int(info["vocab_size"])
    n = min(ANSWER_REQUESTS, cfg.requests)
    budget = min(ANSWER_TOKENS, ANSWER_ROOM * cfg.max_new_tokens)
    probe = replace(cfg, json_schema=schema, max_new_tokens=budget, prompt_set=prompt_set)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(
                send_one(client, url, make_body(i, probe, vocab, False), t0, api=cfg.api)
                for i in range(n)
            )
        )
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"answer length probe: {len(failed)} failed, e.g. {failed[0]}")
    tokens = [r.completion_tokens or r.tokens for r in results]
    return {
        "requests": n,
        "max_new_tokens": budget,
        "completion_tokens": tokens,
        "median_completion_tokens": statistics.median(tokens),
        "ended": sum(t < budget for t in tokens),
    }


async def run_structured(
    url: str,
    cfg: LoadConfig,
    schema: str,
    rounds: int,
    prompt_set: int,
    procs: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Unconstrained against constrained in ``run_rounds``, then the compile cost and the
    answers' length."""
    result = await run_rounds(
        same_server(structured_variants(cfg, schema), url, procs), rounds, prompt_set
    )
    compile_cost = await measure_compile_cost(url, cfg, schema, prompt_set + 2 * rounds)
    lengths = await measure_answer_lengths(url, cfg, schema, prompt_set + 2 * rounds + 1)
    return {"schema_bytes": len(schema), **result, "compile": compile_cost, "answers": lengths}
