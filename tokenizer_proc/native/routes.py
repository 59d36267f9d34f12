"""The native dialect's route, ``POST /generate`` (SGLang's): one request, or a batch of them
(``tokenizer_proc.native.batch``), answered with ``{"text", "output_ids", "meta_info"}`` or
streamed as ``tokenizer_proc.native.events`` writes it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.token_texts import TokenText
from tokenizer_proc.http.ignored_fields import ignored_fields
from tokenizer_proc.http.common import (
    ClientGone,
    abort_unfinished,
    constraint_refusal,
    trace_context,
    wait_finished,
    wait_started,
)
from tokenizer_proc.http.request_id_header import answered_id, caller_request_id
from tokenizer_proc.http.sse_stream import SseResponse
from tokenizer_proc.media import expand_prompt, parse_media
from tokenizer_proc.native.batch import batch_body, batch_items, submit_batch
from tokenizer_proc.native.events import BatchEvents, GenerateEvents, generate_body
from tokenizer_proc.native.logprob_meta import logprob_meta, prompt_logprob_meta
from tokenizer_proc.native.schema import GenerateBody, GenerateRequest
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.meta_info import build_meta_info
from tokenizer_proc.tokenizer_manager import TokenizerManager

OnStream = Callable[[bool], None]


def build_native_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    # Counts each stream's write path (tokenpipe:sse_streams_total), with metrics on.
    on_stream = tm.metrics.requests.on_sse_stream

    @router.post("/generate")
    async def generate(request: Request) -> Response:
        return await answer_generate(tm, request, on_stream)

    return router


async def answer_generate(tm: TokenizerManager, request: Request, on_stream: OnStream) -> Response:
    """``POST /generate``: one request's answer or stream; a batch's when the body is one."""
    arrived = time.time()
    raw = await request.body()
    ignored = ignored_fields(request)
    try:
        obj: GenerateRequest = decode_body(raw, GenerateBody, ignored)
    except RequestValidationError:
        batch = batch_body(raw)  # only when the body is no single request: none pays for it
        if batch is None:
            raise
        return await _generate_batch(tm, request, batch, arrived, on_stream, ignored)
    obj.refuse_unsupported()
    lora = tm.loras.resolve(obj.model, obj.lora_path)  # an unknown model: the 404
    sampling = obj.sampling_params.to_wire()
    constraint = obj.sampling_params.constraint()
    media = parse_media(obj.image_data, obj.audio_data, obj.video_data)
    # As SGLang encodes a text prompt: with the tokenizer's special tokens (a Llama BOS).
    prompt_ids = tm.checks.tokenize(obj.text, obj.input_ids, add_special_tokens=True)
    input_ids = expand_prompt(prompt_ids, media, tm.checks.media_token_ids(media))
    # SGLang's rid names the request; the caller's X-Request-Id only when the body has none.
    header_id = caller_request_id(request)
    state = tm.submit_generate(
        input_ids=input_ids,
        sampling=sampling,
        stream=obj.stream,
        rid=obj.rid if obj.rid is not None else header_id,
        media=tuple(media),
        trace=trace_context(request),
        created_time=arrived,
        route="/generate",
        bootstrap=obj.bootstrap(),
        logprobs=obj.logprob_params(),
        constraint=constraint,
        cache_salt=obj.cache_salt,
        priority=obj.priority or 0,
        lora=lora,
    )
    answered_id(request, state.rid)
    # None without a tokenizer: null texts.
    text_of = tm.token_texts if obj.return_text_in_logprobs else None
    try:
        if obj.stream:
            # A refusal (full queue, scheduler's check, PD failure) is the first change
            # when it comes: answer it with its status rather than a 200 stream.
            if await wait_started(tm, [state], request) is None:
                events = GenerateEvents(tm, state, text_of)
                return SseResponse(events, tm.sockets.call_after_frame, on_stream)
        else:
            await wait_finished(tm, state, request)
    except ClientGone:
        return Response(status_code=499)
    refused = constraint_refusal(state, constraint)
    if refused is not None:
        return refused
    return JSONResponse(_finished_body(tm, state, text_of))


def _finished_body(
    tm: TokenizerManager, state: ReqState, text_of: TokenText | None
) -> dict[str, Any]:
    """The answer of a finished, not refused, non-streamed request (or batch item)."""
    meta = build_meta_info(state)
    if state.logprob is not None:
        meta.update(logprob_meta(state.logprob, state.output_ids, state.logprobs, text_of))
        if state.logprob.logprob_start_len >= 0:
            meta.update(
                prompt_logprob_meta(state.logprob, state.prompt_ids, state.prompt_logprobs, text_of)
            )
    return generate_body(tm, state.text, state.output_ids, meta)


async def _generate_batch(
    tm: TokenizerManager,
    request: Request,
    body: dict[str, Any],
    arrived: float,
    on_stream: OnStream,
    ignored: list[str] | None,
) -> Response:
    """A /generate batch (``tokenizer_proc.native.batch``): every item checked, then all
    submitted; answered with a JSON list in order, or streamed as SGLang streams a batch:
    each event one item's, carrying its ``index``, and one ``[DONE]`` at the end. An item
    refused when it runs (a full queue, the scheduler's check) refuses the batch with its
    status; the others are aborted."""
    items = batch_items(tm, body, ignored)
    stream = items[0].obj.stream
    states = submit_batch(tm, request, items, stream, arrived)
    text_of = tm.token_texts if items[0].obj.return_text_in_logprobs else None
    try:
        if stream:
            if await wait_started(tm, states, request) is None:
                sources = [
                    GenerateEvents(tm, state, text_of, index) for index, state in enumerate(states)
                ]
                return SseResponse(BatchEvents(sources), tm.sockets.call_after_frame, on_stream)
        else:
            for state in states:
                await wait_finished(tm, state, request)
    except ClientGone:
        abort_unfinished(tm, states)
        return Response(status_code=499)
    for item, state in zip(items, states):
        refused = constraint_refusal(state, item.constraint)
        if refused is not None:
            abort_unfinished(tm, states)
            return refused
    return JSONResponse([_finished_body(tm, state, text_of) for state in states])
