"""Load benchmark: N concurrent streaming clients against one server, all at once.

Every client opens its own connection at the same moment and sends one streaming
``/generate``; the report counts the streams held open at once, the errors and the tokens
lost (streamed against the final ``completion_tokens``). The client is a small HTTP/1.1
client on raw asyncio streams (uvloop), not httpx: a thousand httpx streams cost more CPU
than the server on a 2-core machine, and the timing would measure the client. The server
needs nothing special for 1000 connections (uvicorn's listen backlog is 2048, no concurrency
limit); the one limit that bites is open files, so ``--launch`` raises the soft
RLIMIT_NOFILE to the hard limit (the server inherits it) and the client checks it. Usage:
bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import shlex
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import uvloop

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.json_output import emit_json
from bench.launch import INCREMENTAL_STREAMS, LaunchedServer, raise_open_files_limit  # noqa: E402

DEFAULT_CLIENTS = 1000


# --- a minimal HTTP/1.1 client ------------------------------------------------------------------


class HttpError(Exception):
    """The server answered something this client cannot read."""


class Connection:
    """One HTTP/1.1 connection. Requests go one after the other (keep-alive); a response
    must be read to its end before the next request."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    @classmethod
    def for_url(cls, url: str) -> Connection:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 80)

    @property
    def is_open(self) -> bool:
        return self._writer is not None and not self._writer.is_closing()

    async def request(self, method: str, path: str, body: Any = None) -> HttpResponse:
        if not self.is_open:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        assert self._reader is not None and self._writer is not None
        payload = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        )
        self._writer.write(head.encode() + payload)
        raw = await self._reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            raise HttpError(f"bad status line {lines[0]!r}") from None
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                key, value = line.split(":", 1)
                headers[key.strip().lower()] = value.strip()
        return HttpResponse(self, self._reader, status, headers)

    def close(self, reset: bool = False) -> None:
        """``reset``: abort the socket (RST) instead of closing it (FIN)."""
        if self._writer is not None:
            if reset:
                self._writer.transport.abort()
            else:
                self._writer.close()
        self._reader = self._writer = None


class HttpResponse:
    def __init__(
        self, conn: Connection, reader: asyncio.StreamReader, status: int, headers: dict[str, str]
    ) -> None:
        self.conn, self.status, self.headers = conn, status, headers
        self._reader = reader

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives. Leaves the connection reusable unless the server said
        ``Connection: close`` or the body runs to EOF."""
        reader = self._reader
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise HttpError("connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0], 16)
                if size == 0:
                    while (await reader.readline()) not in (b"\r\n", b""):
                        pass  # trailers
                    break
                data = await reader.readexactly(size)
                await reader.readexactly(2)
                yield data
        elif "content-length" in self.headers:
            length = int(self.headers["content-length"])
            if length:
                yield await reader.readexactly(length)
        else:
            while data := await reader.read(65536):
                yield data
            self.conn.close()
            return
        if self.headers.get("connection", "").lower() == "close":
            self.conn.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    async def json(self) -> Any:
        return json.loads(await self.read())

    async def sse(self) -> AsyncIterator[bytes]:
        """The payload of each ``data:`` line of a server-sent event stream."""
        buf = b""
        async for chunk in self.chunks():
            buf += chunk
            while (cut := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:cut], buf[cut + 2 :]
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[5:].lstrip(b" ")


async def get_json(url: str, path: str) -> Any:
    conn = Connection.for_url(url)
    try:
        resp = await conn.request("GET", path)
        data = await resp.json()
        if resp.status != 200:
            raise HttpError(f"GET {path}: HTTP {resp.status}: {data}")
        return data
    finally:
        conn.close()


# --- one stream ---------------------------------------------------------------------------------


@dataclass
class StreamResult:
    index: int
    status: int = 0
    events: int = 0  # SSE events with a JSON payload
    tokens: int = 0  # output_ids received
    completion_tokens: int | None = None  # the last event's meta_info count
    finish_reason: object = None  # the response's JSON, as it came
    done: bool = False  # saw data: [DONE]
    cut: bool = False  # the client closed it on purpose before its end
    error: str | None = None
    elapsed: float = 0.0

    @property
    def tokens_lost(self) -> int:
        return abs(self.tokens - (self.completion_tokens or 0))


class OpenStreams:
    """How many streams are open now, and the most at once."""

    def __init__(self) -> None:
        self.now = 0
        self.max = 0

    def opened(self) -> None:
        self.now += 1
        self.max = max(self.max, self.now)

    def closed(self) -> None:
        self.now -= 1


def make_body(
    index: int, *, vocab: int, prompt_len: int, max_new_tokens: int, seed: int, stream: bool = True
) -> dict[str, Any]:
    rng = random.Random(seed * 1_000_003 + index)
    ids = [rng.randrange(16, vocab) for _ in range(prompt_len)]  # low ids hold the special tokens
    sampling = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.7,
        "seed": seed + index,
        "ignore_eos": True,
    }
    return {"input_ids": ids, "sampling_params": sampling, "stream": stream}


async def stream_one(
    url: str,
    index: int,
    body: dict[str, Any],
    *,
    gauge: OpenStreams | None = None,
    cut_after: int | None = None,
    reset: bool = False,
    conn: Connection | None = None,
) -> StreamResult:
    """One streaming /generate. ``cut_after``: close the connection after that many
    events (``reset``: with an RST instead of a FIN) and return, marked ``cut``."""
    res = StreamResult(index)
    own = conn is None
    conn = conn or Connection.for_url(url)
    start = time.perf_counter()
    held = False
    try:
        resp = await conn.request("POST", "/generate", body)
        res.status = resp.status
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
            return res
        if gauge is not None:
            gauge.opened()
            held = True
        if cut_after is not None and cut_after <= 0:
            res.cut = True
            conn.close(reset)
            return res
        async for payload in resp.sse():
            if payload == b"[DONE]":
                res.done = True
                continue
            event = json.loads(payload)
            if "error" in event:
                res.error = f"stream error: {event['error'].get('message')}"
                continue
            res.events += 1
            res.tokens += len(event["output_ids"])
            meta = event["meta_info"]
            res.completion_tokens = meta["completion_tokens"]
            if meta.get("finish_reason") is not None:
                res.finish_reason = meta["finish_reason"]
            if cut_after is not None and res.events >= cut_after:
                res.cut = True
                conn.close(reset)
                return res
        if res.error is None and not res.done:
            res.error = "stream ended without [DONE]"
        elif res.error is None and res.finish_reason is None:
            res.error = "stream ended without a finish_reason"
    except Exception as exc:  # noqa: BLE001 - every failure is a counted error
        res.error = f"{type(exc).__name__}: {exc}"
        conn.close()
    finally:
        res.elapsed = time.perf_counter() - start
        if held and gauge is not None:
            gauge.closed()
        if own:
            conn.close()
    return res


# --- the run ------------------------------------------------------------------------------------


async def warm_up(url: str) -> int:
    """The vocabulary size, after one short request so the model's first (slow) forward
    is not timed."""
    info = await get_json(url, "/server_info")
    conn = Connection.for_url(url)
    try:
        resp = await conn.request(
            "POST",
            "/generate",
            {
                "input_ids": [16, 17, 18, 19],
                "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            },
        )
        await resp.read()
        if resp.status != 200:
            raise HttpError(f"warm-up request failed: HTTP {resp.status}")
    finally:
        conn.close()
    return int(info["vocab_size"])


async def run_load(
    url: str,
    clients: int = DEFAULT_CLIENTS,
    *,
    max_new_tokens: int = 32,
    prompt_len: int = 16,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Runs ``clients`` streams at once; returns the summary (and ``results``, one
    ``StreamResult`` per stream, which the JSON output leaves out)."""
    soft = raise_open_files_limit(clients + 64)
    if soft != resource.RLIM_INFINITY and soft < clients + 64:
        raise RuntimeError(
            f"open files limit {soft} is too low for {clients} connections (ulimit -n)"
        )
    vocab = await warm_up(url)
    gauge = OpenStreams()
    bodies = [
        make_body(i, vocab=vocab, prompt_len=prompt_len, max_new_tokens=max_new_tokens, seed=seed)
        for i in range(clients)
    ]

    async def guarded(i: int) -> StreamResult:
        try:
            return await asyncio.wait_for(stream_one(url, i, bodies[i], gauge=gauge), timeout)
        except TimeoutError:
            return StreamResult(i, error=f"timed out after {timeout:.0f} s")

    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(i) for i in range(clients)))
    wall = time.perf_counter() - t0
    config = {
        "clients": clients,
        "max_new_tokens": max_new_tokens,
        "prompt_len": prompt_len,
        "seed": seed,
        "url": url,
    }
    return summarize(results, wall, held=gauge.max, config=config)


def summarize(
    results: Sequence[StreamResult], wall: float, *, held: int, config: dict[str, Any]
) -> dict[str, Any]:
    errors = [r for r in results if r.error is not None]
    tokens = sum(r.tokens for r in results)
    mismatched = [r for r in results if r.tokens_lost]
    return {
        "config": config,
        "streams": len(results),
        "held": held,
        "errors": len(errors),
        "error_examples": sorted({r.error for r in errors if r.error})[:5],
        "tokens_lost": sum(r.tokens_lost for r in results),
        "streams_with_lost_tokens": len(mismatched),
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "results": list(results),
    }


def format_table(summary: dict[str, Any]) -> str:
    rows = [
        ("streams", f"{summary['streams']}"),
        ("held (max open at once)", f"{summary['held']}"),
        ("errors", f"{summary['errors']}"),
        (
            "tokens lost",
            f"{summary['tokens_lost']} ({summary['streams_with_lost_tokens']} streams)",
        ),
        ("tokens streamed", f"{summary['tokens']}"),
        ("wall time", f"{summary['wall_s']:.2f} s"),
        ("tokens/s", f"{summary['tokens_per_s']:.0f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines += [f"  error: {e}" for e in summary["error_examples"]]
    return "\n".join(lines)


def to_json(summary: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in summary.items() if k != "results"}
    return out


# --- launching a server -------------------------------------------------------------------------


# --- main ---------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:30000")
    where.add_argument(
        "--launch",
        action="store_true",
        help="start tokenpipe serve on a free port, stop it at the end",
    )
    p.add_argument(
        "--server-args",
        default="--log-level warning",
        help="flags for the launched server (one string)",
    )
    p.add_argument(
        "--clients", type=int, default=DEFAULT_CLIENTS, help="concurrent streaming clients"
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each stream may take")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON ('-' for stdout)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    kwargs = dict(
        clients=args.clients,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        seed=args.seed,
        timeout=args.timeout,
    )
    if args.launch:
        with LaunchedServer(
            [INCREMENTAL_STREAMS, *shlex.split(args.server_args)], open_files=args.clients + 256
        ) as server:
            summary = uvloop.run(run_load(server.url, **kwargs))
    else:
        summary = uvloop.run(run_load(args.url, **kwargs))
    print(format_table(summary))
    emit_json(args.json, to_json(summary))
    return 0 if summary["errors"] == 0 and summary["tokens_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
