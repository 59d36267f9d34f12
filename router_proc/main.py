"""The router process: the app on uvicorn with uvloop, and one pooled HTTP client to the
two servers behind it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import httpx
import uvicorn
import uvloop

from router_proc.app import build_app
from router_proc.config import RouterConfig

logger = logging.getLogger("tokenpipe.router")


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM once ``serve()`` returns, which would kill the
    process before the client pool closes. Here the signal only starts uvicorn's graceful
    shutdown, and the process then exits 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _serve(config: RouterConfig) -> None:
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.request_timeout, connect=config.connect_timeout),
        # No pool cap: each client request holds two server connections for its whole life,
        # and a cap would queue requests behind others' streams. The servers bound the load.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        # The servers are private peers: never send their traffic through an HTTP(S)_PROXY.
        trust_env=False,
    )
    server = _Server(
        uvicorn.Config(
            build_app(config, client),
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
        logger.info("router on http://%s:%d -> prefill %s, decode %s", config.host, config.port, config.prefill_url, config.decode_url)
    try:
        await serving
    finally:
        await client.aclose()
    if not server.started:
        raise SystemExit(f"the router could not start on {config.host}:{config.port}")


def run_router(config: RouterConfig) -> None:
    # httpx logs every call at INFO: two lines per client request would drown the router's own.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    uvloop.run(_serve(config))
