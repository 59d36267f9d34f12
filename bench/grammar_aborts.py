"""Abandoned grammar compiles: ``--requests`` requests, each with a JSON schema no other request
has (``--properties`` optional properties: a compile of a good fraction of a second), whose
clients disconnect ``--wait-ms`` after sending, while the grammars compile
(docs/design/structured-outputs.md). The scheduler's resident set is read before, after each
``--batch`` requests (sent at once), and once the server has settled (no change over three
reads): what an abandoned compile leaves behind shows as growth that does not stop. Usage and
figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import uvloop

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch import LaunchedServer  # noqa: E402
from bench.memory import rss_kib  # noqa: E402

SETTLE_READ_S = 5.0  # between the reads that wait for the server to settle
SETTLE_MAX_S = 300.0


def unique_schema(i: int, properties: int) -> str:
    return json.dumps(
        {
            "type": "object",
            "description": f"abandoned schema {i}",
            "properties": {f"p{j}": {"type": "string", "maxLength": 16} for j in range(properties)},
        }
    )


async def abandon(client: httpx.AsyncClient, url: str, body: dict[str, Any], wait: float) -> bool:
    """Sends one streaming request and disconnects after ``wait`` seconds: True when it was
    still running then (disconnected), False when it had finished."""
    try:
        async with asyncio.timeout(wait):
            async with client.stream("POST", f"{url}/generate", json=body) as response:
                async for _ in response.aiter_lines():
                    pass
    except TimeoutError:
        return True
    return False


async def settle(pid: int) -> int:
    """The scheduler's RSS (KiB) once three reads in a row agree (or ``SETTLE_MAX_S`` pass)."""
    reads = [rss_kib(pid)]
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline and (len(reads) < 3 or len(set(reads[-3:])) > 1):
        await asyncio.sleep(SETTLE_READ_S)
        reads.append(rss_kib(pid))
    return reads[-1]


async def measure(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    curve: list[tuple[int, int]] = [(0, rss_kib(pid))]
    disconnected = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0), limits=limits) as client:
        for start in range(0, args.requests, args.batch):
            bodies = [
                {
                    "text": "An order:",
                    "sampling_params": {
                        "max_new_tokens": 16,
                        "json_schema": unique_schema(i, args.properties),
                    },
                    "stream": True,
                }
                for i in range(start, min(start + args.batch, args.requests))
            ]
            left = await asyncio.gather(
                *(abandon(client, url, body, args.wait_ms / 1000) for body in bodies)
            )
            disconnected += sum(left)
            curve.append((start + len(bodies), rss_kib(pid)))
    settled = await settle(pid)
    return {
        "requests": args.requests,
        "disconnected": disconnected,
        "properties": args.properties,
        "curve_kib": curve,
        "settled_kib": settled,
        "growth_mib": (settled - curve[0][1]) / 1024,
    }


def report(result: dict[str, Any]) -> str:
    base = result["curve_kib"][0][1]
    lines = [
        f"{result['requests']} requests with unique schemas of {result['properties']} "
        f"properties, {result['disconnected']} disconnected while compiling",
        "  requests   scheduler RSS MiB   growth MiB",
    ]
    for sent, kib in result["curve_kib"]:
        lines.append(f"  {sent:>8}   {kib / 1024:>17.1f}   {(kib - base) / 1024:>10.1f}")
    lines.append(
        f"  settled    {result['settled_kib'] / 1024:>17.1f}   {result['growth_mib']:>10.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--batch", type=int, default=100, help="requests sent at once")
    p.add_argument("--properties", type=int, default=200, help="optional properties a schema")
    p.add_argument("--wait-ms", type=float, default=200.0, help="when a client disconnects")
    p.add_argument("--server-args", default="", help="extra `tokenpipe serve` flags")
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    with LaunchedServer(shlex.split(args.server_args)) as server:
        server.wait_ready()
        result = uvloop.run(measure(server.url, server.children()["scheduler"], args))
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
