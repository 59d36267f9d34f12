"""Rollout benchmark: what new weights cost a server under load (docs/design/rollout.md).

Against servers it launches, each serving checkpoint A of one size (written by transformers):
1. update latency: with --streams streaming requests running, POST /pause_generation
   (retract), /update_weights_from_disk (B, then A, in turn; version step-K) and
   /continue_generation, timed whole and the update call alone over --trials; every stream
   must finish and a fresh request must name the new version;
2. throughput, on the first size's server: output tokens/s of --clients closed-loop streams
   over --duration with an update every --update-every seconds, against a run as long
   without updates. Timings are printed, never judged; the checks set the exit code.
Usage and figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import re
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import uvloop

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.json_output import emit_json
from bench import load  # noqa: E402
from bench.family_checkpoints import Shape, write  # noqa: E402
from bench.launch import INCREMENTAL_STREAMS, LaunchedServer  # noqa: E402
from bench.rollout_client import (  # noqa: E402
    PAUSED_TOTAL,
    UPDATE_COUNT,
    UPDATE_SUM,
    Stream,
    UpdateTiming,
    metric_totals,
    stream_client,
    stream_fault,
    stream_generate,
    update_once,
)
from pipeline.model_config import default_model_config  # noqa: E402
from pipeline.tokenizer_loader import SHIPPED_VOCAB_SIZE  # noqa: E402

RUNS = ("without", "with_updates")  # the throughput runs, in the order they run


@dataclass(frozen=True)
class Config:
    trials: int = 5
    streams: int = 8  # streams running during each latency trial
    max_new_tokens: int = 64  # every request's length (ignore_eos)
    prompt_len: int = 16
    clients: int = 8  # closed-loop streams of the throughput runs
    duration: float = 30.0  # seconds of each throughput run
    update_every: float = 10.0
    rounds: int = 2  # pairs of throughput runs, which goes first swapped each round
    seed: int = 0
    server_args: tuple[str, ...] = ()


def size_shape(name: str) -> Shape:
    """``default``: the built-in model's shape; ``100m``: a GPT-2-small-like Llama (the
    shipped vocabulary, so about 91M parameters); ``HIDDENxLAYERS``: heads of 32 as in
    family_checkpoints.py's command line."""
    if name == "default":
        c = default_model_config(SHIPPED_VOCAB_SIZE)
        return Shape(
            hidden=c.hidden_size,
            layers=c.num_hidden_layers,
            heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads,
            intermediate=c.intermediate_size,
            positions=c.max_position_embeddings,
        )
    if name == "100m":
        return Shape(hidden=768, layers=12, heads=12, kv_heads=12, intermediate=2048)
    match = re.fullmatch(r"(\d+)x(\d+)", name)
    if match is None:
        raise ValueError(f"size {name!r}: want default, 100m or HIDDENxLAYERS (as 64x1)")
    hidden, layers = int(match[1]), int(match[2])
    return Shape(
        hidden=hidden,
        layers=layers,
        heads=max(1, hidden // 32),
        kv_heads=max(1, hidden // 64),
        intermediate=2 * hidden,
    )


def checkpoint_size(directory: Path) -> tuple[int, int]:
    """(parameters, bytes) of a checkpoint's safetensors files, the count read from their
    headers (8 bytes of length, then JSON naming each tensor's shape)."""
    parameters, files = 0, sorted(directory.glob("*.safetensors"))
    for path in files:
        with path.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        parameters += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return parameters, sum(p.stat().st_size for p in files)


@dataclass
class Checkpoints:
    """A (served at start) and B of one shape; the updates go to B, A, B... and count the
    server's versions."""

    paths: tuple[Path, Path]
    parameters: int
    bytes: int
    updates: int = 0

    @property
    def version(self) -> str:
        return f"step-{self.updates}" if self.updates else "default"

    def next_update(self) -> tuple[str, str]:
        self.updates += 1
        return str(self.paths[self.updates % 2]), self.version


def write_checkpoints(root: Path, name: str, seed: int) -> Checkpoints:
    paths = (root / f"{name}-a", root / f"{name}-b")
    for i, path in enumerate(paths):
        write(path, "llama", shape=size_shape(name), seed=seed + i)
    return Checkpoints(paths, *checkpoint_size(paths[0]))


class Bodies:
    """Distinct prompts of random ids, temperature 0.7, seeded, ignore_eos (load.py's)."""

    def __init__(self, vocab: int, cfg: Config) -> None:
        self.vocab, self.cfg, self._index = vocab, cfg, itertools.count()

    def body(self, stream: bool = True) -> dict[str, Any]:
        c = self.cfg
        return load.make_body(
            next(self._index),
            vocab=self.vocab,
            prompt_len=c.prompt_len,
            max_new_tokens=c.max_new_tokens,
            seed=c.seed,
            stream=stream,
        )


# --- 1. update latency ----------------------------------------------------------------------


async def latency_trial(
    url: str, ctl: httpx.AsyncClient, checkpoints: Checkpoints, bodies: Bodies
) -> dict[str, Any]:
    """One update while ``streams`` requests stream (each has had an event: admitted)."""
    want = bodies.cfg.max_new_tokens
    async with stream_client(url) as client:
        streams = [Stream() for _ in range(bodies.cfg.streams)]
        tasks = [asyncio.create_task(stream_generate(client, bodies.body(), s)) for s in streams]
        await asyncio.gather(*(s.begun.wait() for s in streams))
        timing = await update_once(ctl, *checkpoints.next_update())
        await asyncio.gather(*tasks)
    fresh = await ctl.post("/generate", json=bodies.body(stream=False))
    faults = [f for f in (stream_fault(s, want) for s in streams) if f is not None]
    return {
        **asdict(timing),
        "version": checkpoints.version,
        "streams_finished": len(streams) - len(faults),
        "streams_ending_on_new_version": sum(
            s.weight_version == checkpoints.version for s in streams
        ),
        "faults": faults,
        "fresh_version": fresh.json()["meta_info"]["weight_version"],
        "server_version": (await ctl.get("/get_weight_version")).json()["weight_version"],
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def latency_summary(
    trials: list[dict[str, Any]], before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    updates = after[UPDATE_COUNT] - before[UPDATE_COUNT]
    return {
        "trials": trials,
        "pause_to_continue_s": spread([t["total_s"] for t in trials]),
        "update_call_s": spread([t["update_s"] for t in trials]),
        "pause_call_s": spread([t["pause_s"] for t in trials]),
        "continue_call_s": spread([t["continue_s"] for t in trials]),
        "paused_requests": spread([t["paused_requests"] for t in trials]),
        "server_updates_counted": updates,
        "server_update_s_mean": (after[UPDATE_SUM] - before[UPDATE_SUM]) / max(updates, 1),
        "all_streams_finished": all(not t["faults"] for t in trials),
        "versions_ok": updates == len(trials)
        and all(t["fresh_version"] == t["server_version"] == t["version"] for t in trials),
    }


# --- 2. throughput --------------------------------------------------------------------------


async def closed_loop(url: str, bodies: Bodies, until: float) -> list[Stream]:
    """``clients`` streams, each sending its next request when one ends, until ``until``;
    the streams open then are cut there."""
    streams: list[Stream] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            streams.append(Stream())
            await stream_generate(client, bodies.body(), streams[-1], until)

    async with stream_client(url) as client:
        tasks = [asyncio.create_task(client_loop(client)) for _ in range(bodies.cfg.clients)]
        await asyncio.sleep(max(0.0, until - time.monotonic()))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return streams


async def update_every(
    ctl: httpx.AsyncClient, checkpoints: Checkpoints, start: float, until: float, every: float
) -> list[UpdateTiming]:
    """An update at start + every, + 2 every... while before ``until`` (one that is late
    starts when the one before it ends)."""
    timings = []
    at = start + every
    while at < until:
        await asyncio.sleep(max(0.0, at - time.monotonic()))
        timings.append(await update_once(ctl, *checkpoints.next_update()))
        at += every
    return timings


async def throughput_run(
    url: str, ctl: httpx.AsyncClient, checkpoints: Checkpoints, bodies: Bodies, updates: bool
) -> dict[str, Any]:
    cfg = bodies.cfg
    before = await metric_totals(ctl)
    start = time.monotonic()
    until = start + cfg.duration
    updater = asyncio.create_task(
        update_every(ctl, checkpoints, start, until, cfg.update_every if updates else math.inf)
    )
    streams = await closed_loop(url, bodies, until)
    timings = await updater
    after = await metric_totals(ctl)
    finished = [s for s in streams if s.finished]
    cut = [s for s in streams if not s.finished and s.error is None]
    faults = [f for f in (stream_fault(s, cfg.max_new_tokens) for s in finished) if f]
    faults += [s.error for s in streams if not s.finished and s.error is not None]
    tokens = sum(s.tokens for s in finished) + sum(s.tokens for s in cut)
    version = (await ctl.get("/get_weight_version")).json()["weight_version"]
    return {
        "seconds": cfg.duration,
        "updates": len(timings),
        "update_total_s": [t.total_s for t in timings],
        "paused_s": after[PAUSED_TOTAL] - before[PAUSED_TOTAL],
        "requests_finished": len(finished),
        "requests_cut": len(cut),
        "tokens_finished": sum(s.tokens for s in finished),
        "tokens_cut": sum(s.tokens for s in cut),
        "tokens": tokens,
        "tokens_per_s": tokens / cfg.duration,
        "errors": len(faults),
        "error_examples": sorted(set(faults))[:5],
        "versions_ok": version == checkpoints.version,
    }


# --- the run --------------------------------------------------------------------------------


async def serve_size(
    url: str, checkpoints: Checkpoints, cfg: Config, throughput: bool
) -> dict[str, Any]:
    bodies = Bodies(await load.warm_up(url), cfg)
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as ctl:
        before = await metric_totals(ctl)
        trials = [await latency_trial(url, ctl, checkpoints, bodies) for _ in range(cfg.trials)]
        result = latency_summary(trials, before, await metric_totals(ctl))
        if throughput:
            rounds = [
                await throughput_round(url, ctl, checkpoints, bodies, k) for k in range(cfg.rounds)
            ]
            result["throughput"] = throughput_summary(rounds)
    return result


async def throughput_round(
    url: str, ctl: httpx.AsyncClient, checkpoints: Checkpoints, bodies: Bodies, k: int
) -> dict[str, Any]:
    """Both runs, the one without updates first in even rounds, second in odd ones."""
    order = RUNS if k % 2 == 0 else RUNS[::-1]
    runs = {
        key: await throughput_run(url, ctl, checkpoints, bodies, key != RUNS[0]) for key in order
    }
    return {"first": order[0], **runs, "ratio": ratio(runs[RUNS[1]], runs[RUNS[0]])}


def ratio(with_updates: dict[str, Any], without: dict[str, Any]) -> float | None:
    """Tokens/s with updates over tokens/s without (None when the second is 0)."""
    base = without["tokens"] / without["seconds"]
    return with_updates["tokens"] / with_updates["seconds"] / base if base else None


def throughput_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Every round, each run's tokens/s over all rounds and the ratio of those."""
    totals = {
        key: {f: sum(r[key][f] for r in rounds) for f in ("tokens", "seconds")} for key in RUNS
    }
    return {
        "rounds": rounds,
        **{f"{key}_tokens_per_s": t["tokens"] / t["seconds"] for key, t in totals.items()},
        "ratio": ratio(totals[RUNS[1]], totals[RUNS[0]]),
    }


def measure_size(name: str, root: Path, cfg: Config, throughput: bool) -> dict[str, Any]:
    print(f"rollout: {name}: writing checkpoints A and B", file=sys.stderr, flush=True)
    checkpoints = write_checkpoints(root, name, cfg.seed)
    args = [INCREMENTAL_STREAMS, "--model-path", str(checkpoints.paths[0]), *cfg.server_args]
    print(f"rollout: {name}: {checkpoints.parameters:,} parameters", file=sys.stderr, flush=True)
    with LaunchedServer(args) as server:
        result = uvloop.run(serve_size(server.url, checkpoints, cfg, throughput))
    return {
        "name": name,
        "shape": asdict(size_shape(name)),
        "parameters": checkpoints.parameters,
        "checkpoint_bytes": checkpoints.bytes,
        **result,
    }


def run(cfg: Config, sizes: Sequence[str], workdir: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rollout-") as scratch:
        root = workdir or Path(scratch)
        measured = [measure_size(name, root, cfg, k == 0) for k, name in enumerate(sizes)]
    checks = [m["all_streams_finished"] and m["versions_ok"] for m in measured]
    for r in measured[0]["throughput"]["rounds"]:
        checks += [r[key]["errors"] == 0 and r[key]["versions_ok"] for key in RUNS]
    return {"config": asdict(cfg), "sizes": measured, "ok": all(checks)}


def format_report(result: dict[str, Any]) -> str:
    def mmm(d: dict[str, float]) -> str:
        return f"{d['median']:.3f} ({d['min']:.3f}-{d['max']:.3f})"

    cfg = result["config"]
    lines = [
        f"update latency: pause (retract) -> update from disk -> continue, {cfg['streams']} "
        f"streams of {cfg['max_new_tokens']} tokens running; seconds median (min-max)",
        "",
        "| size | parameters | checkpoint MiB | trials | paused reqs | pause->continue s "
        "| update call s | server update s (mean) | streams finished | versions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m in result["sizes"]:
        finished = sum(t["streams_finished"] for t in m["trials"])
        lines.append(
            f"| {m['name']} | {m['parameters']:,} | {m['checkpoint_bytes'] / 2**20:.1f} "
            f"| {len(m['trials'])} | {m['paused_requests']['median']:g} "
            f"| {mmm(m['pause_to_continue_s'])} | {mmm(m['update_call_s'])} "
            f"| {m['server_update_s_mean']:.3f} | {finished}/{len(m['trials']) * cfg['streams']} "
            f"| {'ok' if m['versions_ok'] else 'WRONG'} |"
        )
    if result["sizes"] and "throughput" in result["sizes"][0]:
        lines += ["", *format_throughput(result["sizes"][0], cfg)]
    return "\n".join(lines)


def format_throughput(size: dict[str, Any], cfg: dict[str, Any]) -> list[str]:
    t = size["throughput"]
    lines = [
        f"throughput ({size['name']}): {cfg['clients']} closed-loop streams, "
        f"{cfg['duration']:g} s each run, {cfg['rounds']} rounds (order swapped each round); "
        "tokens: completion_tokens of the finished requests plus, for those cut at the end, "
        "of their last event before it",
        "",
        "| round | run | updates | paused s | finished | cut | tokens | tokens/s | errors "
        "| versions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    labels = dict(zip(RUNS, ("no updates", f"update every {cfg['update_every']:g} s")))
    for k, row in enumerate(t["rounds"], 1):
        for key in RUNS if row["first"] == RUNS[0] else RUNS[::-1]:
            r = row[key]
            lines.append(
                f"| {k} | {labels[key]} | {r['updates']} | {r['paused_s']:.2f} "
                f"| {r['requests_finished']} | {r['requests_cut']} | {r['tokens']} "
                f"| {r['tokens_per_s']:.1f} | {r['errors']} "
                f"| {'ok' if r['versions_ok'] else 'WRONG'} |"
            )
    per_round = ", ".join(times(row["ratio"]) for row in t["rounds"])
    lines += [
        "",
        f"with updates / without: {times(t['ratio'])} over all rounds "
        f"({t['with_updates_tokens_per_s']:.1f} / {t['without_tokens_per_s']:.1f} tokens/s); "
        f"per round {per_round}",
    ]
    lines += [
        f"  error: {e}" for row in t["rounds"] for key in RUNS for e in row[key]["error_examples"]
    ]
    return lines


def times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def parse_args(argv: Sequence[str] | None) -> tuple[Config, list[str], argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--sizes",
        default="default,100m",
        help="checkpoint sizes, comma-separated: default, 100m or HIDDENxLAYERS; the "
        "throughput runs on the first",
    )
    p.add_argument("--skip-100m", action="store_true", help="leave 100m out of --sizes")
    p.add_argument("--trials", type=int, default=Config.trials)
    p.add_argument("--streams", type=int, default=Config.streams)
    p.add_argument("--max-new-tokens", type=int, default=Config.max_new_tokens)
    p.add_argument("--prompt-len", type=int, default=Config.prompt_len)
    p.add_argument("--clients", type=int, default=Config.clients, help="throughput's streams")
    p.add_argument("--duration", type=float, default=Config.duration, help="seconds per run")
    p.add_argument("--update-every", type=float, default=Config.update_every)
    p.add_argument("--rounds", type=int, default=Config.rounds, help="pairs of throughput runs")
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument("--server-args", default="", help="more flags for the servers (one string)")
    p.add_argument("--workdir", type=Path, help="write (and keep) the checkpoints here")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON ('-' for stdout)")
    args = p.parse_args(argv)
    sizes = [s for s in args.sizes.split(",") if s and not (args.skip_100m and s == "100m")]
    for name in sizes:
        try:
            size_shape(name)
        except ValueError as exc:
            p.error(str(exc))
    if not sizes or min(args.trials, args.streams, args.clients, args.rounds) < 1:
        p.error("--sizes, --trials, --streams, --clients and --rounds need at least one")
    cfg = Config(
        trials=args.trials,
        streams=args.streams,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        clients=args.clients,
        duration=args.duration,
        update_every=args.update_every,
        rounds=args.rounds,
        seed=args.seed,
        server_args=tuple(shlex.split(args.server_args)),
    )
    return cfg, sizes, args


def main(argv: Sequence[str] | None = None) -> int:
    cfg, sizes, args = parse_args(argv)
    result = run(cfg, sizes, args.workdir)
    print(format_report(result))
    emit_json(args.json, result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
