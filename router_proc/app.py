"""The router's HTTP surface: the PD routes go through ``Dispatcher``; health, server info
and the model list are answered from the servers behind it."""

from __future__ import annotations

from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pipeline.body_limit import BodyLimit
from pipeline.http_edge import install_error_handlers
from router_proc.bodies import BadBody, parse_body
from router_proc.config import RouterConfig
from router_proc.dispatch import Dispatcher
from router_proc.http_common import OPEN_PATHS, BearerAuth, error_response, forwarded_headers
from router_proc.peers import PeerError, Peers

# Every route that generates: each is split into a prefill half and a decode half.
PD_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def build_app(config: RouterConfig, client: httpx.AsyncClient) -> FastAPI:
    peers = Peers(client, config.prefill_url, config.decode_url, api_key=config.api_key, probe_timeout=config.connect_timeout)
    dispatcher = Dispatcher(client, peers, request_timeout=config.request_timeout)
    app = FastAPI(title="tokenpipe router", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(BadBody)
    async def _bad_body(_: Request, exc: BadBody) -> JSONResponse:
        return error_response(400, str(exc))

    @app.exception_handler(PeerError)
    async def _peer_error(_: Request, exc: PeerError) -> JSONResponse:
        return error_response(exc.status, exc.message, err_type=exc.err_type)

    install_error_handlers(app)

    async def generate(request: Request) -> Response:
        return await dispatcher.forward(request, parse_body(await request.body()))

    for path in PD_PATHS:
        app.add_api_route(path, generate, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        problems = await peers.health()
        if problems:
            return error_response(503, "; ".join(problems), err_type="service_unavailable")
        return Response(status_code=200)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        # Fresh each time (live request counts); the pair kept for routing is not touched.
        prefill, decode = await peers.server_infos()
        return {"prefill": prefill, "decode": decode, "prefill_url": peers.prefill.url, "decode_url": peers.decode.url}

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        return await _from_decode(request, "/v1/models")

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(request: Request, model: str) -> Response:
        return await _from_decode(request, f"/v1/models/{model}")

    async def _from_decode(request: Request, path: str) -> Response:
        """The decode server is the one that answers the client, so it describes the model."""
        answer = await peers.get(peers.decode, path, forwarded_headers(request))
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    # Added last, so outermost: the key is checked before the size, as on the servers.
    if config.api_key is not None:
        app.add_middleware(BearerAuth, api_key=config.api_key, open_paths=OPEN_PATHS)
    return app
