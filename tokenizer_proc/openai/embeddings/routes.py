"""Embedding endpoints: OpenAI's ``POST /v1/embeddings`` and the native ``POST /encode``.

Served only by a server started with ``--mode embedding``: the scheduler then mean-pools
and L2-normalises the final hidden states of each input, and the vectors come back as
one float32 matrix per step (``BatchEmbeddingOutput``)."""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.io_struct import EMBEDDING_DTYPE, FinishAbort
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.http.ignored_fields import ignored_fields
from tokenizer_proc.http.common import (
    ClientGone,
    abort_response,
    abort_unfinished,
    wait_finished,
    wait_started,
)
from tokenizer_proc.openai.embeddings.request import (
    MAX_INPUTS,
    EmbeddingRequest,
    EncodeRequest,
)
from tokenizer_proc.request_edge.meta_info import build_meta_info
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.tokenizer_manager import TokenizerManager


class EmbeddingFailed(Exception):
    def __init__(self, reason: FinishAbort, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # its status, and a full queue's retry_after

    def response(self, param: str) -> JSONResponse:
        return abort_response(self.reason, str(self), param=param)


def build_embeddings_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await answer_embeddings(tm, request)

    @router.post("/encode")
    async def encode(request: Request) -> Response:
        return await answer_encode(tm, request)

    return router


async def answer_embeddings(tm: TokenizerManager, request: Request) -> Response:
    """``POST /v1/embeddings``: OpenAI's answer, one vector per input."""
    arrived = time.time()
    obj: EmbeddingRequest = decode_body(
        await request.body(), EmbeddingRequest, ignored_fields(request)
    )
    _require_embedding_mode(tm)
    if obj.dimensions is not None:
        raise RequestValidationError(
            "`dimensions` is not supported: the model's size is fixed", "dimensions"
        )
    inputs = _token_inputs(tm, obj.input, "input", add_special_tokens=obj.add_special_tokens)
    try:
        states = await _embed_all(tm, inputs, request, arrived)
    except EmbeddingFailed as exc:
        return exc.response("input")
    if states is None:
        return Response(status_code=499)
    data = []
    for i, state in enumerate(states):
        vector = _vector(state)
        value: str | list[float] = (
            base64.b64encode(vector.astype(EMBEDDING_DTYPE).tobytes()).decode()
            if obj.encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": i, "embedding": value})
    prompt_tokens = sum(
        s.request_stats.prompt_tokens for s in states if s.request_stats is not None
    )
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": tm.model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
    )


async def answer_encode(tm: TokenizerManager, request: Request) -> Response:
    """``POST /encode``: SGLang's answer, a vector and ``meta_info`` per input."""
    arrived = time.time()
    obj: EncodeRequest = decode_body(await request.body(), EncodeRequest, ignored_fields(request))
    _require_embedding_mode(tm)
    if (obj.text is None) == (obj.input_ids is None):
        raise RequestValidationError("give exactly one of `text` and `input_ids`", "text")
    given: str | Sequence[str | int | list[int]] = (
        obj.text if obj.text is not None else obj.input_ids or []
    )
    single = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
    # As SGLang encodes a text input: with the tokenizer's special tokens.
    inputs = _token_inputs(
        tm, given, "text" if obj.text is not None else "input_ids", add_special_tokens=True
    )
    try:
        states = await _embed_all(tm, inputs, request, arrived, rid=obj.rid if single else None)
    except EmbeddingFailed as exc:
        param = "text" if obj.text is not None else "input_ids"
        return exc.response(param)
    if states is None:
        return Response(status_code=499)
    out = [{"embedding": _vector(s).tolist(), "meta_info": build_meta_info(s)} for s in states]
    return JSONResponse(out[0] if single else out)


def _require_embedding_mode(tm: TokenizerManager) -> None:
    if tm.config.mode != "embedding":
        raise RequestValidationError(
            f"this server runs --mode {tm.config.mode}; embeddings need a server started with "
            "--mode embedding",
            "model",
        )


def _vector(state: ReqState) -> np.ndarray:
    """A finished embedding request's vector (``_embed_all`` has answered for those without)."""
    assert state.embedding is not None
    return state.embedding


def _token_inputs(
    tm: TokenizerManager,
    given: str | Sequence[str | int | list[int]],
    field: str,
    *,
    add_special_tokens: bool,
) -> list[list[int]]:
    """One token list per input: a string, a list of strings, token ids, or lists of them;
    ``add_special_tokens`` for the strings (``RequestChecks.tokenize``)."""
    if isinstance(given, str):
        # Request JSON: the kinds of the entries are checked below, not known to the types.
        items: list[Any] = [given]
    elif given and all(isinstance(x, int) for x in given):
        items = [given]
    else:
        items = list(given)
        kinds = {type(x) for x in items}
        if len(kinds) > 1 or int in kinds:
            raise RequestValidationError(
                f"`{field}` must be a string, a list of strings, a list of token ids, or a list "
                "of such lists",
                field,
            )
    if not items:
        raise RequestValidationError(f"`{field}` is empty", field)
    if len(items) > MAX_INPUTS:
        raise RequestValidationError(
            f"`{field}` has {len(items)} inputs; at most {MAX_INPUTS} per request", field
        )
    out = []
    for i, item in enumerate(items):
        try:
            if isinstance(item, str):
                out.append(tm.checks.tokenize(item, None, add_special_tokens=add_special_tokens))
            else:
                out.append(tm.checks.tokenize(None, item, add_special_tokens=add_special_tokens))
        except RequestValidationError as exc:
            raise RequestValidationError(f"{field}[{i}]: {exc}", f"{field}[{i}]") from exc
    return out


async def _embed_all(
    tm: TokenizerManager,
    inputs: list[list[int]],
    request: Request,
    arrived: float,
    rid: str | None = None,
) -> list[ReqState] | None:
    """Submits every input at once (they batch in the scheduler) and waits for all; None
    when the client went away, with the rest aborted."""
    states = [tm.submit_embedding(input_ids=ids, rid=rid, created_time=arrived) for ids in inputs]
    try:
        # A refused input (a full waiting queue) answers for all at once, the rest aborted.
        if await wait_started(tm, states, request) is None:
            for state in states:
                await wait_finished(tm, state, request)
    except ClientGone:
        abort_unfinished(tm, states)
        return None
    for i, state in enumerate(states):
        reason = state.finished_reason
        if isinstance(reason, FinishAbort):
            # A refused or aborted input has no embedding: answer with its reason, never
            # with the placeholder vector the scheduler sends for it.
            raise EmbeddingFailed(reason, f"input {i}: {reason.message}")
    return states
