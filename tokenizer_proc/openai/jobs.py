"""What the OpenAI routes share between reading a request and waiting on it: one ``Job`` per
choice (``choice_jobs``), a chat request's prompt, constraint and parsing (``prepare_chat``,
which /v1/responses takes too), and the submission of a request's jobs (``submit_jobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
from fastapi import Request

from pipeline.io_struct import Constraint, LoraRef, SamplingParams
from tokenizer_proc.chat_template import ChatTemplate
from tokenizer_proc.http.common import abort_unfinished, trace_context
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.openai.chat_parsing import ChatParsing
from tokenizer_proc.openai.chat_prompt import render_chat_prompt
from tokenizer_proc.openai.sampling_request import SamplingRequest
from tokenizer_proc.openai.schema import ChatCompletionRequest
from tokenizer_proc.openai.vllm_extras import truncate_prompt
from tokenizer_proc.parsers.reasoning import DEFAULT_THINK
from tokenizer_proc.req_state import ChoiceGroup, ReqState
from tokenizer_proc.request_checks import ContextLengthError, OutOfVocabularyError
from tokenizer_proc.request_edge.peer_wording import PeerWordedError
from tokenizer_proc.tokenizer_manager import TokenizerManager

__all__ = [
    "ChatJobs",
    "Job",
    "choice_jobs",
    "openai_names",
    "prepare_chat",
    "room_left",
    "submit_jobs",
]


@dataclass(frozen=True, slots=True)
class Job:
    """One choice's pipeline request: its prompt ids and sampling, and with ``echo`` the
    prompt's text (None without)."""

    ids: list[int]
    sampling: SamplingParams
    echo: str | None


def choice_jobs(
    tm: TokenizerManager, body: SamplingRequest, ids: list[int], max_tokens: int, echo: str | None
) -> list[Job]:
    """One job per choice, validated against the server's limits first so that nothing is
    submitted for a request that will be refused."""
    jobs = [Job(ids, sampling, echo) for sampling in body.sampling(max_tokens)]
    tm.checks.validate_sampling(len(ids), jobs[0].sampling)
    return jobs


@dataclass(frozen=True, slots=True)
class ChatJobs:
    """A chat request made ready to submit: its jobs, the constraint every choice follows
    (None: none), how its answers are read (None: all content), and its prompt and
    max-tokens fields (for refusals at submission)."""

    jobs: list[Job]
    constraint: Constraint | None
    parsing: ChatParsing | None
    names: tuple[str, str]


def prepare_chat(
    tm: TokenizerManager,
    template: ChatTemplate,
    body: ChatCompletionRequest,
    cap_max_tokens: bool = False,
) -> ChatJobs:
    """The tool plan, the constraint, the parsing, the rendered and tokenized prompt, and one
    job per choice. Raises RequestValidationError naming the field at fault, and
    ChatTemplateUnavailable when the template cannot run at all. ``cap_max_tokens``: the
    requested max tokens is a ceiling that the room after the prompt lowers (Anthropic's
    ``max_tokens``), not a number that must fit."""
    plan = body.tool_plan()
    constraint = body.chat_constraint(plan)
    reasoning = tm.config.reasoning_parser
    parsing = (
        ChatParsing(plan, tm.config.tool_call_parser, reasoning, body.enable_thinking())
        if plan or reasoning
        else None
    )
    if constraint is not None and parsing is not None and tm.tokenizer is not None:
        constraint = after_reasoning(constraint, parsing, tm.tokenizer.encode)
    special = tm.tokenizer.is_special_text if tm.tokenizer is not None else None
    if (
        parsing is not None
        and special is not None
        and body.skip_special_tokens is None
        and parsing.keeps_special_tokens(special)
    ):
        # The parser must see its marker where that is a special token (as vLLM does for
        # Mistral's [TOOL_CALLS]); a request that says otherwise is obeyed.
        body.skip_special_tokens = False
    prompt = render_chat_prompt(
        template,
        body.template_messages(),
        tools=plan.template_tools if plan is not None else None,
        add_generation_prompt=body.add_generation_prompt,
        kwargs=body.chat_template_kwargs,
        continue_final_message=body.continue_final_message,
    )
    max_param = body.max_tokens_param()
    with openai_names("messages", max_param):
        # vLLM's default is false: the template writes the BOS itself.
        ids = tm.checks.tokenize(prompt, None, add_special_tokens=bool(body.add_special_tokens))
        requested = body.requested_max_tokens()
        ids = truncate_prompt(
            ids,
            body.truncate_prompt_tokens,
            body.truncation_side,
            tm.context_length,
            requested or 0,
            max_param,
        )
        room = room_left(tm, len(ids))
        max_tokens = min(requested, room) if requested and cap_max_tokens else requested or room
        jobs = choice_jobs(tm, body, ids, max_tokens, None)
    return ChatJobs(jobs, constraint, parsing, ("messages", max_param))


def after_reasoning(
    constraint: Constraint, parsing: ChatParsing, encode: Callable[[str], list[int]]
) -> Constraint:
    """With a reasoning parser on, the constraint applies from the end of the reasoning (the
    token ids of ``</think>``), as vLLM's does: the model thinks freely, then answers in the
    grammar. Not when the request switched thinking off (qwen3's ``enable_thinking: false``:
    the template closes the reasoning in the prompt), nor without a reasoning parser."""
    if not parsing.thinks:
        return constraint
    return msgspec.structs.replace(constraint, reasoning_end=tuple(encode(DEFAULT_THINK.end)))


def submit_jobs(
    tm: TokenizerManager,
    request: Request,
    body: SamplingRequest,
    jobs: list[Job],
    response_id: str,
    arrived: float,
    operation: str,
    names: tuple[str, str],
    constraint: Constraint | None,
    route: str,
    lora: LoraRef | None = None,
) -> list[ReqState]:
    """Submits every job (choice ``i``'s rid is ``{response_id}-{i}``), each with the adapter
    ``lora`` (None: the base model), and returns their states; on any refusal, the ones
    already submitted are aborted and it raises."""
    trace = trace_context(request)
    bootstrap = body.bootstrap()
    if bootstrap is not None and len(jobs) > 1:
        raise RequestValidationError(
            "PD disaggregation takes one completion per request (one bootstrap room): n and the "
            "prompts must make 1",
            "n",
        )
    states: list[ReqState] = []
    logprobs = body.logprob_params()
    try:
        with openai_names(*names):
            for index, job in enumerate(jobs):
                state = tm.submit_generate(
                    input_ids=job.ids,
                    sampling=job.sampling,
                    stream=body.streaming,
                    rid=f"{response_id}-{index}",
                    trace=trace,
                    created_time=arrived,
                    operation=operation,
                    route=route,
                    bootstrap=bootstrap,
                    logprobs=logprobs,
                    constraint=constraint,
                    cache_salt=body.cache_salt,
                    priority=body.priority,
                    lora=lora,
                )
                states.append(state)
                # The prompt as sent: what echo, prompt logprobs and return_token_ids show.
                state.echo, state.prompt_ids = job.echo, job.ids
    except BaseException:
        abort_unfinished(tm, states)
        raise
    # Each prompt's n choices (jobs are prompt-major): vLLM counts them as one request. No
    # choice can have ended yet: outputs are handled on this loop, after this returns.
    if body.choices > 1:
        for first in range(0, len(states), body.choices):
            group = ChoiceGroup(n=body.choices, unfinished=body.choices)
            for state in states[first : first + body.choices]:
                state.choices = group
    return states


def room_left(tm: TokenizerManager, prompt_len: int) -> int:
    """Chat's default max_tokens, as in OpenAI: as many as fit after the prompt (the context,
    the KV pool and --max-new-tokens-limit); at least 1, so a prompt that leaves no room gets
    the length check's error."""
    config = tm.config
    pool_room = config.max_total_tokens - prompt_len
    if config.mode == "dllm":  # the KV pool holds whole blocks
        pool_room -= pool_room % config.dllm_block_size
    return max(1, min(config.max_new_tokens_limit, tm.context_length - prompt_len, pool_room))


@contextmanager
def openai_names(prompt_param: str, max_param: str) -> Iterator[None]:
    """``tm.checks.tokenize`` and ``tm.checks.validate_sampling`` speak the native API's field
    names; an OpenAI client should read its own (``prompt``/``messages``, ``max_tokens``,
    ``stop``). A refusal in the peers' words gets vLLM's first, as vLLM's own routes answer;
    only its detail is renamed, never a phrase a client matches."""

    def rename(message: str) -> str:
        for native, ours in (
            ("sampling_params.max_new_tokens", max_param),
            ("max_new_tokens", max_param),
            ("`text`", f"`{prompt_param}`"),
            ("input_ids", prompt_param),
            ("sampling_params.stop", "stop"),
            ("sampling_params.logit_bias", "logit_bias"),
        ):
            message = message.replace(native, ours)
        return message

    try:
        yield
    except ContextLengthError as exc:
        raise exc.for_route(prompt_param, max_param) from exc
    except OutOfVocabularyError as exc:
        raise exc.for_route(prompt_param) from exc
    except PeerWordedError as exc:
        param = _openai_param(exc, prompt_param, max_param)
        raise exc.reworded("vllm", rename, param) from exc
    except RequestValidationError as exc:
        param = _openai_param(exc, prompt_param, max_param)
        raise RequestValidationError(rename(str(exc)), param) from exc


def _openai_param(exc: RequestValidationError, prompt_param: str, max_param: str) -> str | None:
    return {
        "sampling_params.max_new_tokens": max_param,
        "text": prompt_param,
        "input_ids": prompt_param,
        "sampling_params.stop": "stop",
        "sampling_params.stop_token_ids": "stop_token_ids",
        "sampling_params.logit_bias": "logit_bias",
    }.get(exc.param or "", exc.param)
