"""The router process: the app on uvicorn with uvloop, and one pooled HTTP client to the
two servers behind it."""

from __future__ import annotations

import logging

import httpx
import uvloop

from pipeline.http_edge import serve_http
from router_proc.app import build_app
from router_proc.config import RouterConfig

logger = logging.getLogger("tokenpipe.router")


async def _serve(config: RouterConfig) -> None:
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(config.request_timeout, connect=config.connect_timeout),
        # No pool cap: each client request holds two server connections for its whole life,
        # and a cap would queue requests behind others' streams. The servers bound the load.
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        # The servers are private peers: never send their traffic through an HTTP(S)_PROXY.
        trust_env=False,
    )

    def started() -> None:
        logger.info("router on http://%s:%d -> prefill %s, decode %s", config.host, config.port, config.prefill_url, config.decode_url)

    try:
        await serve_http(build_app(config, client), config, on_started=started)
    finally:
        await client.aclose()


def run_router(config: RouterConfig) -> None:
    # httpx logs every call at INFO: two lines per client request would drown the router's own.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    uvloop.run(_serve(config))
