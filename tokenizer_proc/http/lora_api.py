"""Adapters loaded and unloaded while the server runs, in both peers' spellings
(docs/design/lora.md):
- vLLM: ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"}`` and
  ``POST /v1/unload_lora_adapter {"lora_name"}``, answered 200 with vLLM's line of plain
  text, or vLLM's error message with its status. vLLM serves them only with
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set; here they are served whenever LoRA is on.
- SGLang: ``POST /load_lora_adapter`` and ``/unload_lora_adapter``, the same bodies,
  answered ``{"success", "error_message", "loaded_adapters"}``, 200 or 400.

With LoRA off each is a 400 naming --enable-lora. One call at a time per API worker, so its
checks hold until its control is answered; the answer comes after this worker has learnt
the change (``ServedAdapters``), so its next request sees it."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pipeline.control_frames import LoraAdapter, LoraControlResult
from tokenizer_proc.http.common import error_response
from tokenizer_proc.http.rollout_api import ControlRid
from tokenizer_proc.lora_names import ServedAdapters
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.tokenizer_manager import TokenizerManager

# Reading an adapter takes the scheduler a moment between two steps; a large one from a
# slow disk longer. An unload only takes the name away.
LOAD_TIMEOUT = 300.0
UNLOAD_TIMEOUT = 30.0
LORA_OFF = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."  # SGLang's words
NO_ANSWER = "the scheduler did not answer in time"


class VllmLoadBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's ``LoadLoRAAdapterRequest``. A name already served is refused whatever
    ``load_inplace`` says (unload it first); ``is_3d_lora_weight`` (MoE experts' weights) has
    no use here and is accepted false only."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False


class VllmUnloadBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's, which it does not read either


class SglangLoadBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang's ``LoadLoRAAdapterReqInput``. ``pinned`` (never evicted from the device) is
    not served: false only; ``lora_id`` is SGLang's own to assign: null only."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: None = None
    rid: ControlRid = None


class SglangUnloadBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    lora_name: str
    lora_id: None = None
    rid: ControlRid = None


def build_lora_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    loras = tm.loras
    one_at_a_time = asyncio.Lock()

    @router.post("/v1/load_lora_adapter")
    async def vllm_load(request: Request) -> Response:
        body = decode_body(await request.body(), VllmLoadBody)
        refused = vllm_load_refusal(loras, body)
        if refused is not None:
            return _vllm_error(*refused)
        async with one_at_a_time:
            if body.lora_name in _names(loras):
                return _vllm_error(400, _already_loaded(body.lora_name))
            result = await tm.controls.load_lora(body.lora_name, body.lora_path, LOAD_TIMEOUT)
        if result is None or not result.ok:
            return _vllm_failure(result)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def vllm_unload(request: Request) -> Response:
        body = decode_body(await request.body(), VllmUnloadBody)
        if not loras.enabled:
            return _vllm_error(400, LORA_OFF)
        if not body.lora_name:
            return _vllm_error(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with one_at_a_time:
            result = await tm.controls.unload_lora(body.lora_name, UNLOAD_TIMEOUT)
        if result is not None and result.status_code == 404:
            return _vllm_error(404, f"The lora adapter '{body.lora_name}' cannot be found.")
        if result is None or not result.ok:
            return _vllm_failure(result)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @router.post("/load_lora_adapter")
    async def sglang_load(request: Request) -> Response:
        body = decode_body(await request.body(), SglangLoadBody)
        if not loras.enabled:
            return _sglang_answer(False, LORA_OFF, None)
        if body.pinned:
            message = "pinned is not supported by this server (send false or leave it out)"
            return _sglang_answer(False, message, loras.adapters)
        if body.lora_name == loras.model_name:
            return _sglang_answer(False, _conflicts(body.lora_name), loras.adapters)
        async with one_at_a_time:
            if body.lora_name in _names(loras):
                message = (
                    f"Failed to load LoRA adapter {body.lora_name} because it is already loaded"
                )
                return _sglang_answer(False, message, loras.adapters)
            result = await tm.controls.load_lora(body.lora_name, body.lora_path, LOAD_TIMEOUT)
        return _sglang_result(result, loras)

    @router.post("/unload_lora_adapter")
    async def sglang_unload(request: Request) -> Response:
        body = decode_body(await request.body(), SglangUnloadBody)
        if not loras.enabled:
            return _sglang_answer(False, LORA_OFF, None)
        async with one_at_a_time:
            result = await tm.controls.unload_lora(body.lora_name, UNLOAD_TIMEOUT)
        if result is not None and result.status_code == 404:
            loaded = dict_keys(result.adapters)
            message = f"LoRA with name {body.lora_name} does not exist. Loaded LoRAs: {loaded}"
            return _sglang_answer(False, message, result.adapters)
        return _sglang_result(result, loras)

    return router


def vllm_load_refusal(loras: ServedAdapters, body: VllmLoadBody) -> tuple[int, str] | None:
    """(status, message) of a load vLLM refuses before it reaches the engine; None: none."""
    if not loras.enabled:
        return 400, LORA_OFF
    if not body.lora_name or not body.lora_path:
        return 400, "Both 'lora_name' and 'lora_path' must be provided."
    if body.lora_name == loras.model_name:
        return 400, _conflicts(body.lora_name)
    if body.is_3d_lora_weight:
        return 400, "is_3d_lora_weight is not supported by this server (send false or leave it out)"
    return None


def _names(loras: ServedAdapters) -> set[str]:
    return {adapter.name for adapter in loras.adapters}


def dict_keys(adapters: tuple[LoraAdapter, ...]) -> str:
    """The adapters' names as SGLang's messages show them (a Python ``dict_keys``)."""
    return f"dict_keys({[adapter.name for adapter in adapters]!r})"


def _conflicts(name: str) -> str:
    return f"The lora adapter '{name}' conflicts with a served base model."


def _already_loaded(name: str) -> str:
    # vLLM's first sentence; vLLM's advice (load_inplace) is not served here.
    return (
        f"The lora adapter '{name}' has already been loaded. Loading in place (load_inplace) "
        "is not supported by this server: unload it, then load it again."
    )


def _vllm_error(status: int, message: str) -> JSONResponse:
    err_type = "not_found_error" if status == 404 else "invalid_request_error"
    if status >= 500:
        err_type = "service_unavailable" if status == 503 else "internal_error"
    return error_response(status, message, err_type=err_type)


def _vllm_failure(result: LoraControlResult | None) -> JSONResponse:
    """The scheduler's refusal with its status (its reason, naming what cannot be served),
    or a 503 when it did not answer."""
    if result is None:
        return _vllm_error(503, NO_ANSWER)
    return _vllm_error(result.status_code, result.error)


def _sglang_result(result: LoraControlResult | None, loras: ServedAdapters) -> JSONResponse:
    """The scheduler's answer in SGLang's shape (a 503 when none came)."""
    if result is None:
        return _sglang_answer(False, NO_ANSWER, loras.adapters, status=503)
    return _sglang_answer(result.ok, result.error, result.adapters)


def _sglang_answer(
    ok: bool, message: str, adapters: tuple[LoraAdapter, ...] | None, status: int | None = None
) -> JSONResponse:
    """SGLang's ``LoRAUpdateOutput``: ``loaded_adapters`` maps every adapter served to its
    directory (null where LoRA is off, as SGLang answers before it asks its scheduler)."""
    loaded: dict[str, Any] | None = (
        {adapter.name: adapter.path for adapter in adapters} if adapters is not None else None
    )
    content = {"success": ok, "error_message": "" if ok else message, "loaded_adapters": loaded}
    return JSONResponse(content, status_code=status or (200 if ok else 400))
