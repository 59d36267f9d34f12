"""Endpoints vLLM and SGLang serve beside generation, which their users' tools call:
``GET /version``, ``GET /load``, ``GET /tokenizer_info`` and ``POST /invocations``. Each
route's comment says what it answers."""

from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Mapping
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pipeline.config import ServerConfig
from pipeline.tokenizer_loader import LoadedTokenizer, model_directory
from tokenizer_proc.http.hot_routes import Endpoint
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.tokenizer_manager import TokenizerManager

# The body key that picks each /invocations route, in vLLM's order of preference.
INVOCATION_ROUTES: tuple[tuple[str, str], ...] = (
    ("messages", "/v1/chat/completions"),
    ("prompt", "/v1/completions"),
    ("input", "/v1/embeddings"),
)


def package_version() -> str:
    """tokenpipe's version, as its installed metadata says (``pyproject.toml``'s)."""
    try:
        return importlib.metadata.version("tokenpipe")
    except importlib.metadata.PackageNotFoundError:  # run from a tree never installed
        return "unknown"


def build_peer_router(tm: TokenizerManager, endpoints: Mapping[str, Endpoint]) -> APIRouter:
    """``endpoints``: the POST endpoints of ``INVOCATION_ROUTES``' paths, by path."""
    router = APIRouter()
    version = package_version()
    missing = [path for _, path in INVOCATION_ROUTES if path not in endpoints]
    if missing:
        raise ValueError(f"/invocations needs the endpoints of {missing}")

    # ``{"version"}``, tokenpipe's package version (both peers' shape).
    @router.get("/version")
    async def show_version() -> dict[str, str]:
        return {"version": version}

    # vLLM's ``{"server_load": N}``, N the requests in flight in this API process (vLLM counts
    # them only under ``--enable-server-load-tracking``, and answers 0 otherwise; tokenpipe
    # always knows them: its live requests).
    @router.get("/load")
    async def server_load() -> dict[str, int]:
        return {"server_load": len(tm.states)}

    # vLLM's, only under ``--enable-tokenizer-info-endpoint`` (404 otherwise, as vLLM does not
    # register it then).
    if tm.config.enable_tokenizer_info_endpoint:
        info = tokenizer_info(tm.config, tm.tokenizer)

        @router.get("/tokenizer_info")
        async def get_tokenizer_info() -> dict[str, Any]:
            return info

    # SageMaker's route, routed by its body as vLLM routes it (vLLM tries chat completions,
    # then completions, then the pooling requests, and takes the first whose schema the body
    # fits): a body with ``messages`` is a chat completion, one with ``prompt`` a completion,
    # one with ``input`` an embedding request. The chosen route answers it, refusals
    # included; a body with none of the three gets 400.
    @router.post("/invocations")
    async def invocations(request: Request) -> Response:
        try:
            body = msgspec.json.decode(await request.body())
        except msgspec.DecodeError as exc:
            raise RequestValidationError(f"the body is not JSON: {exc}", None) from exc
        if isinstance(body, dict):
            for key, path in INVOCATION_ROUTES:
                if key in body:
                    # The chosen endpoint reads the same body again: Starlette keeps it.
                    return await endpoints[path](request)
        keys = ", ".join(f"`{key}` ({path})" for key, path in INVOCATION_ROUTES)
        raise RequestValidationError(
            f"Cannot find suitable handler for request. Expected a JSON object with one of {keys}",
            None,
        )

    return router


def tokenizer_info(config: ServerConfig, tokenizer: LoadedTokenizer | None) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info`` answer for the served model: the model directory's
    ``tokenizer_config.json`` with ``tokenizer_class`` (its own, else
    ``PreTrainedTokenizerFast``, what ``transformers`` loads a bare ``tokenizer.json`` as) and
    the ``chat_template`` chat requests render with."""
    path = model_directory(config.model_path) / "tokenizer_config.json"
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        loaded = {}
    info: dict[str, Any] = loaded if isinstance(loaded, dict) else {}
    if not isinstance(info.get("tokenizer_class"), str):
        info["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tokenizer is not None and tokenizer.chat_template is not None:
        info["chat_template"] = tokenizer.chat_template
    return info
