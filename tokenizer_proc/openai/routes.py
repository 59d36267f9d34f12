"""The OpenAI-compatible text generation API: ``POST /v1/completions``,
``POST /v1/chat/completions``, ``GET /v1/models`` and ``GET /v1/models/{model}`` (whose
answers also carry Anthropic's keys, for its SDK's ``models.list`` and ``models.retrieve``).

Each choice is its own pipeline request (``n`` choices of ``p`` prompts are ``n * p``
requests, submitted together so they batch; ``_respond`` waits for them). What a response
says (its choices, ``usage``, ``finish_reason``) is ``tokenizer_proc.openai.shapes``'; a
stream's events are ``tokenizer_proc.openai.stream``'s. A structured output (any dialect:
``tokenizer_proc.request_edge.constraints``) is one ``Constraint`` that every choice carries;
whether it compiles is the scheduler's 400.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pipeline.control_frames import LoraAdapter
from pipeline.io_struct import Constraint, LoraRef
from pipeline.tokenizer_loader import model_directory
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.chat_messages import refuse_custom_roles
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateUnavailable
from tokenizer_proc.http.common import (
    ClientGone,
    abort_unfinished,
    constraint_refusal,
    error_response,
    model_not_found,
    not_ready,
    wait_finished,
    wait_started,
)
from tokenizer_proc.openai.chat_parsing import ChatParsing
from tokenizer_proc.openai.chat_answers import parse_choice
from tokenizer_proc.openai.jobs import (
    Job,
    choice_jobs,
    openai_names,
    prepare_chat,
    room_left,
    submit_jobs,
)
from tokenizer_proc.openai.logprobs import openai_token_text
from tokenizer_proc.openai.vllm_extras import truncate_prompt
from tokenizer_proc.openai.sampling_request import MAX_CHOICES, SamplingRequest
from tokenizer_proc.openai.schema import (
    ChatCompletionBody,
    ChatCompletionRequest,
    CompletionBody,
    CompletionRequest,
)
from tokenizer_proc.openai.shapes import CHAT, COMPLETION, Shape, request_usage, with_ids
from tokenizer_proc.openai.stream import ChoiceEvents, StreamUsage
from tokenizer_proc.req_state import ReqState
from tokenizer_proc.request_checks import without_tokenizer
from tokenizer_proc.http.request_id_header import answered_id, caller_request_id
from tokenizer_proc.http.sse_stream import SseResponse
from tokenizer_proc.http.ignored_fields import ignored_fields
from tokenizer_proc.tokenizer_manager import TokenizerManager


def build_openai_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    template = ChatTemplate.for_tokenizer(tm.tokenizer) if tm.tokenizer is not None else None
    card = _model_card(tm)

    @router.get("/v1/models")
    async def list_models() -> Response:
        if not tm.ready:
            return not_ready()
        # The served model, then each adapter served on it, as vLLM lists them.
        cards = [card, *(_adapter_card(card, adapter) for adapter in tm.loras.adapters)]
        # Anthropic's page keys beside OpenAI's: one page, always the whole list.
        page = {"has_more": False, "first_id": card["id"], "last_id": cards[-1]["id"]}
        return JSONResponse({"object": "list", "data": cards, **page})

    # The names the served model answers to here: the served name, and the model's path as
    # --model-path gave it and as its directory (`root`), which a vLLM or SGLang user names
    # it by (their served name defaults to that path). Each answers the one card, whose id is
    # the served name: the name requests must use.
    known_as = {tm.model_name, card["root"], *filter(None, [tm.config.model_path])}

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> Response:
        if model in known_as:
            return JSONResponse(card)
        adapter = tm.loras.get(model)
        if adapter is None:
            return model_not_found(model)
        return JSONResponse(_adapter_card(card, adapter))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await answer_completions(tm, request)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await answer_chat(tm, template, request)

    return router


def _model_card(tm: TokenizerManager) -> dict[str, Any]:
    """The served model, as ``GET /v1/models`` lists it: OpenAI's model object and Anthropic's
    ModelInfo in one (each dialect's clients ignore the other's keys). ``created`` is the
    server's start."""
    created = int(time.time())
    return {
        "id": tm.model_name,
        "object": "model",
        "created": created,
        "owned_by": "tokenpipe",
        # vLLM's and SGLang's: the served model's path (its directory here)
        "root": str(model_directory(tm.config.model_path)),
        "parent": None,  # vLLM's: the model an adapter's card is of
        "max_model_len": tm.context_length,  # vLLM's name
        # Anthropic's
        "type": "model",
        "display_name": tm.model_name,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),  # RFC 3339
        "max_input_tokens": tm.context_length,
        "lifecycle": "active",
    }


def _adapter_card(base: dict[str, Any], adapter: LoraAdapter) -> dict[str, Any]:
    """An adapter's card, as vLLM lists one after the base: its name as ``id``, the directory
    it was read from as ``root``, the served model as ``parent``, no ``max_model_len``."""
    return {
        **base,
        "id": adapter.name,
        "root": adapter.path,
        "parent": base["id"],
        "max_model_len": None,
        "display_name": adapter.name,
    }


async def answer_completions(tm: TokenizerManager, request: Request) -> Response:
    """``POST /v1/completions``: every prompt's choices, submitted together. With a ``seed``,
    choice ``i`` of each prompt samples with ``seed + i``: the choices differ, and each prompt
    of a batch gives what it would give alone.

    Under ``--skip-tokenizer-init`` a prompt must be token ids, and each choice (and each
    stream delta) also carries its ``token_ids``, the field SGLang and vLLM answer
    ``return_token_ids`` with; its ``text`` is empty, as vLLM's is without a tokenizer."""
    arrived = time.time()
    body: CompletionRequest = decode_body(
        await request.body(), CompletionBody, ignored_fields(request)
    )
    body.refuse_unsupported()
    lora = tm.loras.resolve(body.model, body.lora_path)  # an unknown model: the 404
    constraint = body.constraint()
    prompts = body.prompts()
    if len(prompts) * body.choices > MAX_CHOICES:
        raise RequestValidationError(
            f"prompts x n is {len(prompts) * body.choices}; at most {MAX_CHOICES}", "n"
        )
    jobs: list[Job] = []
    for prompt in prompts:
        with openai_names("prompt", "max_tokens"):
            jobs.extend(_prompt_jobs(tm, body, prompt))
    return await _respond(
        tm, request, COMPLETION, body, jobs, arrived, ("prompt", "max_tokens"), constraint, lora
    )


def _prompt_jobs(
    tm: TokenizerManager, body: CompletionRequest, prompt: str | list[int]
) -> list[Job]:
    """The choices of one completions prompt: tokenized, truncated as asked, echoed. vLLM's
    extra fields (``prompt_logprobs``, ``return_token_ids``, ``truncate_prompt_tokens``, ...)
    are ``tokenizer_proc.openai.vllm_extras``': the prompt is truncated here (and in
    ``prepare_chat`` for chat), and the answer shows what ``body.extras()`` says."""
    # vLLM's default: a text prompt gets the tokenizer's special tokens (a Llama BOS).
    add_special_tokens = body.add_special_tokens is not False
    if isinstance(prompt, str):
        ids = tm.checks.tokenize(prompt, None, add_special_tokens=add_special_tokens)
    else:
        ids = tm.checks.tokenize(None, prompt, add_special_tokens=add_special_tokens)
    kept = truncate_prompt(
        ids,
        body.truncate_prompt_tokens,
        body.truncation_side,
        tm.context_length,
        body.max_output(),
        "max_tokens",
    )
    # A truncated prompt echoes what is left of it, the tokens its logprobs are of.
    echo = _echo_text(tm, prompt if kept is ids else kept) if body.echo else None
    max_tokens = _completion_max_tokens(tm, body, len(kept))
    return choice_jobs(tm, body, kept, max_tokens, echo)


async def answer_chat(
    tm: TokenizerManager, template: ChatTemplate | None, request: Request
) -> Response:
    """``POST /v1/chat/completions``: the messages rendered by ``template``, then choices.
    Chat needs a tokenizer and a chat template: without them it is refused with a 400."""
    arrived = time.time()
    body: ChatCompletionRequest = decode_body(
        await request.body(), ChatCompletionBody, ignored_fields(request)
    )
    if tm.config.reject_unknown_fields:
        refuse_custom_roles(body.messages)
    body.refuse_unsupported()
    lora = tm.loras.resolve(body.model, body.lora_path)  # an unknown model: the 404
    if template is None:
        raise without_tokenizer(
            "chat needs a tokenizer and a chat template; send token ids to /v1/completions or "
            "/generate",
            "messages",
        )
    try:
        chat = prepare_chat(tm, template, body)
    except ChatTemplateUnavailable as exc:
        return error_response(500, str(exc), err_type="internal_error")
    return await _respond(
        tm, request, CHAT, body, chat.jobs, arrived, chat.names, chat.constraint, lora, chat.parsing
    )


def _completion_max_tokens(tm: TokenizerManager, body: CompletionRequest, prompt_len: int) -> int:
    """OpenAI's default of 16, but as vLLM and OpenAI do, a prompt with less room than that
    is cut at the context ("length") rather than refused."""
    if body.max_tokens is not None:
        return body.max_tokens
    return min(CompletionRequest.DEFAULT_MAX_TOKENS, room_left(tm, prompt_len))


def _echo_text(tm: TokenizerManager, prompt: str | list[int]) -> str:
    """What ``echo`` shows of a prompt: the request's own string, or the decode of its token
    ids as a whole (special tokens shown, as vLLM echoes them). Token by token, a character
    split over tokens would show as U+FFFD in each. Without a tokenizer, nothing, as vLLM's
    text is then."""
    if isinstance(prompt, str):
        return prompt
    return (
        tm.tokenizer.decode(prompt, skip_special_tokens=False) if tm.tokenizer is not None else ""
    )


async def _respond(
    tm: TokenizerManager,
    request: Request,
    kind: Shape,
    body: SamplingRequest,
    jobs: list[Job],
    arrived: float,
    names: tuple[str, str],
    constraint: Constraint | None,
    lora: LoraRef | None,
    parsing: ChatParsing | None = None,
) -> Response:
    """Submits the jobs and answers them, whole or streamed.

    Waiting, disconnect handling and error bodies are ``tokenizer_proc.http.common``'s: a
    client that disconnects aborts every choice of its request. A stream starts (status 200)
    only once every choice has changed once, so a choice the scheduler refuses (400, a full
    waiting queue's 503 with ``Retry-After``, a PD peer's 502/504) makes the whole request
    that error, streaming or not, with the other choices aborted; a refusal after the stream
    started (a PD failure) is an SSE ``error`` event.

    ``names``: the request's prompt and max-tokens fields, for refusals at submission.
    ``constraint``: the structured output every choice follows (None: none). ``lora``: the
    adapter every choice runs with, whose name the answer's ``model`` shows (None: the base
    model). ``parsing``: how a chat answer splits into reasoning, content and tool calls
    (None: all content)."""
    # vLLM's: the caller's X-Request-Id, else a new one, after the shape's prefix.
    base_id = caller_request_id(request) or uuid.uuid4().hex
    answered_id(request, base_id)
    response_id = f"{kind.id_prefix}{base_id}"
    extras = body.extras()
    states = submit_jobs(
        tm,
        request,
        body,
        jobs,
        response_id,
        arrived,
        kind.operation,
        names,
        constraint,
        kind.route,
        lora,
    )
    head = {
        "id": response_id,
        "object": kind.object,
        "created": int(arrived),
        "model": tm.loras.served_name(lora),
    }
    try:
        # Until every choice has started, so one refused choice answers for the request
        # (with the others aborted) before a stream's 200 or a long wait for the others.
        refused_state = await wait_started(tm, states, request)
        if refused_state is None and body.streaming:
            head["object"] = kind.chunk_object
            usage = StreamUsage(
                body.choices, body.include_usage, body.include_usage and body.continuous_usage
            )
            on_stream = tm.metrics.requests.on_sse_stream  # tokenpipe:sse_streams_total
            events = ChoiceEvents(tm, kind, states, head, usage, parsing, extras)
            return SseResponse(events, tm.sockets.call_after_frame, on_stream)
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
    return JSONResponse(_whole_answer(tm, kind, body, states, head, parsing))


def _whole_answer(
    tm: TokenizerManager,
    kind: Shape,
    body: SamplingRequest,
    states: list[ReqState],
    head: dict[str, Any],
    parsing: ChatParsing | None,
) -> dict[str, Any]:
    """The answer of a request whose choices all finished, none refused: ``head``, the
    choices, the usage and the shape's own fields."""
    extras = body.extras()
    ids_out = tm.tokenizer is None
    text_of, texts = openai_token_text(tm.token_texts, extras.token_id_texts), tm.token_texts
    choices = [
        with_ids(kind.choice(i, s, text_of, extras, texts), s.output_ids, ids_out)
        for i, s in enumerate(states)
    ]
    totals = request_usage(states, body.choices)
    if parsing is not None:
        reasoning_tokens = sum(
            parse_choice(tm, parsing, choice, state, extras.role, extras.echo)
            for choice, state in zip(choices, states, strict=True)
        )
        if parsing.reasoning is not None:
            totals["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return {
        **head,
        "choices": choices,
        "usage": totals,
        **kind.response_fields(states, extras, texts),
    }
