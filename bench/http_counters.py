"""What the HTTP series cost the API per request (``tokenizer_proc/http_counters.py``), in
process, where the figure is steady: the real ``HttpCounters`` with the library's observations
around an app that answers one streamed request (the response's start, a body part, the end),
against the same app bare, in interleaved rounds, the minimum of each. It prints microseconds
per request and per body part sent through the counters' ``send`` wrapper; with
``--api-cpu-us`` (the API's CPU per request from ``bench/serve.py``: its API CPU-seconds over
its requests) also the share of that. End to end on a shared 2-core machine the same
comparison has a standard error of about 4% per run pair, too coarse for a 2% bound.

    python -m bench.http_counters [--requests 20000] [--rounds 5] [--api-cpu-us 2150]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenizer_proc.http_counters import HttpCounters, http_observer

PATH = "/v1/completions"
START: Message = {"type": "http.response.start", "status": 200, "headers": []}
PART: Message = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}
END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def streaming_app(parts: int) -> ASGIApp:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send(START)
        for _ in range(parts):
            await send(PART)
        await send(END)

    return app


def scope() -> Scope:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"180")]
    return {
        "type": "http",
        "method": "POST",
        "path": PATH,
        "headers": headers,
        "query_string": b"",
    }


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    pass


def time_requests(app: ASGIApp, n: int) -> float:
    """Microseconds per request of ``app``, ``n`` requests on one event loop."""

    async def run() -> float:
        started = time.perf_counter()
        for _ in range(n):
            await app(scope(), _receive, _send)
        return (time.perf_counter() - started) / n * 1e6

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--parts", type=int, default=8, help="body parts each answer sends through")
    p.add_argument("--api-cpu-us", type=float, default=None, metavar="US")
    args = p.parse_args(argv)
    routes = FastAPI()
    routes.add_api_route(PATH, lambda: None, methods=["POST"])
    observe = http_observer(CollectorRegistry())
    variants: dict[str, ASGIApp] = {
        "bare, start+end": streaming_app(0),
        "counted, start+end": HttpCounters(streaming_app(0), routes, observe),
        f"bare, {args.parts} parts": streaming_app(args.parts),
        f"counted, {args.parts} parts": HttpCounters(streaming_app(args.parts), routes, observe),
    }
    best = {name: float("inf") for name in variants}
    for _ in range(args.rounds):
        for name, app in variants.items():
            best[name] = min(best[name], time_requests(app, args.requests))
    names = list(variants)
    per_request = best[names[1]] - best[names[0]]
    per_part = (best[names[3]] - best[names[2]] - per_request) / args.parts
    print(f"bench/http_counters  {args.requests} requests x {args.rounds} rounds, min per round")
    for name in names:
        print(f"  {name:22s} {best[name]:8.2f} us/request")
    print(f"  counters per request   {per_request:8.2f} us")
    print(f"  per body part sent through them {per_part:6.3f} us")
    if args.api_cpu_us:
        share = per_request / args.api_cpu_us * 100
        print(f"  share of {args.api_cpu_us:.0f} us API CPU per request: {share:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
