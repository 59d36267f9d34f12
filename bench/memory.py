"""Memory benchmark: many short requests, then is any process growing, and is any
per-request state left behind?

After a warm-up (allocator pools, caches and lazily built state fill up there) and again at
the end, with the server idle, it reads the resident set size of the scheduler, the
detokenizer and the API process: growth must stay under a target in every one. Then the
per-request state must be gone (the API's ``ReqState``s, the scheduler's requests and the
detokenizer's decode states), and every answer is checked. ``--malloc-trim`` tells a leak
from allocator retention: after each raw sample it calls glibc's ``malloc_trim(0)`` in every
process (through ``gdb -p``) and samples again; freed heap that glibc kept shows in the raw
RSS only, live objects that pile up show in both. Usage and figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from dataclasses import dataclass
from typing import Any

import uvloop


if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.json_output import emit_json
from bench import load  # noqa: E402
from bench.launch import INCREMENTAL_STREAMS, LaunchedServer, child_roles  # noqa: E402

ROLES = ("scheduler", "detokenizer", "api")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def sample_rss(pids: dict[str, int]) -> dict[str, int]:
    return {role: rss_kib(pids[role]) for role in ROLES}


def malloc_trim(pid: int) -> None:
    """Makes glibc give freed heap back to the OS in another process (through gdb)."""
    gdb = shutil.which("gdb")
    if gdb is None:
        raise RuntimeError("--malloc-trim needs gdb")
    done = subprocess.run(
        [gdb, "-p", str(pid), "-batch", "-ex", "call (int)malloc_trim(0)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "$1 = " not in done.stdout:
        raise RuntimeError(
            f"gdb could not call malloc_trim in pid {pid}: {(done.stdout + done.stderr)[-500:]}"
        )


def sample_trimmed(pids: dict[str, int]) -> dict[str, int]:
    for role in ROLES:
        malloc_trim(pids[role])
    return sample_rss(pids)


def growth_percent(start: dict[str, int], end: dict[str, int]) -> dict[str, float]:
    return {r: (end[r] - start[r]) * 100.0 / start[r] for r in ROLES}


async def wait_idle(url: str, timeout: float = 60.0, min_steps: int = 0) -> dict[str, Any]:
    """/server_info once the API holds no request and the scheduler's latest report (newer
    than ``min_steps`` forward steps) says it holds none either. Returns the last answer
    even when the timeout passed, for the report to show what was left."""
    deadline = time.monotonic() + timeout
    while True:
        info = await load.get_json(url, "/server_info")
        sched = info.get("scheduler") or {}
        if (
            info["live_requests"] == 0
            and sched.get("live_reqs") == 0
            and sched.get("detokenizer_live_reqs") == 0
            and sched.get("forward_steps_total", 0) >= min_steps
        ):
            return info
        if time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.1)


def leftover_state(info: dict[str, Any]) -> dict[str, Any]:
    sched = info.get("scheduler") or {}
    return {
        "live_requests": info.get("live_requests"),
        "scheduler_live_reqs": sched.get("live_reqs"),
        "detokenizer_live_reqs": sched.get("detokenizer_live_reqs"),
        "token_usage": sched.get("token_usage"),
    }


def no_state_left(left: dict[str, Any]) -> bool:
    return (
        left["live_requests"] == 0
        and left["scheduler_live_reqs"] == 0
        and left["detokenizer_live_reqs"] == 0
        and left["token_usage"] == 0.0
    )


class Traffic:
    """Hands out request indices to the clients and counts the results."""

    def __init__(
        self,
        vocab: int,
        *,
        prompt_len: int,
        max_new_tokens: int,
        stream_ratio: float,
        seed: int,
        progress: bool,
    ) -> None:
        self.vocab, self.prompt_len, self.max_new_tokens = vocab, prompt_len, max_new_tokens
        self.stream_ratio, self.seed, self.progress = stream_ratio, seed, progress
        self.next = 0
        self.done = 0
        self.errors = 0
        self.error_examples: list[str] = []
        self.tokens = 0
        self.total = 0
        self._last_print = 0.0

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_examples) < 5 and message not in self.error_examples:
            self.error_examples.append(message)

    async def one(self, conn: load.Connection, i: int) -> None:
        stream = (i * 0.6180339887) % 1.0 < self.stream_ratio  # spread evenly, reproducibly
        body = load.make_body(
            i,
            vocab=self.vocab,
            prompt_len=self.prompt_len,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            stream=stream,
        )
        want = self.max_new_tokens
        if stream:
            res = await load.stream_one("", i, body, conn=conn)
            if res.error is not None:
                self.error(res.error)
            elif res.tokens != want or res.completion_tokens != want:
                self.error(
                    f"stream got {res.tokens} tokens, "
                    f"completion_tokens {res.completion_tokens}, wanted {want}"
                )
            self.tokens += res.tokens
            return
        try:
            resp = await conn.request("POST", "/generate", body)
            data = await resp.json()
        except Exception as exc:  # noqa: BLE001 - every failure is a counted error
            conn.close()
            self.error(f"{type(exc).__name__}: {exc}")
            return
        if resp.status != 200:
            self.error(f"HTTP {resp.status}: {str(data)[:200]}")
            return
        got, completion = len(data["output_ids"]), data["meta_info"]["completion_tokens"]
        if got != want or completion != want:
            self.error(f"got {got} tokens, completion_tokens {completion}, wanted {want}")
        self.tokens += got

    async def client(self, url: str) -> None:
        conn = load.Connection.for_url(url)
        try:
            while self.next < self.total:
                i = self.next
                self.next += 1
                await self.one(conn, i)
                self.done += 1
                self._report()
        finally:
            conn.close()

    def _report(self) -> None:
        now = time.monotonic()
        if self.progress and (now - self._last_print > 10.0 or self.done == self.total):
            self._last_print = now
            print(
                f"  {self.done}/{self.total} requests, {self.errors} errors",
                file=sys.stderr,
                flush=True,
            )

    async def run(self, url: str, upto: int, concurrency: int) -> float:
        """Sends requests until ``upto`` have been sent in all; returns the seconds it took."""
        self.total = upto
        t0 = time.perf_counter()
        await asyncio.gather(
            *(self.client(url) for _ in range(min(concurrency, max(1, upto - self.next))))
        )
        return time.perf_counter() - t0


@dataclass(frozen=True)
class Phase:
    """A phase of traffic and what was read once the server was idle after it."""

    seconds: float
    info: dict[str, Any]  # /server_info, idle
    rss: dict[str, int]  # KiB by role
    trimmed: dict[str, int] | None  # KiB by role after malloc_trim, with --malloc-trim


async def run_phase(
    traffic: Traffic, url: str, upto: int, concurrency: int, pids: dict[str, int], trim: bool
) -> Phase:
    """Sends requests until ``upto`` in all, waits until the server is idle, samples RSS."""
    seconds = await traffic.run(url, upto, concurrency)
    steps = ((await load.get_json(url, "/server_info")).get("scheduler") or {}).get(
        "forward_steps_total", 0
    )
    info = await wait_idle(url, min_steps=steps)
    return Phase(seconds, info, sample_rss(pids), sample_trimmed(pids) if trim else None)


async def measure(
    url: str,
    pids: dict[str, int],
    *,
    requests: int = 100_000,
    warmup: int = 5_000,
    concurrency: int = 64,
    max_new_tokens: int = 4,
    prompt_len: int = 8,
    stream_ratio: float = 0.5,
    seed: int = 0,
    target: float = 5.0,
    progress: bool = True,
    trim: bool = False,
) -> dict[str, Any]:
    missing = [r for r in ROLES if r not in pids]
    if missing:
        raise RuntimeError(
            f"no {', '.join(missing)} process found among the supervisor's children: {pids}"
        )
    warmup = min(warmup, requests)
    vocab = await load.warm_up(url)
    traffic = Traffic(
        vocab,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        stream_ratio=stream_ratio,
        seed=seed,
        progress=progress,
    )
    warm = await run_phase(traffic, url, warmup, concurrency, pids, trim)
    end = await run_phase(traffic, url, requests, concurrency, pids, trim)
    left = leftover_state(end.info)
    growth = growth_percent(warm.rss, end.rss)
    measured = requests - warmup
    return {
        "config": {
            "requests": requests,
            "warmup": warmup,
            "concurrency": concurrency,
            "max_new_tokens": max_new_tokens,
            "prompt_len": prompt_len,
            "stream_ratio": stream_ratio,
            "seed": seed,
            "target_percent": target,
            "url": url,
        },
        "pids": pids,
        "requests_done": traffic.done,
        "errors": traffic.errors,
        "error_examples": traffic.error_examples,
        "tokens": traffic.tokens,
        "warmup_s": warm.seconds,
        "measured_s": end.seconds,
        "requests_per_s": measured / end.seconds if end.seconds > 0 else 0.0,
        "rss_kib_warmup": warm.rss,
        "rss_kib_end": end.rss,
        "rss_growth_percent": growth,
        "growth_ok": all(g < target for g in growth.values()),
        "trimmed_rss_kib_warmup": warm.trimmed,
        "trimmed_rss_kib_end": end.trimmed,
        "trimmed_rss_growth_percent": growth_percent(warm.trimmed, end.trimmed)
        if warm.trimmed and end.trimmed
        else None,
        "state_left": left,
        "no_state_left": no_state_left(left),
    }


def format_table(result: dict[str, Any]) -> str:
    cfg = result["config"]
    trimmed = result["trimmed_rss_growth_percent"] is not None
    head = f"{'process':<12} {'warm-up RSS':>12} {'end RSS':>12} {'growth':>8}"
    lines = [head + (f" {'trimmed: warm-up':>16} {'end':>12} {'growth':>8}" if trimmed else "")]
    for role in ROLES:
        w, e, g = (
            result["rss_kib_warmup"][role],
            result["rss_kib_end"][role],
            result["rss_growth_percent"][role],
        )
        line = f"{role:<12} {w / 1024:>8.1f} MiB {e / 1024:>8.1f} MiB {g:>+7.2f}%"
        if trimmed:
            tw, te = result["trimmed_rss_kib_warmup"][role], result["trimmed_rss_kib_end"][role]
            tg = result["trimmed_rss_growth_percent"][role]
            line += f" {tw / 1024:>12.1f} MiB {te / 1024:>8.1f} MiB {tg:>+7.2f}%"
        lines.append(line)
    left = result["state_left"]
    lines += [
        f"requests: {result['requests_done']} ({cfg['warmup']} warm-up), "
        f"errors: {result['errors']}, {result['warmup_s'] + result['measured_s']:.1f} s, "
        f"{result['requests_per_s']:.0f} req/s after the warm-up",
        f"growth target < {cfg['target_percent']:g}%: {'met' if result['growth_ok'] else 'MISSED'}",
        f"state left: live_requests={left['live_requests']} "
        f"scheduler.live_reqs={left['scheduler_live_reqs']} "
        f"scheduler.detokenizer_live_reqs={left['detokenizer_live_reqs']} "
        f"token_usage={left['token_usage']}"
        f" -> {'none' if result['no_state_left'] else 'LEFT BEHIND'}",
    ]
    lines += [f"  error: {e}" for e in result["error_examples"]]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--launch",
        action="store_true",
        help="start tokenpipe serve on a free port (the default without --url)",
    )
    p.add_argument("--url", help="a running server; needs --supervisor-pid")
    p.add_argument(
        "--supervisor-pid", type=int, help="pid of the running server's `tokenpipe serve`"
    )
    p.add_argument(
        "--server-args",
        default="--log-level warning",
        help="flags for the launched server (one string)",
    )
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--warmup", type=int, default=5_000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--stream-ratio", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", type=float, default=5.0, help="largest RSS growth allowed, percent")
    p.add_argument(
        "--malloc-trim",
        action="store_true",
        help="also sample RSS after glibc malloc_trim(0) in each process (needs gdb)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout)")
    args = p.parse_args(argv)
    if args.url and args.launch:
        p.error("give --url or --launch, not both")
    if args.url and args.supervisor_pid is None:
        p.error("--url needs --supervisor-pid (the RSS of its children is measured)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    kwargs = dict(
        requests=args.requests,
        warmup=args.warmup,
        concurrency=args.concurrency,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        stream_ratio=args.stream_ratio,
        seed=args.seed,
        target=args.target,
        progress=not args.no_progress,
        trim=args.malloc_trim,
    )
    if args.url:
        result = uvloop.run(measure(args.url, child_roles(args.supervisor_pid), **kwargs))
    else:
        with LaunchedServer([INCREMENTAL_STREAMS, *shlex.split(args.server_args)]) as server:
            result = uvloop.run(measure(server.url, server.children(), **kwargs))
    print(format_table(result))
    emit_json(args.json, result)
    return 0 if result["errors"] == 0 and result["no_state_left"] and result["growth_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
