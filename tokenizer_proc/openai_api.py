"""The OpenAI-compatible text generation API: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{model}``.

Each choice is its own pipeline request (``n`` choices of ``p`` prompts are ``n * p``
requests, submitted together so they batch). With a ``seed``, choice ``i`` of each prompt
samples with ``seed + i``: the choices differ, and each prompt of a batch gives what it would
give alone.

``usage`` comes from the pipeline's own numbers: ``ReqState.request_stats`` (prompt and cached
tokens) and ``ReqState.completion_tokens``. As OpenAI does, a prompt is counted once however
many choices it has: ``prompt_tokens`` sums over prompts, ``completion_tokens`` over every
choice. A prompt's ``cached_tokens`` is the smallest count among its choices (the copy that
really computed the prompt; the other copies may have reused its prefix), capped at the
prompt (in ``--mode dllm`` a request's ``cached_tokens`` also counts its committed blocks),
so ``cached_tokens <= prompt_tokens`` always holds.

``finish_reason``: ``FinishStop`` (EOS, a stop token or a stop string) is ``"stop"``,
``FinishLength`` is ``"length"``, ``FinishAbort`` (``/abort_request``, shutdown) is ``"abort"``.
A choice's ``stop_reason`` (vLLM's; streamed, on the finishing chunk) is the stop string or
``stop_token_ids`` id that ended it, null for EOS and every other finish.

Waiting, disconnect handling and error bodies are ``http_common``'s: a client that
disconnects aborts every choice of its request. A stream starts (status 200) only once every
choice has changed once, so a choice the scheduler refuses (400, a full waiting queue's 503
with ``Retry-After``, a PD peer's 502/504) makes the whole request that error, streaming or
not, with the other choices aborted; a refusal after the stream started (a PD failure) is an
SSE ``error`` event.

Under ``--skip-tokenizer-init`` a completions prompt must be token ids, and each choice (and
each stream delta) also carries its ``token_ids``, the field SGLang and vLLM answer
``return_token_ids`` with; its ``text`` is empty, as vLLM's is without a tokenizer. Chat needs a
tokenizer and a chat template, so it is refused with a 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.io_struct import FinishAbort, FinishLength, FinishStop, RequestOutputStats, SamplingParams
from pipeline.token_texts import TokenText
from tokenizer_proc.api_schema import RequestValidationError, decode_body
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateUnavailable
from tokenizer_proc.http_common import (
    ClientGone,
    abort_unfinished,
    error_response,
    model_not_found,
    refusal,
    trace_context,
    wait_finished,
    wait_started,
)
from tokenizer_proc.openai_logprobs import chat_logprobs, completion_logprobs, echoed_completion_logprobs, openai_token_text
from tokenizer_proc.openai_schema import (
    MAX_CHOICES,
    ChatCompletionBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
    SamplingRequest,
)
from tokenizer_proc.req_state import LogprobEntries, ReqState, StreamChunk
from tokenizer_proc.sse_events import EventTemplate, Hole, TemplateError, sse
from tokenizer_proc.sse_stream import SseResponse
from tokenizer_proc.tokenizer_manager import TokenizerManager

_FINISH_REASONS = {FinishStop: "stop", FinishLength: "length", FinishAbort: "abort"}
_DONE = b"data: [DONE]\n\n"


def build_openai_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    template = ChatTemplate.for_tokenizer(tm.tokenizer) if tm.tokenizer is not None else None
    started = int(time.time())

    def model_card() -> dict[str, Any]:
        return {
            "id": tm.model_name,
            "object": "model",
            "created": started,
            "owned_by": "tokenpipe",
            "max_model_len": tm.context_length,  # vLLM's name
        }

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        if model != tm.model_name:
            return model_not_found(model)
        return JSONResponse(model_card())

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        arrived = time.time()
        body: CompletionRequest = decode_body(await request.body(), CompletionBody)
        body.refuse_unsupported()
        if body.model is not None and body.model != tm.model_name:
            return model_not_found(body.model)
        prompts = body.prompts()
        if len(prompts) * body.choices > MAX_CHOICES:
            raise RequestValidationError(f"prompts x n is {len(prompts) * body.choices}; at most {MAX_CHOICES}", "n")
        jobs: list[tuple[list[int], SamplingParams]] = []
        for prompt in prompts:
            with _openai_names("prompt", "max_tokens"):
                ids = tm.tokenize(prompt, None) if isinstance(prompt, str) else tm.tokenize(None, prompt)
                jobs.extend(_choices(tm, body, ids, _completion_max_tokens(tm, body, len(ids))))
        return await _respond(tm, request, _COMPLETION, body, jobs, arrived)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.time()
        body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionBody)
        body.refuse_unsupported()
        if body.model is not None and body.model != tm.model_name:
            return model_not_found(body.model)
        if template is None:
            raise tm.without_tokenizer("chat needs a tokenizer and a chat template; send token ids to /v1/completions or /generate", "messages")
        try:
            prompt = template.render(body.template_messages())
        except ChatTemplateError as exc:
            raise RequestValidationError(str(exc), "messages") from exc
        except ChatTemplateUnavailable as exc:
            return error_response(500, str(exc), err_type="internal_error")
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        with _openai_names("messages", max_param):
            ids = tm.tokenize(prompt, None)
            max_tokens = body.requested_max_tokens() or _room_left(tm, len(ids))
            jobs = _choices(tm, body, ids, max_tokens)
        return await _respond(tm, request, _CHAT, body, jobs, arrived)

    return router


def _room_left(tm: TokenizerManager, prompt_len: int) -> int:
    """Chat's default max_tokens, as in OpenAI: as many as fit after the prompt (the context,
    the KV pool and --max-new-tokens-limit); at least 1, so a prompt that leaves no room gets
    the length check's error."""
    config = tm.config
    pool_room = config.max_total_tokens - prompt_len
    if config.mode == "dllm":  # the KV pool holds whole blocks
        pool_room -= pool_room % config.dllm_block_size
    return max(1, min(config.max_new_tokens_limit, tm.context_length - prompt_len, pool_room))


def _completion_max_tokens(tm: TokenizerManager, body: CompletionRequest, prompt_len: int) -> int:
    """OpenAI's default of 16, but as vLLM and OpenAI do, a prompt with less room than that
    is cut at the context ("length") rather than refused."""
    if body.max_tokens is not None:
        return body.max_tokens
    return min(CompletionRequest.DEFAULT_MAX_TOKENS, _room_left(tm, prompt_len))


def _choices(tm: TokenizerManager, body: SamplingRequest, ids: list[int], max_tokens: int) -> list[tuple[list[int], SamplingParams]]:
    """One (prompt, sampling) job per choice, validated against the server's limits first so
    that nothing is submitted for a request that will be refused."""
    jobs = [(ids, sampling) for sampling in body.sampling(max_tokens)]
    tm.validate_sampling(len(ids), jobs[0][1])
    return jobs


@contextmanager
def _openai_names(prompt_param: str, max_param: str) -> Iterator[None]:
    """``tm.tokenize`` and ``tm.validate_sampling`` speak the native API's field names; an
    OpenAI client should read its own (``prompt``/``messages``, ``max_tokens``, ``stop``)."""
    try:
        yield
    except RequestValidationError as exc:
        message = str(exc)
        for native, ours in (
            ("sampling_params.max_new_tokens", max_param),
            ("max_new_tokens", max_param),
            ("`text`", f"`{prompt_param}`"),
            ("input_ids", prompt_param),
            ("sampling_params.stop", "stop"),
            ("sampling_params.logit_bias", "logit_bias"),
        ):
            message = message.replace(native, ours)
        param = {
            "sampling_params.max_new_tokens": max_param,
            "text": prompt_param,
            "input_ids": prompt_param,
            "sampling_params.stop": "stop",
            "sampling_params.logit_bias": "logit_bias",
        }.get(exc.param or "", exc.param)
        raise RequestValidationError(message, param) from exc


# --- response shapes -----------------------------------------------------------------------


class _Completion:
    id_prefix = "cmpl-"
    object = "text_completion"
    operation = "text_completion"  # gen_ai.operation.name
    chunk_object = "text_completion"

    @staticmethod
    def choice(index: int, state: ReqState, text_of: TokenText) -> dict[str, Any]:
        logprobs = None
        if state.logprob is not None and state.echo:
            logprobs = echoed_completion_logprobs(state.prompt_ids, state.prompt_logprobs, state.logprobs, state.output_ids, text_of)
        elif state.logprob is not None:
            logprobs = completion_logprobs(state.logprobs, state.output_ids, text_of)
        return {
            "index": index,
            "text": _Completion.echoed_text(state, text_of) + state.text,
            "logprobs": logprobs,
            "finish_reason": _finish_reason(state),
            "stop_reason": _stop_reason(state),
        }

    @staticmethod
    def opening(index: int) -> dict[str, Any] | None:
        return None

    @staticmethod
    def delta(
        index: int, text: str | Hole, finish_reason: str | None, stop_reason: int | str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason, "stop_reason": stop_reason}

    @staticmethod
    def echoed_text(state: ReqState, text_of: TokenText) -> str:
        """The prompt's text, for ``echo`` (nothing otherwise)."""
        return "".join(text_of(t) for t in state.prompt_ids) if state.echo else ""

    @staticmethod
    def chunk_logprobs(chunk: StreamChunk, text_of: TokenText, offset: int, state: ReqState | None = None) -> dict[str, Any]:
        """``state``: on a choice's first chunk, whose logprobs lead with the echoed prompt's."""
        entries = chunk.logprobs or LogprobEntries()
        if state is not None and state.echo:
            return echoed_completion_logprobs(state.prompt_ids, state.prompt_logprobs, entries, chunk.ids, text_of)
        return completion_logprobs(entries, chunk.ids, text_of, offset)


class _Chat:
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    operation = "chat"
    chunk_object = "chat.completion.chunk"

    @staticmethod
    def choice(index: int, state: ReqState, text_of: TokenText) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": state.text},
            "logprobs": chat_logprobs(state.logprobs, state.output_ids, text_of) if state.logprob is not None else None,
            "finish_reason": _finish_reason(state),
            "stop_reason": _stop_reason(state),
        }

    @staticmethod
    def opening(index: int) -> dict[str, Any] | None:
        """OpenAI's first chunk of each choice names the role."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None, "stop_reason": None}

    @staticmethod
    def delta(
        index: int, text: str | Hole, finish_reason: str | None, stop_reason: int | str | None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }


    @staticmethod
    def echoed_text(state: ReqState, text_of: TokenText) -> str:
        return ""

    @staticmethod
    def chunk_logprobs(chunk: StreamChunk, text_of: TokenText, offset: int, state: ReqState | None = None) -> dict[str, Any]:
        return chat_logprobs(chunk.logprobs or LogprobEntries(), chunk.ids, text_of)


_COMPLETION = _Completion()
_CHAT = _Chat()


def _finish_reason(state: ReqState) -> str | None:
    reason = state.finished_reason
    return None if reason is None else _FINISH_REASONS[type(reason)]


def _stop_reason(state: ReqState) -> int | str | None:
    """``FinishStop.matched`` is a token id both for EOS and for a stop token: only the
    request's own ``stop_token_ids`` make it a stop token (the stop checker tests them first)."""
    reason = state.finished_reason
    if not isinstance(reason, FinishStop):
        return None
    if isinstance(reason.matched, str) or reason.matched in state.sampling.stop_token_ids:
        return reason.matched
    return None


def _with_ids(choice: dict[str, Any], ids: list[int], ids_out: bool) -> dict[str, Any]:
    """A choice or delta, with its ``token_ids`` when the ids are the output (--skip-tokenizer-init)."""
    if ids_out:
        choice["token_ids"] = ids
    return choice


def _finished_stats(state: ReqState) -> RequestOutputStats:
    assert state.request_stats is not None, "a choice has its stats from its first output on"
    return state.request_stats


def _usage(states: list[ReqState], n: int) -> dict[str, Any]:
    """``states`` in choice order, ``n`` per prompt; see the module docstring."""
    prompt = cached = 0
    for start in range(0, len(states), n):
        stats = [_finished_stats(s) for s in states[start : start + n]]
        prompt += stats[0].prompt_tokens
        cached += min(stats[0].prompt_tokens, *(st.cached_tokens for st in stats))
    completion = sum(s.completion_tokens for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# --- running the choices -------------------------------------------------------------------


async def _respond(
    tm: TokenizerManager,
    request: Request,
    kind: _Completion | _Chat,
    body: SamplingRequest,
    jobs: list[tuple[list[int], SamplingParams]],
    arrived: float,
) -> Response:
    response_id = f"{kind.id_prefix}{uuid.uuid4().hex}"
    trace = trace_context(request)
    bootstrap = body.bootstrap()
    if bootstrap is not None and len(jobs) > 1:
        raise RequestValidationError("PD disaggregation takes one completion per request (one bootstrap room): n and the prompts must make 1", "n")
    states: list[ReqState] = []
    try:
        for index, (ids, sampling) in enumerate(jobs):
            states.append(
                tm.submit_generate(
                    input_ids=ids,
                    sampling=sampling,
                    stream=body.streaming,
                    rid=f"{response_id}-{index}",
                    trace=trace,
                    created_time=arrived,
                    operation=kind.operation,
                    bootstrap=bootstrap,
                    logprobs=body.logprob_params(),
                )
            )
            if isinstance(body, CompletionRequest) and body.echo:
                states[-1].echo, states[-1].prompt_ids = True, ids
    except BaseException:
        abort_unfinished(tm, states)
        raise
    head = {"id": response_id, "object": kind.object, "created": int(arrived), "model": tm.model_name}
    try:
        # Until every choice has started, so one refused choice answers for the request
        # (with the others aborted) before a stream's 200 or a long wait for the others.
        refused_state = await wait_started(tm, states, request)
        if refused_state is None and body.streaming:
            head["object"] = kind.chunk_object
            usage = _StreamUsage(body.choices, body.include_usage, body.include_usage and body.continuous_usage)
            return SseResponse(_ChoiceEvents(tm, kind, states, head, usage), tm.call_after_frame)
        # Sequentially: they all run at once in the scheduler, and one disconnect watcher at
        # a time reads the ASGI receive channel.
        for state in states if refused_state is None else ():
            await wait_finished(tm, state, request)
    except ClientGone:
        abort_unfinished(tm, states)
        return Response(status_code=499)
    for state in states:
        refused = refusal(state)
        if refused is not None:
            return refused
    ids_out = tm.tokenizer is None
    text_of = openai_token_text(tm.token_texts)
    choices = [_with_ids(kind.choice(i, s, text_of), s.output_ids, ids_out) for i, s in enumerate(states)]
    return JSONResponse({**head, "choices": choices, "usage": _usage(states, body.choices)})


@dataclass(frozen=True, slots=True)
class _StreamUsage:
    """What a stream says of usage. ``include_usage`` (OpenAI): every chunk carries
    ``"usage": null`` and a last chunk carries the whole request's usage. ``continuous``
    (vLLM's ``continuous_usage_stats``, which as in vLLM takes ``include_usage`` too): each
    chunk carries its choice's usage so far instead of null."""

    n: int  # choices per prompt
    include_usage: bool
    continuous: bool

    def on_chunk(self, stats: RequestOutputStats | None, completion_tokens: int) -> dict[str, Any]:
        """``stats`` and ``completion_tokens``: the choice's as of this chunk."""
        if self.continuous:
            return {"usage": _choice_usage(stats, completion_tokens)}
        return {"usage": None} if self.include_usage else {}


def _choice_usage(stats: RequestOutputStats | None, completion_tokens: int) -> dict[str, Any]:
    """One choice's usage after ``completion_tokens`` tokens. A streaming choice has its
    stats from its first output on, and the stream starts after every first output."""
    assert stats is not None, "a stream starts once every choice has its first output"
    prompt = stats.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": min(prompt, stats.cached_tokens)},
    }


class _ChoiceEvents:
    """A completions or chat stream's events (an ``EventSource``). A content chunk with
    nothing but text and usage (no finish, logprobs, echo or ids) is the choice's template
    filled with the text (and with ``continuous`` usage, its counts: one template per
    choice and stats, which change at a few points of a request only); every other chunk
    is encoded whole."""

    def __init__(self, tm: TokenizerManager, kind: _Completion | _Chat, states: list[ReqState], head: dict[str, Any], usage: _StreamUsage) -> None:
        self.states = states
        self.ended = False
        self._tm = tm
        self._kind = kind
        self._head = head
        self._usage = usage
        self._ids_out = tm.tokenizer is None  # --skip-tokenizer-init: the ids are the output
        self._text_of = openai_token_text(tm.token_texts)
        self._offsets = [0] * len(states)  # each choice's text offset so far (completions' logprobs)
        self._leading = [True] * len(states)  # a choice's first chunk: an echo goes on it
        # Per choice: the stats its template was made for (continuous usage), and the template.
        self._templates: list[tuple[RequestOutputStats | None, EventTemplate | None] | None] = [None] * len(states)
        # Every content chunk before a choice's finish is its template filled in.
        self._plain = not self._ids_out and all(s.logprob is None and not s.echo for s in states)

    def opening(self) -> bytes:
        head, usage = self._head, self._usage
        out = b""
        for index, state in enumerate(self.states):
            opening = self._kind.opening(index)
            if opening is not None:
                out += sse({**head, "choices": [opening], **usage.on_chunk(state.request_stats, 0)})
        return out

    def events(self, index: int) -> bytes:
        state = self.states[index]
        if self._plain and not state.finished:
            chunks = state.take_pending()
            out = []
            for chunk in chunks:
                template = self._template(index, chunk.stats)
                if template is None:
                    state.pending[:0] = chunks  # a hole's marker in the model name: encoded whole below
                    break
                if chunk.text:  # ids that decode to no text yet are nothing to show
                    out.append(self._filled(template, chunk))
            else:
                return b"".join(out)
        refused = refusal(state) if state.finished else None
        if refused is not None:
            self.ended = True
            return b"data: " + bytes(refused.body) + b"\n\n"
        kind, text_of, ids_out = self._kind, self._text_of, self._ids_out
        # Finished or not as taken: what comes while these events are sent is the next take's.
        chunks, finish_reason = state.take_pending(), _finish_reason(state)
        stop_reason = _stop_reason(state)
        out = []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1  # the finish goes on the last event only
            final = finish_reason if last else None
            # Ids that decode to no text yet are nothing to show, unless the ids are the output.
            if not (chunk.text or final is not None or (ids_out and chunk.ids) or (state.logprob is not None and chunk.ids)):
                continue
            lead = self._leading[index]
            self._leading[index] = False
            template = self._template(index, chunk.stats) if self._plain and final is None else None
            if template is not None:
                out.append(self._filled(template, chunk))
                continue
            text = kind.echoed_text(state, text_of) + chunk.text if lead else chunk.text
            logprobs = None
            if state.logprob is not None:
                logprobs = kind.chunk_logprobs(chunk, text_of, self._offsets[index], state if lead else None)
                self._offsets[index] += sum(len(text_of(t)) for t in (state.prompt_ids if lead and state.echo else []) + chunk.ids)
            delta = _with_ids(kind.delta(index, text, final, stop_reason if last else None, logprobs), chunk.ids, ids_out)
            out.append(sse({**self._head, "choices": [delta], **self._usage.on_chunk(chunk.stats, chunk.completion_tokens)}))
        return b"".join(out)

    def _template(self, index: int, stats: RequestOutputStats | None) -> EventTemplate | None:
        """Choice ``index``'s content-chunk template for chunks with ``stats`` (continuous
        usage; any stats otherwise); None: the model name holds a hole's marker, and such
        chunks are encoded whole."""
        made = self._templates[index]
        continuous = self._usage.continuous
        if made is not None and (not continuous or made[0] is stats):
            return made[1]
        if continuous:
            assert stats is not None, "a stream starts once every choice has its first output"
            prompt = stats.prompt_tokens
            # _choice_usage's keys, in its order, with the counts as holes.
            usage: dict[str, Any] = {"usage": {
                "prompt_tokens": prompt,
                "completion_tokens": _COMPLETION_TOKENS,
                "total_tokens": _TOTAL_TOKENS,
                "prompt_tokens_details": {"cached_tokens": min(prompt, stats.cached_tokens)},
            }}  # fmt: skip
        else:
            usage = self._usage.on_chunk(None, 0)  # the same for every chunk: {"usage": null} or nothing
        payload = {**self._head, "choices": [self._kind.delta(index, _TEXT, None, None)], **usage}
        try:
            template = EventTemplate(payload)
        except TemplateError:
            template = None
        self._templates[index] = (stats, template)
        return template

    def _filled(self, template: EventTemplate, chunk: StreamChunk) -> bytes:
        """A content chunk from its template (``_template`` made for the chunk's stats)."""
        if self._usage.continuous:
            assert chunk.stats is not None, "a stream starts once every choice has its first output"
            count = chunk.completion_tokens
            return template.fill(chunk.text, count, chunk.stats.prompt_tokens + count)
        return template.fill(chunk.text)

    def closing(self) -> bytes:
        if not self._usage.include_usage or self.ended:
            return _DONE
        return sse({**self._head, "choices": [], "usage": _usage(self.states, self._usage.n)}) + _DONE

    def close(self) -> None:
        # A disconnect ends the stream early: stop every choice still running.
        abort_unfinished(self._tm, self.states)


_TEXT = Hole()
_COMPLETION_TOKENS = Hole()
_TOTAL_TOKENS = Hole()
