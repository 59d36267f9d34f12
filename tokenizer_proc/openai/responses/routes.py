"""OpenAI's Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}`` and
``DELETE /v1/responses/{id}`` (docs/api.md, "The Responses API").

A request runs as the chat request it reads into (``ResponsesRequest.to_chat``): the same
template, tools, constraints and parsers, one pipeline request, the same metrics and span
(operation ``chat``; the span's ``http.route`` says ``/v1/responses``). Its answer is read by
the chat splitter into output items (``OutputItems``), whole or streamed as the Responses
events. A stored response (``store``, the default) keeps its conversation for
``previous_response_id`` (``ResponseStore``, shared by every API worker).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.io_struct import Constraint, FinishAbort, LoraRef
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateUnavailable
from tokenizer_proc.http.common import (
    ClientGone,
    abort_response,
    abort_unfinished,
    constraint_refusal,
    error_response,
    refusal,
    wait_finished,
    wait_started,
)
from tokenizer_proc.http.sse_events import json_bytes
from tokenizer_proc.http.sse_stream import SseResponse
from tokenizer_proc.http.ignored_fields import ignored_fields
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.openai.chat_answers import finish_parsed
from tokenizer_proc.openai.chat_parsing import ChatParsing, ChatSplitter
from tokenizer_proc.openai.jobs import ChatJobs, prepare_chat, submit_jobs
from tokenizer_proc.openai.schema import ChatCompletionRequest
from tokenizer_proc.openai.shapes import finish_reason_of
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_checks import without_tokenizer
from tokenizer_proc.openai.responses.output import (
    OutputItems,
    new_item_id,
    response_object,
    response_usage,
)
from tokenizer_proc.openai.responses.input_items import conversation_messages, normalized_items
from tokenizer_proc.openai.responses.request import (
    ResponsesBody,
    ResponsesRequest,
    responses_names,
)
from tokenizer_proc.openai.responses.store import ResponseStore
from tokenizer_proc.tokenizer_manager import TokenizerManager

__all__ = ["build_responses_router"]

ROUTE = "/v1/responses"


def build_responses_router(tm: TokenizerManager) -> tuple[APIRouter, ResponseStore]:
    """The routes, and the store they keep (closed by the app at shutdown)."""
    router = APIRouter()
    template = ChatTemplate.for_tokenizer(tm.tokenizer) if tm.tokenizer is not None else None
    store = ResponseStore(tm.config.responses_store_max_count, tm.config.responses_store_bytes)

    @router.post(ROUTE)
    async def create_response(request: Request) -> Response:
        return await answer_create(tm, template, store, request)

    @router.get(ROUTE + "/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        stored = store.get(response_id)
        if stored is None:
            return error_response(
                404,
                f"no stored response with id {response_id!r}",
                err_type="not_found_error",
                param="response_id",
            )
        return JSONResponse(stored.response)

    @router.delete(ROUTE + "/{response_id}")
    async def delete_response(response_id: str) -> Response:
        if not store.delete(response_id):
            return error_response(
                404,
                f"no stored response with id {response_id!r}",
                err_type="not_found_error",
                param="response_id",
            )
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return router, store


async def answer_create(
    tm: TokenizerManager, template: ChatTemplate | None, store: ResponseStore, request: Request
) -> Response:
    """``POST /v1/responses``: the request read as chat, run, and answered or streamed."""
    arrived = time.time()
    body: ResponsesRequest = decode_body(
        await request.body(), ResponsesBody, ignored_fields(request)
    )
    body.refuse_unsupported()
    lora = tm.loras.resolve(body.model)  # an unknown model: the 404
    if template is None:
        raise without_tokenizer(
            "the Responses API needs a tokenizer and a chat template; send token ids to "
            "/v1/completions or /generate",
            "input",
        )
    earlier = _earlier_items(store, body)
    if isinstance(earlier, Response):
        return earlier
    items = earlier + normalized_items(body.input)
    chat = body.to_chat(conversation_messages(items, len(earlier)))
    try:
        prepared = prepare_chat(tm, template, chat)
    except RequestValidationError as exc:
        raise responses_names(exc) from exc
    except ChatTemplateUnavailable as exc:
        return error_response(500, str(exc), err_type="internal_error")
    return await _run(tm, request, body, chat, prepared, store, items, arrived, lora)


def _earlier_items(store: ResponseStore, body: ResponsesRequest) -> list[dict[str, Any]] | Response:
    """The stored conversation ``previous_response_id`` continues (none without one), or the
    404 for an id the store does not hold."""
    if body.previous_response_id is None:
        return []
    stored = store.get(body.previous_response_id)
    if stored is None:
        message = (
            f"no stored response with id {body.previous_response_id!r} (never stored, deleted, or "
            "evicted from the bounded store)"
        )
        return error_response(
            404, message, err_type="not_found_error", param="previous_response_id"
        )
    return stored.conversation


async def _run(
    tm: TokenizerManager,
    request: Request,
    body: ResponsesRequest,
    chat: ChatCompletionRequest,
    prepared: ChatJobs,
    store: ResponseStore,
    items: list[dict[str, Any]],
    arrived: float,
    lora: LoraRef | None,
) -> Response:
    """Submits the prepared chat and answers it, whole or as the Responses stream, with the
    adapter ``lora`` (None: the base model)."""
    response_id = new_item_id("resp")
    try:
        states = submit_jobs(
            tm,
            request,
            chat,
            prepared.jobs,
            response_id,
            arrived,
            "chat",
            prepared.names,
            prepared.constraint,
            ROUTE,
            lora,
        )
    except RequestValidationError as exc:
        raise responses_names(exc) from exc
    head = _head(tm.loras.served_name(lora), body, response_id, arrived)
    answer = Answer(tm, body, states[0], prepared.parsing, head, store, items)
    try:
        refused_state = await wait_started(tm, states, request)
        if refused_state is None and body.streaming:
            on_stream = tm.metrics.requests.on_sse_stream
            return SseResponse(ResponseEvents(answer), tm.sockets.call_after_frame, on_stream)
        if refused_state is None:
            await wait_finished(tm, states[0], request)
    except ClientGone:
        abort_unfinished(tm, states)
        return Response(status_code=499)
    refused = _refused(states[0], prepared.constraint)
    if refused is not None:
        return refused
    answer.feed(states[0].text, states[0].output_ids)
    return JSONResponse(answer.finish())


def _refused(state: ReqState, constraint: Constraint | None) -> Response | None:
    """A refusal's error answer; the scheduler's refusal of a ``text.format`` schema names it
    so, not as chat's ``response_format``."""
    refused = constraint_refusal(state, constraint)
    reason = state.finished_reason
    if (
        refused is None
        or constraint is None
        or not isinstance(reason, FinishAbort)
        or not reason.message.startswith(f"{constraint.param}: ")
    ):
        return refused
    renamed = responses_names(RequestValidationError(reason.message, constraint.param))
    return abort_response(reason, message=str(renamed), param=renamed.param)


def _head(model: str, body: ResponsesRequest, response_id: str, arrived: float) -> dict[str, Any]:
    """What every form of the response says of the request (OpenAI's echo of its fields)."""
    text_format = (
        body.text.format
        if body.text is not None and body.text.format is not None
        else {"type": "text"}
    )
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(arrived),
        "model": model,
        "error": None,
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": body.reasoning.effort if body.reasoning is not None else None,
            "summary": None,
        },
        "store": body.stores,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": text_format},
        "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
        "tools": body.tools or [],
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": "disabled",
        "user": body.user,
        "background": False,
    }


class Answer:
    """One response's answer as it comes: its splitter and output items, then at the finish
    the response object, stored when the request asked."""

    def __init__(
        self,
        tm: TokenizerManager,
        body: ResponsesRequest,
        state: ReqState,
        parsing: ChatParsing | None,
        head: dict[str, Any],
        store: ResponseStore,
        items: list[dict[str, Any]],
    ) -> None:
        self.tm, self.body, self.state, self.parsing, self.head = tm, body, state, parsing, head
        self._store, self._items = store, items
        self.splitter = parsing.splitter() if parsing is not None else ChatSplitter(None, None)
        self.output = OutputItems()

    def feed(self, text: str, ids: list[int]) -> list[dict[str, Any]]:
        return self.output.add(self.splitter.feed(text, ids))

    def finish(self) -> dict[str, Any]:
        """The finished response (``response.completed``'s, or ``response.incomplete``'s)."""
        return self.finish_events()[1]

    def finish_events(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        state = self.state
        events = self.output.add(self.splitter.finish())
        reason = finish_reason_of(state)
        reasoning_tokens = 0
        if self.parsing is not None:
            reason, reasoning_tokens = finish_parsed(
                self.tm, self.parsing, self.splitter, state, reason
            )
        incomplete = "max_output_tokens" if reason == "length" else None
        # An abort (an operator's, or the queue's) ends the answer early: OpenAI's "cancelled".
        status = (
            "cancelled"
            if reason == "abort"
            else "incomplete"
            if incomplete is not None
            else "completed"
        )
        events += self.output.close("completed" if status == "completed" else "incomplete")
        stats = state.request_stats
        assert stats is not None, "a finished request that was not refused has its stats"
        usage = response_usage(stats, state.completion_tokens, reasoning_tokens)
        response = response_object(self.head, status, self.output.items, usage, incomplete)
        if self.body.stores:
            self._store.put(
                response["id"],
                response,
                self._items + [_as_input(item) for item in self.output.items],
            )
        return events, response


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the conversation's next request reads it (``normalized_items``'
    form)."""
    if item["type"] == "message":
        return {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": p["text"]} for p in item["content"]],
        }
    if item["type"] == "function_call":
        return {
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
        }
    return {"type": "reasoning", "content": item.get("content") or []}


class ResponseEvents:
    """A streamed response's events (an ``EventSource``): ``response.created`` and
    ``response.in_progress``, each row's item events, and at the finish the items' done
    events and ``response.completed`` (or ``response.incomplete``), each numbered
    (``sequence_number``) and named on its ``event:`` line as OpenAI sends them."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.states = [answer.state]
        self.ended = False
        self._sequence = 0

    def _encode(self, events: list[dict[str, Any]]) -> bytes:
        out = []
        for event in events:
            event["sequence_number"] = self._sequence
            self._sequence += 1
            out.append(
                b"event: " + event["type"].encode() + b"\ndata: " + json_bytes(event) + b"\n\n"
            )
        return b"".join(out)

    def opening(self) -> bytes:
        started = response_object(self.answer.head, "in_progress", [], None)
        return self._encode(
            [
                {"type": "response.created", "response": started},
                {"type": "response.in_progress", "response": dict(started)},
            ]
        )

    def events(self, index: int) -> bytes:
        state = self.answer.state
        refused = refusal(state) if state.finished else None
        if refused is not None:
            self.ended = True
            return b"data: " + bytes(refused.body) + b"\n\n"
        events: list[dict[str, Any]] = []
        for chunk in state.take_pending():
            events += self.answer.feed(chunk.text, chunk.ids)
        if state.finished:
            done, response = self.answer.finish_events()
            # (No stream event is named for "cancelled": it ends as an incomplete one does.)
            kind = (
                "response.completed" if response["status"] == "completed" else "response.incomplete"
            )
            events += [*done, {"type": kind, "response": response}]
        return self._encode(events)

    def closing(self) -> bytes:
        return b""

    def close(self) -> None:
        abort_unfinished(self.answer.tm, self.states)
