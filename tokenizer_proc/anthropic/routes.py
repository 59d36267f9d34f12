"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``
(docs/api.md, "The Anthropic Messages API").

A request runs as the chat request it reads into (``MessagesRequest.chat``): the same
template, tools, constraints and parsers, one pipeline request, the same metrics and span
(operation ``chat``; the span's ``http.route`` says ``/v1/messages``). Its answer is read by
the chat splitter into content blocks (``ContentBlocks``), whole or streamed as Anthropic's
events. Errors leave in Anthropic's shape (``tokenizer_proc.anthropic.errors``).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.io_struct import FinishAbort, LoraRef
from tokenizer_proc.anthropic.content import ContentBlocks, message_usage, stop_reason_of
from tokenizer_proc.anthropic.errors import anthropic_error_body
from tokenizer_proc.anthropic.request import MessagesRequest, TokenCountRequest, anthropic_names
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
from tokenizer_proc.openai.chat_answers import finish_parsed
from tokenizer_proc.openai.chat_parsing import ChatParsing, ChatSplitter
from tokenizer_proc.openai.jobs import ChatJobs, prepare_chat, submit_jobs
from tokenizer_proc.openai.schema import ChatCompletionRequest
from tokenizer_proc.openai.shapes import finish_reason_of
from tokenizer_proc.parsers.reasoning import DEFAULT_THINK
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_checks import without_tokenizer
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.tokenizer_manager import TokenizerManager

__all__ = ["ROUTE", "build_messages_router"]

ROUTE = "/v1/messages"


def build_messages_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    template = ChatTemplate.for_tokenizer(tm.tokenizer) if tm.tokenizer is not None else None

    @router.post(ROUTE)
    async def create_message(request: Request) -> Response:
        return await answer_create(tm, template, request)

    @router.post(ROUTE + "/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await answer_count(tm, template, request)

    return router


@contextmanager
def _anthropic_names() -> Iterator[None]:
    try:
        yield
    except RequestValidationError as exc:
        raise anthropic_names(exc) from exc


def _prepared(
    tm: TokenizerManager,
    template: ChatTemplate | None,
    body: MessagesRequest | TokenCountRequest,
    ignored: list[str] | None,
) -> tuple[ChatCompletionRequest, ChatJobs, LoraRef | None] | Response:
    """The request read as chat, made ready to submit, and the adapter its ``model`` names
    (None: the base model); or the error answer."""
    body.refuse_unsupported(ignored)
    lora = tm.loras.resolve(body.model)  # an unknown model: the 404
    if template is None:
        raise without_tokenizer(
            "the Messages API needs a tokenizer and a chat template; send token ids to "
            "/v1/completions or /generate",
            "messages",
        )
    with _anthropic_names():
        chat = body.chat()
        try:
            return chat, prepare_chat(tm, template, chat, cap_max_tokens=True), lora
        except ChatTemplateUnavailable as exc:
            return error_response(500, str(exc), err_type="internal_error")


async def answer_count(
    tm: TokenizerManager, template: ChatTemplate | None, request: Request
) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt a request with these fields would run."""
    ignored = ignored_fields(request)
    body: TokenCountRequest = decode_body(await request.body(), TokenCountRequest, ignored)
    prepared = _prepared(tm, template, body, ignored)
    if isinstance(prepared, Response):
        return prepared
    return JSONResponse({"input_tokens": len(prepared[1].jobs[0].ids)})


async def answer_create(
    tm: TokenizerManager, template: ChatTemplate | None, request: Request
) -> Response:
    """``POST /v1/messages``: the request read as chat, run, and answered or streamed."""
    arrived = time.time()
    ignored = ignored_fields(request)
    body: MessagesRequest = decode_body(await request.body(), MessagesRequest, ignored)
    ready = _prepared(tm, template, body, ignored)
    if isinstance(ready, Response):
        return ready
    chat, prepared, lora = ready
    prepared = _as_asked(tm, body, prepared)
    message_id = f"msg_{secrets.token_hex(12)}"
    with _anthropic_names():
        [state] = submit_jobs(
            tm,
            request,
            chat,
            prepared.jobs,
            message_id,
            arrived,
            "chat",
            prepared.names,
            prepared.constraint,
            ROUTE,
            lora,
        )
    answer = Answer(tm, state, prepared.parsing, _head(tm.loras.served_name(lora), message_id))
    try:
        refused_state = await wait_started(tm, [state], request)
        if refused_state is None and body.streaming:
            on_stream = tm.metrics.requests.on_sse_stream
            return SseResponse(MessageEvents(answer), tm.sockets.call_after_frame, on_stream)
        if refused_state is None:
            await wait_finished(tm, state, request)
    except ClientGone:
        abort_unfinished(tm, [state])
        return Response(status_code=499)
    refused = constraint_refusal(state, prepared.constraint)
    if refused is not None:
        return refused
    reason = state.finished_reason
    if isinstance(reason, FinishAbort):
        return abort_response(_as_error(reason))
    answer.feed(state.text, state.output_ids)
    return JSONResponse(answer.finish()[1])


def _as_asked(tm: TokenizerManager, body: MessagesRequest, prepared: ChatJobs) -> ChatJobs:
    """What chat has no field for, on the jobs' sampling: a ``max_tokens`` of 0 computes the
    prompt, and so caches it, with nothing generated (Anthropic's way to warm its cache); a
    thinking budget forces the end of the reasoning once that many tokens are spent, when a
    reasoning parser reads the answer's thinking (it knows the end: ``</think>``)."""
    changes: dict[str, Any] = {}
    if body.max_tokens == 0:
        changes["max_new_tokens"] = 0
    budget = body.thinking_budget
    parsing = prepared.parsing
    if budget is not None and parsing is not None and parsing.thinks and tm.tokenizer is not None:
        changes["thinking_budget"] = budget
        changes["thinking_end"] = tuple(tm.tokenizer.encode(DEFAULT_THINK.end))
    if not changes:
        return prepared
    jobs = [
        replace(job, sampling=msgspec.structs.replace(job.sampling, **changes))
        for job in prepared.jobs
    ]
    return replace(prepared, jobs=jobs)


def _as_error(reason: FinishAbort) -> FinishAbort:
    """An abort after output (an operator's, a shutdown's) ends the answer as an error: a
    message has no stop reason for it. Its status, where it is not an error's, is a 500."""
    if reason.status_code >= 400:
        return reason
    return FinishAbort(reason.message, 500, reason.retry_after)


def _head(model: str, message_id: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model}


class Answer:
    """One message's answer as it comes: its splitter and content blocks, then at the finish
    its stop reason and usage."""

    def __init__(
        self,
        tm: TokenizerManager,
        state: ReqState,
        parsing: ChatParsing | None,
        head: dict[str, Any],
    ) -> None:
        self.tm, self.state, self.parsing, self.head = tm, state, parsing, head
        self.splitter = parsing.splitter() if parsing is not None else ChatSplitter(None, None)
        self.content = ContentBlocks()

    def feed(self, text: str, ids: list[int]) -> list[dict[str, Any]]:
        return self.content.add(self.splitter.feed(text, ids))

    def usage(self) -> dict[str, Any]:
        stats = self.state.request_stats
        assert stats is not None, "a request that started has its stats"
        return message_usage(stats, self.state.completion_tokens)

    def finish(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The last block events, and the whole message."""
        state = self.state
        events = self.content.add(self.splitter.finish())
        events += self.content.close()
        if self.parsing is not None:
            finish_parsed(self.tm, self.parsing, self.splitter, state, finish_reason_of(state))
        assert state.finished_reason is not None, "finish is called on a finished answer"
        stop_reason, stop_sequence = stop_reason_of(
            state.finished_reason, bool(self.splitter.calls)
        )
        message = {
            **self.head,
            "content": self.content.blocks,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(),
        }
        return events, message


class MessageEvents:
    """A streamed message's events (an ``EventSource``): ``message_start`` and a ``ping``,
    each row's ``content_block_*`` events, and at the finish ``message_delta`` (stop reason
    and usage) and ``message_stop``; an abort after output ends it with an ``error`` event,
    as Anthropic ends a stream that fails."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.states = [answer.state]
        self.ended = False

    def opening(self) -> bytes:
        # The start carries no content yet, so no output tokens: they come in message_delta.
        usage = {**self.answer.usage(), "output_tokens": 0}
        message = {
            **self.answer.head,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return _encode([{"type": "message_start", "message": message}, {"type": "ping"}])

    def events(self, index: int) -> bytes:
        state = self.answer.state
        refused = refusal(state) if state.finished else None
        if refused is not None:
            self.ended = True
            return _error_event(state.finished_reason)
        events: list[dict[str, Any]] = []
        for chunk in state.take_pending():
            events += self.answer.feed(chunk.text, chunk.ids)
        reason = state.finished_reason
        if isinstance(reason, FinishAbort):
            return _encode(events) + _error_event(reason)
        if reason is not None:
            done, message = self.answer.finish()
            delta = {
                "stop_reason": message["stop_reason"],
                "stop_sequence": message["stop_sequence"],
            }
            events += [
                *done,
                {"type": "message_delta", "delta": delta, "usage": message["usage"]},
                {"type": "message_stop"},
            ]
        return _encode(events)

    def closing(self) -> bytes:
        return b""

    def close(self) -> None:
        abort_unfinished(self.answer.tm, self.states)


def _encode(events: list[dict[str, Any]]) -> bytes:
    return b"".join(
        b"event: " + event["type"].encode() + b"\ndata: " + json_bytes(event) + b"\n\n"
        for event in events
    )


def _error_event(reason: object) -> bytes:
    assert isinstance(reason, FinishAbort)
    error = _as_error(reason)
    return _encode([anthropic_error_body(error.status_code, error.message)])
