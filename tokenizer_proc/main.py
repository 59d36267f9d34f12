"""The API process: the tokenizer manager and its HTTP server on uvicorn with uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn
import uvloop
import zmq

from pipeline.config import ServerConfig
from pipeline.process_util import report_ready
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.model_limits import context_length_of
from tokenizer_proc.http_server import build_app
from tokenizer_proc.tokenizer_manager import TokenizerManager

logger = logging.getLogger("tokenpipe.api")


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM once ``serve()`` returns, which would kill the
    process before the tokenizer manager closes (flushing queued spans). Here the signal
    only starts uvicorn's graceful shutdown, and the process then exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _serve(config: ServerConfig) -> None:
    tokenizer = load_tokenizer(config.model_path)
    tm = TokenizerManager(config, tokenizer, context_length=context_length_of(config, tokenizer.vocab_size))
    await tm.start()
    app = build_app(tm)
    server = _Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="none",
            log_level=config.log_level.lower(),
            access_log=False,
            timeout_graceful_shutdown=int(config.graceful_timeout) or None,
        )
    )
    serving = asyncio.create_task(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        ctx = zmq.Context()
        report_ready(ctx, config, "api")
        ctx.destroy(linger=0)
        logger.info("serving %s on http://%s:%d", tm.model_name, config.host, config.port)
    try:
        await serving
    finally:
        await tm.close()
    if not server.started:
        raise SystemExit(f"the HTTP server could not start on {config.host}:{config.port}")


def run_api(config: ServerConfig) -> None:
    uvloop.run(_serve(config))
