"""The HTTP surface: routes, error shape and authentication. Request handling beyond
parsing lives in ``TokenizerManager``; this module only adapts it to HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeGuard

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp

from pipeline.http.body_limit import BodyLimit
from pipeline.http.edge import BearerAuth, install_error_handlers
from pipeline.io_struct import FinishAbort, RequestOutputStats, SamplingParams
from pipeline.token_texts import TokenText
from tokenizer_proc.native.schema import (
    AbortRequestBody,
    GenerateBody,
    GenerateRequest,
    RequestValidationError,
    decode_body,
)
from tokenizer_proc.openai.embeddings import build_embeddings_router
from tokenizer_proc.http.hot_routes import HotRoutes, post_endpoints
from tokenizer_proc.http.hicache_api import build_hicache_router
from tokenizer_proc.http.peer_api import build_peer_router
from tokenizer_proc.http.common import (
    ClientGone,
    abort_unfinished,
    error_response,
    model_not_found,
    not_ready,
    constraint_refusal,
    refusal,
    trace_context,
    wait_finished,
    wait_started,
)
from tokenizer_proc.native.batch import batch_body, batch_items, submit_batch
from tokenizer_proc.native.logprob_meta import logprob_meta, prompt_logprob_meta
from tokenizer_proc.media import expand_prompt, parse_media
from tokenizer_proc.native.meta_info import build_meta_info
from tokenizer_proc.metrics import CONTENT_TYPE
from tokenizer_proc.openai.routes import build_openai_router
from tokenizer_proc.openai.responses.routes import build_responses_router
from tokenizer_proc.req_state import LogprobEntries, ReqState, StreamChunk
from tokenizer_proc.http.sse_events import EventTemplate, Hole, TemplateError, sse
from tokenizer_proc.http.sse_stream import SseResponse
from tokenizer_proc.http.tokenize_api import build_tokenize_router
from tokenizer_proc.tokenizer_manager import TokenizerManager
from tokenizer_proc.http.worker_api import build_worker_router

_OPEN_PATHS = frozenset({"/health", "/metrics"})


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
    api_key = tm.config.api_key

    @app.exception_handler(RequestValidationError)
    async def _bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param)

    install_error_handlers(app)
    # Counts each stream's write path (tokenpipe:sse_streams_total), with metrics on.
    on_stream = tm.metrics.requests.on_sse_stream

    @app.get("/health")
    async def health() -> Response:
        # 503 while starting (as SGLang's /health during start-up): a router or load balancer
        # sends nothing to a server whose scheduler has not come up, or never will.
        return Response(status_code=200) if tm.ready else not_ready()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=tm.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        arrived = time.time()
        raw = await request.body()
        try:
            obj: GenerateRequest = decode_body(raw, GenerateBody)
        except RequestValidationError:
            batch = batch_body(raw)  # only when the body is no single request: none pays for it
            if batch is None:
                raise
            return await _generate_batch(tm, request, batch, arrived, on_stream)
        obj.refuse_unsupported()
        if obj.model is not None and obj.model != tm.model_name:
            return model_not_found(obj.model)
        sampling = obj.sampling_params.to_wire()
        constraint = obj.sampling_params.constraint()
        media = parse_media(obj.image_data, obj.audio_data, obj.video_data)
        # As SGLang encodes a text prompt: with the tokenizer's special tokens (a Llama BOS).
        prompt_ids = tm.checks.tokenize(obj.text, obj.input_ids, add_special_tokens=True)
        input_ids = expand_prompt(prompt_ids, media, tm.checks.media_token_ids(media))
        state = tm.submit_generate(
            input_ids=input_ids,
            sampling=sampling,
            stream=obj.stream,
            rid=obj.rid,
            media=tuple(media),
            trace=trace_context(request),
            created_time=arrived,
            route="/generate",
            bootstrap=obj.bootstrap(),
            logprobs=obj.logprob_params(),
            constraint=constraint,
        )
        text_of = (
            tm.token_texts if obj.return_text_in_logprobs else None
        )  # None without a tokenizer: null texts
        try:
            if obj.stream:
                # A refusal (full queue, scheduler's check, PD failure) is the first change
                # when it comes: answer it with its status rather than a 200 stream.
                if await wait_started(tm, [state], request) is None:
                    return SseResponse(
                        _GenerateEvents(tm, state, text_of), tm.call_after_frame, on_stream
                    )
            else:
                await wait_finished(tm, state, request)
        except ClientGone:
            return Response(status_code=499)
        refused = constraint_refusal(state, constraint)
        if refused is not None:
            return refused
        return JSONResponse(_finished_body(tm, state, text_of))

    @app.get("/health_generate")
    async def health_generate() -> Response:
        sampling = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
        # Token id 0 without a tokenizer, as SGLang's health check always sends.
        ping = tm.tokenizer.encode("ping")[:1] if tm.tokenizer is not None else []
        state = tm.submit_generate(
            input_ids=ping or [0], sampling=sampling, stream=False, rid=None, internal=True
        )
        try:
            await asyncio.wait_for(
                _until_finished(state), timeout=tm.config.health_generate_timeout
            )
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

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
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

    openai_router = build_openai_router(tm)
    app.include_router(openai_router)
    embeddings_router = build_embeddings_router(tm)
    app.include_router(embeddings_router)
    app.include_router(build_hicache_router(tm))
    app.include_router(build_tokenize_router(tm))
    app.include_router(build_worker_router(tm))
    app.include_router(responses_router)
    invocation_endpoints = post_endpoints(
        openai_router, ("/v1/completions", "/v1/chat/completions")
    )
    app.include_router(
        build_peer_router(
            tm, {**invocation_endpoints, **post_endpoints(embeddings_router, ("/v1/embeddings",))}
        )
    )

    hot = {
        "/generate": generate,
        **post_endpoints(openai_router, ("/v1/completions", "/v1/chat/completions")),
        **post_endpoints(responses_router, ("/v1/responses",)),
    }
    def too_large() -> None:
        tm.metrics.requests.on_rejected("body_too_large")

    # In front of FastAPI's own stack, so the generation routes (HotRoutes) are under them too.
    edge: ASGIApp = BodyLimit(
        HotRoutes(app, hot), max_bytes=tm.config.max_request_bytes, on_reject=too_large
    )
    # Outermost: the key is checked first. Neither reads the body before its answer, but a
    # client without the key gets its 401 and learns nothing of the limit.
    if api_key is not None:
        edge = BearerAuth(edge, api_key=api_key, open_paths=_OPEN_PATHS)
    return edge


async def _until_finished(state: ReqState) -> None:
    while not state.finished:
        await state.event.wait()
        state.event.clear()


def _generate_body(
    tm: TokenizerManager,
    text: str | Hole,
    output_ids: list[int] | Hole,
    meta_info: dict[str, Any],
    index: int | None = None,
) -> dict[str, Any]:
    """A /generate answer or stream event (or its template: Holes for the text and ids).
    Under --skip-tokenizer-init there is no text, and as SGLang does then, the answer has no
    ``text`` key at all, only ``output_ids``. A batch item's stream events carry its
    ``index`` in the batch, as SGLang's do."""
    if tm.tokenizer is None:
        body: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta_info}
    else:
        body = {"text": text, "output_ids": output_ids, "meta_info": meta_info}
    if index is not None:
        body["index"] = index
    return body


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
    return _generate_body(tm, state.text, state.output_ids, meta)


async def _generate_batch(
    tm: TokenizerManager,
    request: Request,
    body: dict[str, Any],
    arrived: float,
    on_stream: Callable[[bool], None] | None,
) -> Response:
    """A /generate batch (``tokenizer_proc.native.batch``): every item checked, then all
    submitted; answered with a JSON list in order, or streamed as SGLang streams a batch:
    each event one item's, carrying its ``index``, and one ``[DONE]`` at the end. An item
    refused when it runs (a full queue, the scheduler's check) refuses the batch with its
    status; the others are aborted."""
    items = batch_items(tm, body)
    stream = items[0].obj.stream
    states = submit_batch(tm, request, items, stream, arrived)
    text_of = tm.token_texts if items[0].obj.return_text_in_logprobs else None
    try:
        if stream:
            if await wait_started(tm, states, request) is None:
                sources = [
                    _GenerateEvents(tm, state, text_of, index) for index, state in enumerate(states)
                ]
                return SseResponse(_BatchEvents(sources), tm.call_after_frame, on_stream)
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


class _BatchEvents:
    """A /generate batch's stream (an ``EventSource``): each item's events are its own
    ``_GenerateEvents``' (with its ``index``), and the stream ends with one ``[DONE]``."""

    def __init__(self, items: list[_GenerateEvents]) -> None:
        self._items = items
        self.states = tuple(item.states[0] for item in items)

    @property
    def ended(self) -> bool:
        return any(item.ended for item in self._items)

    def opening(self) -> bytes:
        return b""

    def events(self, index: int) -> bytes:
        return self._items[index].events(0)

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def close(self) -> None:
        for item in self._items:
            item.close()


class _GenerateEvents:
    """A /generate stream's events (an ``EventSource``). As SGLang streams them, each event
    carries the whole ``text`` and ``output_ids`` so far, and the output logprob entries of
    those ids; with ``--incremental-streaming-output`` (SGLang's flag) each carries only what
    is new since the previous event. Either way ``meta_info``'s counts are through the event
    and the finish goes on the last. An event before the last is the stream's template for
    its stats, filled with the chunk's text, ids and count: its meta_info depends on nothing
    else.

    The two modes differ only in where the chunks come from (``_take``): the state's own
    pending chunks, each a delta, or those chunks made cumulative by ``_take_cumulative``.
    The incremental path thus does exactly the work it did before the cumulative one
    existed; the cumulative one copies and encodes everything so far per event, bytes
    quadratic in the output's length, as SGLang's default does."""

    def __init__(
        self,
        tm: TokenizerManager,
        state: ReqState,
        text_of: TokenText | None,
        index: int | None = None,
    ) -> None:
        self.states = (state,)
        self._index = index  # a batch item's, on each of its events
        self.ended = False
        self._tm = tm
        self._state = state
        self._text_of = text_of
        incremental = tm.config.incremental_streaming_output
        self._take: Callable[[], list[StreamChunk]] = (
            state.take_pending if incremental else self._take_cumulative
        )
        # The prompt's logprobs go on the first event; on every event when each is the whole
        # answer so far (SGLang lists them on every event).
        self._prompt_logprobs_due = True
        self._every_event_lists_the_prompt = not incremental
        self._stats: RequestOutputStats | None = None  # the stats self._template was built from
        self._template: EventTemplate | None = None
        # The cumulative mode's output so far.
        self._text = ""
        self._ids: list[int] = []
        self._logprobs = LogprobEntries()

    def opening(self) -> bytes:
        return b""

    def events(self, index: int) -> bytes:
        state = self._state
        refused = refusal(state) if state.finished else None
        if refused is not None:
            self.ended = True
            return b"data: " + bytes(refused.body) + b"\n\n"
        chunks, finished = self._take(), state.finished
        if not finished and state.logprob is None:
            fills = [self._interim(chunk) for chunk in chunks]
            if _all_filled(fills):
                return b"".join(fills)
        out = []
        for i, chunk in enumerate(chunks):
            final = finished and i == len(chunks) - 1  # the finish goes on the last event only
            event = self._interim(chunk) if not final and state.logprob is None else None
            if event is not None:
                out.append(event)
                continue
            meta = build_meta_info(state, None if final else chunk)
            if state.logprob is not None:
                meta.update(logprob_meta(state.logprob, chunk.ids, chunk.logprobs, self._text_of))
                if state.logprob.logprob_start_len >= 0 and self._prompt_logprobs_due:
                    meta.update(
                        prompt_logprob_meta(
                            state.logprob, state.prompt_ids, state.prompt_logprobs, self._text_of
                        )
                    )
            self._prompt_logprobs_due = self._every_event_lists_the_prompt
            out.append(sse(_generate_body(self._tm, chunk.text, chunk.ids, meta, self._index)))
        return b"".join(out)

    def _take_cumulative(self) -> list[StreamChunk]:
        """The state's pending chunks, each holding the text, ids and output logprob entries
        of the whole output through it (SGLang's default stream). Each chunk gets copies:
        several taken at once are each encoded with what was there at its own row."""
        chunks = self._state.take_pending()
        for chunk in chunks:
            self._text += chunk.text
            self._ids += chunk.ids
            chunk.text, chunk.ids = self._text, self._ids[:]
            if chunk.logprobs is not None:
                self._logprobs.extend(chunk.logprobs)
            if self._state.logprob is not None:
                so_far = self._logprobs
                chunk.logprobs = LogprobEntries(so_far.chosen[:], so_far.top[:], so_far.ids[:])
        return chunks

    def _interim(self, chunk: StreamChunk) -> bytes | None:
        """The event of a chunk before the last, filled into its template (None: no template)."""
        template = self._interim_template(chunk)
        if template is None:
            return None
        if self._tm.tokenizer is None:
            return template.fill(chunk.ids, chunk.completion_tokens)
        return template.fill(chunk.text, chunk.ids, chunk.completion_tokens)

    def _interim_template(self, chunk: StreamChunk) -> EventTemplate | None:
        """The template of an event before the last, for this chunk's stats (None: a rid
        that holds a hole's marker; such events are encoded whole)."""
        if chunk.stats is not self._stats or self._template is None:
            self._stats = chunk.stats
            meta = build_meta_info(self._state, chunk)
            meta["completion_tokens"] = _COUNT
            try:
                self._template = EventTemplate(
                    _generate_body(self._tm, _TEXT, _IDS, meta, self._index)
                )
            except TemplateError:
                self._template = None
        return self._template

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def close(self) -> None:
        # A disconnect (or any other exit before the finish): stop the work.
        if not self._state.finished:
            self._tm.abort(self._state.req_id)


_TEXT, _IDS, _COUNT = Hole(), Hole(), Hole()


def _all_filled(fills: list[bytes | None]) -> TypeGuard[list[bytes]]:
    return None not in fills
