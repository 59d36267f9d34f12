"""``--lora-adapters N`` of bench/serve.py: what serving LoRA adapters costs a serving run.

With ``--launch``, N adapters of ``--lora-rank`` are written (``bench.lora_adapters``, PEFT's
format, shaped from the served model) and the server starts with them (``--enable-lora
--lora-modules ... --max-loras N --max-lora-rank R``); every run's requests go round-robin
over the N adapters and the base model (``lora_path`` on /generate, ``model`` on the OpenAI
routes). ``--compare-lora`` then starts a second server with the same flags but no LoRA, both
up at once, warms it up with one unmeasured run, and runs ``run_rounds``: ``base`` (that
server, every request on the base model) against ``lora`` (the main server, requests
spread). The server's count of finished requests per adapter (``lora_requests_total`` on
/metrics) shows the adapters really ran. Usage and figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import re
import shlex
from dataclasses import replace
from typing import Any

import httpx

from bench.serve_client import LoadConfig
from bench.serve_compare import Arm, run_rounds
from bench.serve_load import run_load
from bench.serve_report import fmt_target

BASE, LORA = "base", "lora"  # the arms of --compare-lora
TARGET_LORA_RATIO = 0.7  # lora/base output tokens/s at 256 streams
LORA_FLAGS = ("--enable-lora", "--lora-modules", "--lora-paths", "--max-loras", "--max-lora-rank")
_REQUESTS_SERIES = re.compile(r'^\w+:lora_requests_total\{[^}]*lora_name="([^"]+)"[^}]*\} (\S+)$')


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-adapters",
        type=int,
        default=None,
        metavar="N",
        help="with --launch: write N LoRA adapters, serve them (--max-loras N) and spread the "
        "requests round-robin over them and the base model",
    )
    p.add_argument(
        "--lora-rank", type=int, default=16, help="--lora-adapters: their rank (default 16)"
    )
    p.add_argument(
        "--compare-lora",
        action="store_true",
        help="with --lora-adapters: also run the workload on a server without LoRA (every "
        "request on the base) against the LoRA server, in alternating rounds",
    )


def check_lora(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The LoRA flags checked against the rest (``p.error`` exits)."""
    if args.compare_lora and args.lora_adapters is None:
        p.error("--compare-lora needs --lora-adapters N")
    if args.lora_adapters is None:
        return
    if args.compare_vllm:
        p.error("--lora-adapters is tokenpipe's: not with --compare-vllm")
    if not args.launch:
        p.error("--lora-adapters needs --launch (it writes the adapters the server starts with)")
    if args.lora_adapters < 1 or args.lora_rank < 1:
        p.error("--lora-adapters and --lora-rank must be >= 1")
    given = [f for f in LORA_FLAGS if f in shlex.split(args.server_args)]
    if given:
        p.error(f"--lora-adapters sets the server's LoRA flags: leave {given} out of --server-args")


def model_path(server_args: list[str]) -> str | None:
    """The ``--model-path`` among ``tokenpipe serve`` flags (None: the built-in model)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model-path", default=None)
    known, _ = parser.parse_known_args(server_args)
    path: str | None = known.model_path
    return path


def spread(names: list[str]) -> tuple[str | None, ...]:
    """Request i names the i-th of the adapters and then the base model (None), in turn."""
    return (*names, None)


def lora_arms(cfg: LoadConfig, base: Arm, lora: Arm) -> dict[str, Arm]:
    """``base``'s server with every request on the base model; ``lora``'s with ``cfg``'s
    spread (the main run's)."""
    return {BASE: replace(base, cfg=replace(cfg, lora_names=())), LORA: replace(lora, cfg=cfg)}


async def adapter_requests(url: str) -> dict[str, int]:
    """The server's count of finished requests per adapter (its /metrics)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        resp = await client.get(f"{url}/metrics")
        resp.raise_for_status()
    counts: dict[str, int] = {}
    for line in resp.text.splitlines():
        match = _REQUESTS_SERIES.match(line)
        if match:
            counts[match[1]] = counts.get(match[1], 0) + int(float(match[2]))
    return counts


async def run_lora(arms: dict[str, Arm], rounds: int, prompt_set: int, rank: int) -> dict[str, Any]:
    """``base`` against ``lora`` in ``run_rounds`` (after a warm-up run of one request per
    client on the base server), and the LoRA server's requests per adapter over the whole
    run (the main run's included)."""
    # The base server's first run, unmeasured, as the main run was the LoRA server's: both
    # arms' rounds then start on a server that has run the whole batch before.
    base = arms[BASE]
    warm = replace(base.cfg, requests=base.cfg.concurrency, prompt_set=prompt_set, progress=False)
    await run_load(base.url, warm)
    result = await run_rounds(arms, rounds, prompt_set + 1)
    names = [n for n in arms[LORA].cfg.lora_names if n is not None]
    return {
        "adapters": names,
        "rank": rank,
        **result,
        "adapter_requests": await adapter_requests(arms[LORA].url),
    }


def fmt_lora(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    """The rounds' table, the medians, the ratio against its target, requests per adapter."""
    lines = [
        f"  base against LoRA: {BASE} = a server without LoRA, every request on the base "
        f"model; {LORA} = the main server, {len(s['adapters'])} adapters of rank {s['rank']} "
        f"and the base in turn; two servers up at once, {len(s['rounds'])} rounds "
        "(order swapped each round)",
        f"  {'round':<8}{'first':<8}{'base tok/s':>14}{'lora tok/s':>14}{'lora/base':>12}",
    ]
    for i, row in enumerate(s["rounds"], 1):
        lines.append(
            f"  {i:<8d}{row['first']:<8}{row[BASE]['output_tokens_per_s']:14.1f}"
            f"{row[LORA]['output_tokens_per_s']:14.1f}{fmt_ratio(row['ratio'])}"
        )
    lines.append(
        f"  {'median':<16}{s[BASE + '_output_tokens_per_s']:14.1f}"
        f"{s[LORA + '_output_tokens_per_s']:14.1f}{fmt_ratio(s['ratio'])}"
    )
    lines.append(
        f"  errors {s['errors']}, tokens lost {s['tokens_lost']} over the comparison's runs"
    )
    lines.append(fmt_target("lora/base", s["ratio"], TARGET_LORA_RATIO, c))
    per = ", ".join(f"{name} {n}" for name, n in sorted(s["adapter_requests"].items()))
    lines.append(f"  finished requests per adapter (the LoRA server's /metrics): {per or 'none'}")
    return lines


def fmt_ratio(value: float | None) -> str:
    return f"{value:11.3f}x" if value is not None else f"{'n/a':>12}"
