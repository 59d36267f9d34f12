"""The API's ASGI app: each dialect's routers and the service's own endpoints, the error
shape, and the edge middleware (the HTTP counters, Anthropic's error shape on /v1/messages,
key check, body limit, the generation routes served in front of FastAPI's stack). Request
handling lives in the routers and ``TokenizerManager``; this module only wires them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp

from pipeline.http.body_limit import BodyLimit
from pipeline.http.edge import ApiKeyAuth, install_error_handlers
from tokenizer_proc.anthropic.errors import AnthropicErrors
from tokenizer_proc.anthropic.routes import build_messages_router
from tokenizer_proc.http.common import error_response, model_not_found
from tokenizer_proc.http.lora_api import build_lora_router
from tokenizer_proc.http.hicache_api import build_hicache_router
from tokenizer_proc.http.hot_routes import Endpoint, HotRoutes, post_endpoints
from tokenizer_proc.http.peer_api import build_peer_router
from tokenizer_proc.http.request_id_header import RequestIdHeader
from tokenizer_proc.http.service_api import build_service_router
from tokenizer_proc.http.worker_api import build_worker_router
from tokenizer_proc.http.rollout_api import build_rollout_router
from tokenizer_proc.lora_names import UnknownModel
from tokenizer_proc.native.routes import build_native_router
from tokenizer_proc.openai.embeddings.routes import build_embeddings_router
from tokenizer_proc.openai.responses.routes import build_responses_router
from tokenizer_proc.openai.routes import build_openai_router
from tokenizer_proc.openai.tokenize.routes import build_tokenize_router
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.tokenizer_manager import TokenizerManager

_OPEN_PATHS = frozenset({"/", "/health", "/metrics"})
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


def build_app(tm: TokenizerManager) -> ASGIApp:
    """The API's ASGI app: FastAPI's routes behind the key check and the body limit, with the
    generation routes served in front of FastAPI's stack (``HotRoutes``)."""
    responses_router, responses_store = build_responses_router(tm)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            responses_store.close()

    app = FastAPI(
        title="tokenpipe", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    @app.exception_handler(UnknownModel)
    async def _unknown_model(_: Request, exc: UnknownModel) -> JSONResponse:
        return model_not_found(exc.model)

    install_error_handlers(app)
    native_router = build_native_router(tm)
    openai_router = build_openai_router(tm)
    app.include_router(build_service_router(tm))
    app.include_router(native_router)
    embeddings_router = build_embeddings_router(tm)
    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(build_hicache_router(tm))
    tokenize_router = build_tokenize_router(tm)
    app.include_router(tokenize_router)
    app.include_router(build_worker_router(tm))
    app.include_router(build_rollout_router(tm))
    app.include_router(build_lora_router(tm))
    app.include_router(responses_router)
    messages_router = build_messages_router(tm)
    app.include_router(messages_router)
    invocations = {
        **post_endpoints(openai_router, _GENERATION_PATHS),
        **post_endpoints(embeddings_router, ("/v1/embeddings",)),
    }
    peer_router = build_peer_router(tm, invocations)
    app.include_router(peer_router)
    # HotRoutes serves the generation routes, and every other route whose body is one of the
    # API's requests, so that one place names the fields their bodies' decode ignored. The
    # service's control routes (/abort_request, /flush_cache, /hicache/...) are not among
    # them: there an unknown field stays a 400 (a misspelt "rid" ignored would abort all).
    hot = _hot_endpoints(
        (native_router, ("/generate",)),
        (openai_router, _GENERATION_PATHS),
        (responses_router, ("/v1/responses",)),
        (messages_router, ("/v1/messages", "/v1/messages/count_tokens")),
        (embeddings_router, ("/v1/embeddings", "/encode")),
        (tokenize_router, ("/tokenize", "/v1/tokenize", "/detokenize", "/v1/detokenize")),
        (peer_router, ("/invocations",)),
    )
    return _edge(tm, app, hot)


def _hot_endpoints(*routes: tuple[APIRouter, tuple[str, ...]]) -> dict[str, Endpoint]:
    """The endpoints ``HotRoutes`` serves, by path: each router's POST routes at its paths."""
    endpoints: dict[str, Endpoint] = {}
    for router, paths in routes:
        endpoints.update(post_endpoints(router, paths))
    return endpoints


def _edge(tm: TokenizerManager, app: FastAPI, hot: dict[str, Endpoint]) -> ASGIApp:
    """``app`` behind the middleware every request passes first."""

    def too_large() -> None:
        tm.metrics.requests.on_rejected("body_too_large")

    # In front of FastAPI's own stack, so the generation routes (HotRoutes) are under them too.
    edge: ASGIApp = BodyLimit(
        HotRoutes(app, hot, ignore_unknown_fields=not tm.config.reject_unknown_fields),
        max_bytes=tm.config.max_request_bytes,
        on_reject=too_large,
    )
    # Around it: the key is checked first. Neither reads the body before its answer, but a
    # client without the key gets its 401 and learns nothing of the limit.
    api_key = tm.config.api_key
    if api_key is not None:
        edge = ApiKeyAuth(edge, api_key=api_key, open_paths=_OPEN_PATHS)
    # Around it, so the 401 and the 413 on /v1/messages leave in Anthropic's shape too.
    edge = AnthropicErrors(edge)
    if tm.config.enable_request_id_headers:
        edge = RequestIdHeader(edge)
    # Outermost: every answer is counted with the status the client gets.
    return tm.metrics.count_http(edge, app)
