"""HiCache storage at runtime: ``POST /hicache/storage/attach`` and
``POST /hicache/storage/detach``.

The scheduler owns the storage tier, so each call is a ``HiCacheStorageControl`` to the
scheduler, answered by a ``HiCacheStorageState`` (through the detokenizer, like the
scheduler's stats reports). The scheduler checks the backend and the directory, since it
is the process that reads and writes the files (it may run on another host). Both calls
answer the storage attached afterwards: ``{"attached", "backend", "dir"}``. Running
requests keep running; the next row of each carries the new ``cached_tokens_details``
keys.
"""

from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.control_frames import HiCacheStorageState
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.http.common import error_response
from tokenizer_proc.tokenizer_manager import TokenizerManager


class StorageAttachBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    backend: str
    dir: str


class StorageDetachBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


def build_hicache_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.post("/hicache/storage/attach")
    async def attach(request: Request) -> Response:
        obj: StorageAttachBody = decode_body(await request.body(), StorageAttachBody)
        return _answer(
            await tm.controls.hicache_storage(attach=True, backend=obj.backend, dir=obj.dir)
        )

    @router.post("/hicache/storage/detach")
    async def detach(request: Request) -> Response:
        body = await request.body()
        if body.strip():  # an empty body and {} both mean "detach"
            decode_body(body, StorageDetachBody)
        return _answer(await tm.controls.hicache_storage(attach=False))

    return router


def _answer(state: HiCacheStorageState | None) -> Response:
    if state is None:
        return error_response(
            503, "the scheduler did not answer in time", err_type="service_unavailable"
        )
    if not state.ok:
        return error_response(400, state.error, param=state.param)
    return JSONResponse(
        {"attached": state.backend is not None, "backend": state.backend, "dir": state.dir}
    )
