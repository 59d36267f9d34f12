"""The tokenizer endpoints: vLLM's ``POST /tokenize`` and ``POST /detokenize``, and SGLang's
``POST /v1/tokenize`` and ``POST /v1/detokenize`` (each peer serves both paths; here all four
take both peers' requests and answer both peers' keys).

Neither touches the scheduler: they answer from the API process's own tokenizer. Under
``--skip-tokenizer-init`` there is none, and both answer 400 saying so. They are the OpenAI
dialect's (both peers serve them from their OpenAI servers): the chat form renders a chat
request's prompt with the chat route's messages and tools.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from msgspec import Meta

from pipeline.tokenizer_loader import LoadedTokenizer
from tokenizer_proc.request_edge.body import decode_body
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.fields import TokenId
from tokenizer_proc.request_edge.known_fields import Refusal, declare, neutral, refuse
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateUnavailable
from tokenizer_proc.http.common import error_response
from tokenizer_proc.http.ignored_fields import ignored_fields
from tokenizer_proc.openai.chat_prompt import generation_prompt, render_chat_prompt
from tokenizer_proc.openai.tools import ChatTool, plan_tools
from tokenizer_proc.request_edge.chat_messages import Message, refuse_custom_roles
from tokenizer_proc.request_checks import without_tokenizer
from tokenizer_proc.tokenizer_manager import TokenizerManager


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's completion and chat forms in one struct (msgspec decodes no untagged union of
    objects); ``check_form`` refuses a mix of the two. None means "not given". The chat form
    takes the fields of vLLM's ``TokenizeChatRequest`` that shape the prompt, with the chat
    route's meanings, so its ids are the ones the same chat request runs."""

    model: str | None = None
    prompt: str | list[str] | None = None  # a list: SGLang's batch
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    # vLLM's, for what the chat route takes only at their neutral value too.
    _REFUSED: ClassVar[tuple[Refusal, ...]] = (
        neutral("chat_template"),
        neutral("media_io_kwargs"),
        neutral("mm_processor_kwargs"),
    )
    _CHAT_ONLY: ClassVar[tuple[str, ...]] = (
        "add_generation_prompt",
        "continue_final_message",
        "tools",
        "chat_template_kwargs",
    )

    def check_form(self) -> None:
        refuse(self, self._REFUSED)
        if (self.prompt is None) == (self.messages is None):
            raise RequestValidationError("give exactly one of `prompt` and `messages`", "prompt")
        for name in self._CHAT_ONLY if self.prompt is not None else ():
            if getattr(self, name) is not None:
                raise RequestValidationError(f"{name} goes with `messages`, not `prompt`", name)
        generation_prompt(self.add_generation_prompt, self.continue_final_message)  # chat's rule


TokenizeBody = declare(TokenizeRequest, TokenizeRequest._REFUSED)


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # ids, or SGLang's lists of ids (msgspec takes one array type per union)
    tokens: list[TokenId | list[TokenId]]
    model: str | None = None
    skip_special_tokens: bool | None = None  # SGLang's; None: the path's default

    def batches(self) -> tuple[list[list[int]], bool]:
        """The lists of ids to decode, and whether the request gave a list of them."""
        flat = [t for t in self.tokens if isinstance(t, int)]
        if len(flat) == len(self.tokens):
            return [flat], False
        if flat:
            raise RequestValidationError(
                "give `tokens` as token ids or as lists of token ids, not a mix", "tokens"
            )
        return [t for t in self.tokens if isinstance(t, list)], True


TokenizerTools = tuple[LoadedTokenizer, ChatTemplate]


def build_tokenize_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    # None under --skip-tokenizer-init: nothing to tokenize with.
    tools = (
        (tm.tokenizer, ChatTemplate.for_tokenizer(tm.tokenizer))
        if tm.tokenizer is not None
        else None
    )

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(request: Request) -> Response:
        return await answer_tokenize(tm, tools, request)

    @router.post("/detokenize")
    async def detokenize_vllm(request: Request) -> Response:
        return await answer_detokenize(tm, request, skip_special_default=False)  # vLLM's: shown

    @router.post("/v1/detokenize")
    async def detokenize_sglang(request: Request) -> Response:
        return await answer_detokenize(tm, request, skip_special_default=True)  # SGLang's default

    return router


async def answer_tokenize(
    tm: TokenizerManager, tools: TokenizerTools | None, request: Request
) -> Response:
    """``POST /tokenize``: takes a ``prompt`` (``add_special_tokens`` defaults to true, as in
    vLLM and SGLang: the tokenizer's post-processor BOS/EOS, if it has one), SGLang's list of
    prompts (then ``tokens``, ``count`` and ``token_strs`` are lists, one per prompt), or chat
    ``messages`` rendered through the same chat template as ``/v1/chat/completions``, with
    vLLM's ``add_generation_prompt``, ``continue_final_message``, ``tools`` and
    ``chat_template_kwargs`` (``add_special_tokens`` defaults to false there, so the ids are
    exactly the prompt the same chat request runs). It answers ``{"count", "max_model_len",
    "tokens", "token_strs"}``, ``token_strs`` null unless ``return_token_strs`` (vLLM's
    model, whose optional field is always in its answer)."""
    body: TokenizeRequest = decode_body(await request.body(), TokenizeBody, ignored_fields(request))
    if tm.config.reject_unknown_fields and body.messages is not None:
        refuse_custom_roles(body.messages)
    body.check_form()
    tm.loras.resolve(body.model)  # an adapter tokenizes as its model; an unknown model: 404
    if tools is None:
        raise without_tokenizer(
            "/tokenize has nothing to encode text with",
            "prompt" if body.prompt is not None else "messages",
        )
    tokenizer, template = tools
    if isinstance(body.prompt, list):
        batch = [_prompt_tokens(tokenizer, p, body.add_special_tokens) for p in body.prompt]
        strs = [_token_strs(tokenizer, ids) for ids in batch] if body.return_token_strs else None
        return JSONResponse(
            {
                "count": [len(ids) for ids in batch],
                "max_model_len": tm.context_length,
                "tokens": batch,
                "token_strs": strs,
            }
        )
    try:
        ids = _tokens(tokenizer, template, body)
    except ChatTemplateUnavailable as exc:
        return error_response(500, str(exc), err_type="internal_error")
    token_strs = _token_strs(tokenizer, ids) if body.return_token_strs else None
    return JSONResponse(
        {
            "count": len(ids),
            "max_model_len": tm.context_length,
            "tokens": ids,
            "token_strs": token_strs,
        }
    )


async def answer_detokenize(
    tm: TokenizerManager, request: Request, skip_special_default: bool
) -> Response:
    """``POST /detokenize``: takes ``tokens`` (SGLang's list of lists too: one text per list)
    and SGLang's ``skip_special_tokens``, and answers ``{"prompt", "text"}`` (vLLM's key and
    SGLang's, the same text). Its default differs by path as between the peers: vLLM's
    ``/detokenize`` keeps special tokens, SGLang's ``/v1/detokenize`` skips them."""
    body: DetokenizeRequest = decode_body(
        await request.body(), DetokenizeRequest, ignored_fields(request)
    )
    tm.loras.resolve(body.model)  # an adapter decodes as its model; an unknown model: 404
    tokenizer = tm.checks.require_tokenizer(
        "/detokenize has nothing to decode token ids with", "tokens"
    )
    batches, listed = body.batches()
    vocab = tokenizer.vocab_size
    for b, ids in enumerate(batches):
        for i, token in enumerate(ids):
            if token >= vocab:
                where = f"tokens[{b}][{i}]" if listed else f"tokens[{i}]"
                raise RequestValidationError(
                    f"{where} is {token}, not below the vocabulary size {vocab}", where
                )
    skip = skip_special_default if body.skip_special_tokens is None else body.skip_special_tokens
    texts = [tokenizer.decode(ids, skip_special_tokens=skip) for ids in batches]
    text: str | list[str] = texts if listed else texts[0]
    return JSONResponse({"prompt": text, "text": text})


def _prompt_tokens(
    tokenizer: LoadedTokenizer, prompt: str, add_special_tokens: bool | None
) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)


def _token_strs(tokenizer: LoadedTokenizer, ids: list[int]) -> list[str | None]:
    """Each id's vocabulary entry (vLLM's ``token_strs``: ``convert_ids_to_tokens``)."""
    return [tokenizer.tokenizer.id_to_token(i) for i in ids]


def _tokens(tokenizer: LoadedTokenizer, template: ChatTemplate, body: TokenizeRequest) -> list[int]:
    if isinstance(body.prompt, str):
        return _prompt_tokens(tokenizer, body.prompt, body.add_special_tokens)
    assert body.messages is not None
    return tokenizer.encode(
        _chat_prompt(template, body), add_special_tokens=bool(body.add_special_tokens)
    )


def _chat_prompt(template: ChatTemplate, body: TokenizeRequest) -> str:
    """The prompt text the chat route renders for the same messages and fields
    (``tokenizer_proc.openai.jobs.prepare_chat``): the same template arguments, the tools as
    the chat route's tool plan hands them over, the same refusals under the same names."""
    assert body.messages is not None
    messages = [m.to_template(i) for i, m in enumerate(body.messages)]
    plan = plan_tools(body.tools, None, None)
    return render_chat_prompt(
        template,
        messages,
        tools=plan.template_tools if plan is not None else None,
        add_generation_prompt=body.add_generation_prompt,
        kwargs=body.chat_template_kwargs,
        continue_final_message=body.continue_final_message,
    )
