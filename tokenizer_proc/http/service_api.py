"""The service's own endpoints: ``GET /`` and ``HEAD /`` (a server answers here: Claude Code
checks with ``HEAD /`` before its first request), ``GET /health`` (the process is up and its
scheduler has reported), ``GET /health_generate`` (a 1-token request gets through the whole
pipeline), ``GET /metrics`` and ``POST /abort_request``."""

from __future__ import annotations

import asyncio

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.io_struct import FinishAbort, SamplingParams
from tokenizer_proc.http.common import error_response, not_ready
from tokenizer_proc.metrics import CONTENT_TYPE
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.tokenizer_manager import TokenizerManager


class AbortRequestBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    rid: str | None = None
    abort_all: bool = False


def build_service_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        # 200 even while starting: it says only that this is the server; /health says ready.
        # (uvicorn sends no body for HEAD.)
        return JSONResponse({"status": "ok"})

    @router.get("/health")
    async def health() -> Response:
        # 503 while starting (as SGLang's /health during start-up): a router or load balancer
        # sends nothing to a server whose scheduler has not come up, or never will.
        if not tm.ready:
            return not_ready()
        # Paused (an RL loop's pause between rollouts) is healthy: 200, and says so.
        return Response(status_code=200) if tm.paused is None else paused_answer(tm)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(content=tm.metrics.render(), media_type=CONTENT_TYPE)

    @router.get("/health_generate")
    async def health_generate() -> Response:
        return await check_generate(tm)

    @router.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        return await answer_abort_request(tm, request)

    return router


def paused_answer(tm: TokenizerManager) -> Response:
    return JSONResponse({"status": "paused", "mode": tm.paused})


async def check_generate(tm: TokenizerManager) -> Response:
    """``GET /health_generate``: 200 once a 1-token request came through, 503 otherwise;
    while generation is paused, 200 at once saying so (a request would wait the pause)."""
    if tm.ready and tm.paused is not None:
        return paused_answer(tm)
    sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    # Token id 0 without a tokenizer, as SGLang's health check always sends.
    ping = tm.tokenizer.encode("ping")[:1] if tm.tokenizer is not None else []
    state = tm.submit_generate(
        input_ids=ping or [0], sampling=sampling, stream=False, rid=None, internal=True
    )
    try:
        await asyncio.wait_for(_until_finished(state), timeout=tm.config.health_generate_timeout)
    except TimeoutError:
        tm.abort(state.req_id, "health check timed out")
        tm.forget(state)  # a stalled scheduler may never answer: keep no state for it
        return error_response(
            503,
            "a 1-token request did not get through the pipeline in time",
            err_type="service_unavailable",
        )
    # Healthy only when the request came through: one refused (a full queue) or lost (a
    # restart) finished too, as an abort.
    reason = state.finished_reason
    if isinstance(reason, FinishAbort):
        return error_response(
            503,
            f"a 1-token request did not get through the pipeline: {reason.message}",
            err_type="service_unavailable",
        )
    return JSONResponse({"status": "ok"})


async def answer_abort_request(tm: TokenizerManager, request: Request) -> Response:
    """``POST /abort_request``: aborts the request with ``rid``, or every request."""
    obj: AbortRequestBody = decode_body(await request.body(), AbortRequestBody)
    if obj.abort_all:
        tm.abort_all("aborted by /abort_request")
        return JSONResponse({"aborted": "all"})
    if obj.rid is None:
        raise RequestValidationError("give `rid` or `abort_all: true`", "rid")
    if not await tm.abort_rid(obj.rid, "aborted by /abort_request"):
        return error_response(
            404,
            f"no running request with rid {obj.rid!r}",
            err_type="not_found_error",
            param="rid",
        )
    return JSONResponse({"aborted": obj.rid})


async def _until_finished(state: ReqState) -> None:
    while not state.finished:
        await state.event.wait()
        state.event.clear()
