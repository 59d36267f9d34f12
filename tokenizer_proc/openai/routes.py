"""The OpenAI-compatible text generation API: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{model}``.

Each choice is its own pipeline request (``n`` choices of ``p`` prompts are ``n * p``
requests, submitted together so they batch). With a ``seed``, choice ``i`` of each prompt
samples with ``seed + i``: the choices differ, and each prompt of a batch gives what it would
give alone. What a response says (its choices, ``usage``, ``finish_reason``) is
``tokenizer_proc.openai.shapes``'; a stream's events are ``tokenizer_proc.openai.stream``'s.

Waiting, disconnect handling and error bodies are ``tokenizer_proc.http.common``'s: a client that
disconnects aborts every choice of its request. A stream starts (status 200) only once every
choice has changed once, so a choice the scheduler refuses (400, a full waiting queue's 503
with ``Retry-After``, a PD peer's 502/504) makes the whole request that error, streaming or
not, with the other choices aborted; a refusal after the stream started (a PD failure) is an
SSE ``error`` event.

A structured output (``response_format``, vLLM's ``structured_outputs`` and ``guided_*``,
SGLang's ``json_schema``/``regex``/``ebnf``: ``tokenizer_proc.openai.constraints``) is one
``Constraint`` that every choice carries; whether it compiles is the scheduler's 400.

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

from pipeline.io_struct import Constraint, SamplingParams
from tokenizer_proc.native.schema import RequestValidationError, decode_body
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateUnavailable
from tokenizer_proc.http.common import (
    ClientGone,
    abort_unfinished,
    constraint_refusal,
    error_response,
    model_not_found,
    not_ready,
    trace_context,
    wait_finished,
    wait_started,
)
from tokenizer_proc.openai.chat_parsing import ChatParsing
from tokenizer_proc.openai.chat_answers import parse_choice
from tokenizer_proc.openai.logprobs import openai_token_text
from tokenizer_proc.openai.schema import (
    MAX_CHOICES,
    ChatCompletionBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
    SamplingRequest,
)
from tokenizer_proc.openai.shapes import CHAT, COMPLETION, Shape, request_usage, with_ids
from tokenizer_proc.openai.stream import ChoiceEvents, StreamUsage
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_checks import without_tokenizer
from tokenizer_proc.http.sse_stream import SseResponse
from tokenizer_proc.tokenizer_manager import TokenizerManager


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
    async def list_models() -> Response:
        if not tm.ready:
            return not_ready()
        return JSONResponse({"object": "list", "data": [model_card()]})

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
        constraint = body.constraint()
        prompts = body.prompts()
        if len(prompts) * body.choices > MAX_CHOICES:
            raise RequestValidationError(f"prompts x n is {len(prompts) * body.choices}; at most {MAX_CHOICES}", "n")
        # vLLM's default: a text prompt gets the tokenizer's special tokens (a Llama BOS).
        add_special_tokens = body.add_special_tokens is not False
        jobs: list[_Job] = []
        for prompt in prompts:
            with _openai_names("prompt", "max_tokens"):
                if isinstance(prompt, str):
                    ids = tm.checks.tokenize(prompt, None, add_special_tokens=add_special_tokens)
                else:
                    ids = tm.checks.tokenize(None, prompt, add_special_tokens=add_special_tokens)
                echo = _echo_text(tm, prompt) if body.echo else None
                jobs.extend(_choices(tm, body, ids, _completion_max_tokens(tm, body, len(ids)), echo))
        return await _respond(tm, request, COMPLETION, body, jobs, arrived, ("prompt", "max_tokens"), constraint)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        arrived = time.time()
        body: ChatCompletionRequest = decode_body(await request.body(), ChatCompletionBody)
        body.refuse_unsupported()
        if body.model is not None and body.model != tm.model_name:
            return model_not_found(body.model)
        if template is None:
            raise without_tokenizer("chat needs a tokenizer and a chat template; send token ids to /v1/completions or /generate", "messages")
        plan = body.tool_plan()
        constraint = body.chat_constraint(plan)
        reasoning = tm.config.reasoning_parser
        parsing = ChatParsing(plan, tm.config.tool_call_parser, reasoning, body.enable_thinking()) if plan or reasoning else None
        special = tm.tokenizer.is_special_text if tm.tokenizer is not None else None
        if parsing is not None and special is not None and body.skip_special_tokens is None and parsing.keeps_special_tokens(special):
            # The parser must see its marker where that is a special token (as vLLM does for
            # Mistral's [TOOL_CALLS]); a request that says otherwise is obeyed.
            body.skip_special_tokens = False
        try:
            tools = plan.template_tools if plan is not None else None
            prompt = template.render(body.template_messages(), tools=tools, kwargs=body.chat_template_kwargs)
        except ChatTemplateError as exc:
            raise RequestValidationError(str(exc), "messages") from exc
        except ChatTemplateUnavailable as exc:
            return error_response(500, str(exc), err_type="internal_error")
        max_param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        with _openai_names("messages", max_param):
            # vLLM's default is false: the template writes the BOS itself.
            ids = tm.checks.tokenize(prompt, None, add_special_tokens=bool(body.add_special_tokens))
            max_tokens = body.requested_max_tokens() or _room_left(tm, len(ids))
            jobs = _choices(tm, body, ids, max_tokens, None)
        return await _respond(tm, request, CHAT, body, jobs, arrived, ("messages", max_param), constraint, parsing)

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


@dataclass(frozen=True, slots=True)
class _Job:
    """One choice's pipeline request: its prompt ids and sampling, and with ``echo`` the
    prompt's text (None without)."""

    ids: list[int]
    sampling: SamplingParams
    echo: str | None


def _echo_text(tm: TokenizerManager, prompt: str | list[int]) -> str:
    """What ``echo`` shows of a prompt: the request's own string, or the decode of its token
    ids as a whole (special tokens shown, as vLLM echoes them). Token by token, a character
    split over tokens would show as U+FFFD in each. Without a tokenizer, nothing, as vLLM's
    text is then."""
    if isinstance(prompt, str):
        return prompt
    return tm.tokenizer.decode(prompt, skip_special_tokens=False) if tm.tokenizer is not None else ""


def _choices(tm: TokenizerManager, body: SamplingRequest, ids: list[int], max_tokens: int, echo: str | None) -> list[_Job]:
    """One job per choice, validated against the server's limits first so that nothing is
    submitted for a request that will be refused."""
    jobs = [_Job(ids, sampling, echo) for sampling in body.sampling(max_tokens)]
    tm.checks.validate_sampling(len(ids), jobs[0].sampling)
    return jobs


@contextmanager
def _openai_names(prompt_param: str, max_param: str) -> Iterator[None]:
    """``tm.checks.tokenize`` and ``tm.checks.validate_sampling`` speak the native API's field names; an
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


async def _respond(
    tm: TokenizerManager,
    request: Request,
    kind: Shape,
    body: SamplingRequest,
    jobs: list[_Job],
    arrived: float,
    names: tuple[str, str],
    constraint: Constraint | None,
    parsing: ChatParsing | None = None,
) -> Response:
    """``names``: the request's prompt and max-tokens fields, for refusals at submission.
    ``constraint``: the structured output every choice follows (None: none). ``parsing``: how
    a chat answer splits into reasoning, content and tool calls (None: all content)."""
    response_id = f"{kind.id_prefix}{uuid.uuid4().hex}"
    trace = trace_context(request)
    bootstrap = body.bootstrap()
    if bootstrap is not None and len(jobs) > 1:
        raise RequestValidationError("PD disaggregation takes one completion per request (one bootstrap room): n and the prompts must make 1", "n")
    states: list[ReqState] = []
    try:
        with _openai_names(*names):
            for index, job in enumerate(jobs):
                state = tm.submit_generate(
                    input_ids=job.ids,
                    sampling=job.sampling,
                    stream=body.streaming,
                    rid=f"{response_id}-{index}",
                    trace=trace,
                    created_time=arrived,
                    operation=kind.operation,
                    bootstrap=bootstrap,
                    logprobs=body.logprob_params(),
                    constraint=constraint,
                )
                states.append(state)
                if job.echo is not None:
                    state.echo, state.prompt_ids = job.echo, job.ids
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
            usage = StreamUsage(body.choices, body.include_usage, body.include_usage and body.continuous_usage)
            on_stream = tm.metrics.requests.on_sse_stream if tm.metrics is not None else None  # tokenpipe:sse_streams_total
            events = ChoiceEvents(tm, kind, states, head, usage, parsing)
            return SseResponse(events, tm.call_after_frame, on_stream)
        # Sequentially: they all run at once in the scheduler, and one disconnect watcher at
        # a time reads the ASGI receive channel.
        for state in states if refused_state is None else ():
            await wait_finished(tm, state, request)
    except ClientGone:
        abort_unfinished(tm, states)
        return Response(status_code=499)
    for state in states:
        refused = constraint_refusal(state, constraint)
        if refused is not None:
            return refused
    ids_out = tm.tokenizer is None
    text_of = openai_token_text(tm.token_texts)
    choices = [with_ids(kind.choice(i, s, text_of), s.output_ids, ids_out) for i, s in enumerate(states)]
    totals = request_usage(states, body.choices)
    if parsing is not None:
        reasoning_tokens = sum(parse_choice(tm, parsing, choice, state) for choice, state in zip(choices, states, strict=True))
        if parsing.reasoning is not None:
            totals["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return JSONResponse({**head, "choices": choices, "usage": totals})
