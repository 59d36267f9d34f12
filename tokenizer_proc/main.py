"""The API process: the tokenizer manager and its HTTP server on uvicorn with uvloop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os

import uvloop
import zmq

from pipeline.config import ServerConfig
from pipeline.http.edge import serve_http
from pipeline.model_config import context_length_of
from pipeline.process_util import METRICS_DIR_ENV, report_ready
from pipeline.tokenizer_loader import load_vocab
from tokenizer_proc.http.server import build_app
from tokenizer_proc.tokenizer_manager import TokenizerManager

logger = logging.getLogger("tokenpipe.api")


async def _serve(config: ServerConfig) -> None:
    several = config.api_workers > 1
    if several and config.enable_metrics and METRICS_DIR_ENV not in os.environ:
        # prometheus-client reads it when it is imported; `tokenpipe serve` sets it.
        raise SystemExit(
            f"--api-workers {config.api_workers} with metrics on: set {METRICS_DIR_ENV} to a "
            "directory the workers share"
        )
    # Under --skip-tokenizer-init only the model's configs are read, never a tokenizer file.
    vocab = load_vocab(config.model_path, skip_tokenizer_init=config.skip_tokenizer_init)
    tm = TokenizerManager(config, vocab, context_length=context_length_of(config, vocab.vocab_size))
    await tm.start()
    app = build_app(tm)

    reporting: list[asyncio.Task[None]] = []  # holds the task, so it is not collected

    def started() -> None:
        # Every streamed token allocates a few short-lived objects; refcounting frees them,
        # and the collector's frequent young-generation passes (every 700 allocations by
        # default) would mostly rescan the live requests' state. Start-up's objects are
        # frozen out of the scans altogether.
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        reporting.append(
            asyncio.get_running_loop().create_task(_report_ready_once_served(tm, config))
        )
        logger.info(
            "%s serving %s on http://%s:%d",
            config.api_name,
            tm.model_name,
            config.host,
            config.port,
        )

    # Counts the clients dropped for sending their request too slowly.
    def on_read_timeout() -> None:
        tm.metrics.requests.on_rejected("read_timeout")

    try:
        await serve_http(
            app, config, on_started=started, on_read_timeout=on_read_timeout, reuse_port=several
        )
    finally:
        await tm.close()


async def _report_ready_once_served(tm: TokenizerManager, config: ServerConfig) -> None:
    """Tells the supervisor this process is ready once the scheduler's report has reached it
    (``tm.ready``), so the ready line means /health answers 200, not that it soon will."""
    while not tm.ready:
        await asyncio.sleep(0.05)
    ctx = zmq.Context()
    report_ready(ctx, config, config.api_name)
    ctx.destroy(linger=0)


def run_api(config: ServerConfig) -> None:
    uvloop.run(_serve(config))
