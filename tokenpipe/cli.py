"""``tokenpipe``: ``serve`` runs the whole service under the supervisor; ``scheduler``,
``detokenizer`` and ``api`` run one process each, with explicit endpoints."""

from __future__ import annotations

import argparse

from pipeline.config import ServerConfig
from pipeline.server_args import add_server_args, config_from_args
from pipeline.storage_dir import storage_dir_problem
from pipeline.model_config import context_length_of
from pipeline.process_util import setup_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenpipe", description="LLM serving pipeline: scheduler, detokenizer, HTTP API"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_args(sub.add_parser("serve", help="run all three processes under a supervisor"))
    for name, what in (
        ("scheduler", "the scheduler process"),
        ("detokenizer", "the detokenizer process"),
        ("api", "the HTTP API process"),
    ):
        add_server_args(sub.add_parser(name, help=f"run {what} alone"))
    return parser


def _require_endpoints(config: ServerConfig, parser: argparse.ArgumentParser) -> None:
    endpoints = (
        ("--scheduler-input", config.scheduler_input),
        ("--detokenizer-input", config.detokenizer_input),
        ("--tokenizer-input", config.tokenizer_input),
    )
    missing = [flag for flag, value in endpoints if not value]
    if missing:
        parser.error(f"running one process needs explicit endpoints: {', '.join(missing)}")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.command == "serve" and config.hicache_storage_dir is not None:
        # serve runs the scheduler on this host: a bad directory fails here, not in a child.
        problem = storage_dir_problem(config.hicache_storage_dir)
        if problem is not None:
            parser.error(f"--hicache-storage-dir: {problem}")
    if config.model_path is not None and args.command != "detokenizer":
        # A checkpoint the decoder cannot serve (an architecture or config key it does not
        # implement, a context past its sliding window) fails here, in one line, not as a
        # traceback in each child.
        try:
            context_length_of(config, vocab_size=0)  # the vocabulary only sizes the built-in model
        except ValueError as exc:
            parser.error(f"--model-path: {exc}")
    setup_logging(config.log_level, args.command)
    if args.command == "serve":
        from tokenpipe.supervisor import serve

        return serve(config)
    _require_endpoints(config, parser)
    from pipeline.process_util import die_with_parent

    if args.command == "scheduler":
        from scheduler_proc.main import run_scheduler as run
    elif args.command == "detokenizer":
        from detokenizer_proc.main import run_detokenizer as run
    else:
        from tokenizer_proc.main import run_api as run
    if config.ready_endpoint is not None:  # started by a supervisor
        die_with_parent()
    run(config)
    return 0
