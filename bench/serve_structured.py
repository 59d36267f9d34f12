"""``--json-schema FILE`` of bench/serve.py: what structured output costs a serving run.

With ``--launch``, after the main run, two measurements on the same server. Throughput: the
workload unconstrained against every request constrained by the schema in FILE, in
``run_rounds``; the schema is compiled once, in the first constrained run, and every later
request finds it in the scheduler's grammar cache, so the rounds measure the mask's cost per
step. Compile cost: on the idle server, the TTFT of a request whose schema is new to the
server (a fresh ``description``, so no cache knows it) against the same schema cached and no
schema. A schema whose answers can end before ``--max-new-tokens`` makes the constrained
requests shorter: ``bench/schemas/order.json`` keeps every answer going. Details:
bench/README.md.
"""

from __future__ import annotations

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


async def run_structured(
    url: str,
    cfg: LoadConfig,
    schema: str,
    rounds: int,
    prompt_set: int,
    procs: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Unconstrained against constrained in ``run_rounds``, then the compile cost."""
    result = await run_rounds(
        same_server(structured_variants(cfg, schema), url, procs), rounds, prompt_set
    )
    compile_cost = await measure_compile_cost(url, cfg, schema, prompt_set + 2 * rounds)
    return {"schema_bytes": len(schema), **result, "compile": compile_cost}
