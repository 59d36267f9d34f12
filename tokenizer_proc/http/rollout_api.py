"""The routes an RL loop drives a rollout server by, in SGLang's and vLLM's spellings (the
scheduler does the work: scheduler_proc/rollout.py):

- SGLang: ``POST /pause_generation {"mode": "abort" | "retract" | "in_place"}``,
  ``POST /continue_generation``, ``POST /update_weights_from_disk``,
  ``GET /get_weight_version``;
- vLLM: ``POST /pause?mode=abort|wait|keep`` (``keep`` is ``in_place``; ``clear_cache``
  flushes the prefix cache once paused, but for ``keep``), ``POST /resume``,
  ``GET /is_paused``.

Every API worker answers the same state: it comes with the scheduler's reports, and the
scheduler sends one before it answers a control."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.control_frames import PauseMode, RolloutState
from tokenizer_proc.http.common import error_response
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.tokenizer_manager import TokenizerManager

# How long a control that needs no draining waits for the scheduler's answer (it comes
# between two steps).
CONTROL_TIMEOUT = 30.0

_VLLM_MODES: dict[str, PauseMode] = {"abort": "abort", "wait": "wait", "keep": "in_place"}


# SGLang's control bodies carry its ``BaseReq`` fields: ``rid`` names the control message
# itself, not a request it acts on, so it is accepted and has no effect here.
ControlRid = str | list[str] | None


class PauseGenerationBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    mode: Literal["abort", "retract", "in_place"] = "abort"
    rid: ControlRid = None


class ContinueGenerationBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    torch_empty_cache: bool = True  # frees CUDA's cached blocks in SGLang: nothing here
    rid: ControlRid = None


class UpdateWeightsFromDiskBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's ``UpdateWeightFromDiskReqInput``. The fields after ``flush_cache`` steer
    GPU-side work tokenpipe does not have (CUDA graphs, an asynchronous load, releasing
    the CUDA cache) or tag the update for the caller's own books: accepted, and without
    effect here. A pause is never ended by an update (``keep_pause`` is what happens)."""

    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    rid: ControlRid = None


def build_rollout_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.post("/pause_generation")
    async def pause_generation(request: Request) -> Response:
        body = await _body(request, PauseGenerationBody)
        state = await tm.controls.pause(body.mode, CONTROL_TIMEOUT)
        if state is None or not state.ok:
            return _no_answer(state)
        return JSONResponse(
            {
                "message": "Generation paused successfully.",
                "status": "ok",
                "num_paused_requests": state.num_paused_requests,
            }
        )

    @router.post("/continue_generation")
    async def continue_generation(request: Request) -> Response:
        await _body(request, ContinueGenerationBody)
        state = await tm.controls.resume(CONTROL_TIMEOUT)
        if state is None or not state.ok:
            return _no_answer(state)
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @router.post("/pause")
    async def pause(
        mode: str = "abort", wait_for_inflight_requests: bool = False, clear_cache: bool = True
    ) -> Response:
        chosen = _VLLM_MODES.get("wait" if wait_for_inflight_requests else mode)
        if chosen is None:
            return error_response(
                400, f"Invalid pause mode: {mode!r}. Must be one of {list(_VLLM_MODES)}."
            )
        # A wait lasts as long as the running requests do.
        timeout = None if chosen == "wait" else CONTROL_TIMEOUT
        state = await tm.controls.pause(chosen, timeout)
        if state is None or not state.ok:
            return _no_answer(state)
        if clear_cache and chosen != "in_place":  # paused: nothing holds KV any more
            await tm.controls.flush_cache(CONTROL_TIMEOUT)
        return JSONResponse({"status": "paused"})

    @router.post("/resume")
    async def resume() -> Response:
        state = await tm.controls.resume(CONTROL_TIMEOUT)
        if state is None or not state.ok:
            return _no_answer(state)
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> dict[str, bool]:
        return {"is_paused": tm.paused is not None}

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": tm.weight_version}

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:
        body = await _body(request, UpdateWeightsFromDiskBody)
        state = await tm.controls.update_weights(
            body.model_path,
            weight_version=body.weight_version,
            abort_all_requests=body.abort_all_requests,
            flush_cache=body.flush_cache,
        )
        if state is None:
            return _no_answer(state)
        content = {
            "success": state.ok,
            "message": state.message,
            "num_paused_requests": state.num_paused_requests,
        }
        return JSONResponse(content, status_code=200 if state.ok else 400)

    return router


async def _body(request: Request, body_type: type[msgspec.Struct]) -> Any:
    """The request's body as ``body_type``; none at all means its defaults."""
    raw = await request.body()
    if not raw.strip():
        raw = b"{}"
    return decode_body(raw, body_type)


def _no_answer(state: RolloutState | None) -> Response:
    if state is None:
        return error_response(
            503, "the scheduler did not answer in time", err_type="service_unavailable"
        )
    return error_response(400, state.message)
