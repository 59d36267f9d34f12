"""vLLM's tokenizer endpoints: ``POST /tokenize`` and ``POST /detokenize``.

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` defaults to true, as in vLLM: the
tokenizer's post-processor BOS/EOS, if it has one) or chat ``messages`` rendered through the
same chat template as ``/v1/chat/completions`` (``add_special_tokens`` defaults to false
there, so the ids are exactly the prompt a chat request would run). It answers
``{"count", "max_model_len", "tokens"}`` (and ``token_strs`` on request). ``/detokenize``
takes ``tokens`` and answers ``{"prompt"}``, special tokens included, as vLLM does.

Neither touches the scheduler: they answer from the API process's own tokenizer. Under
``--skip-tokenizer-init`` there is none, and both answer 400 saying so.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from msgspec import Meta

from pipeline.tokenizer_loader import LoadedTokenizer
from tokenizer_proc.native.schema import RequestValidationError, TokenId, decode_body
from tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError, ChatTemplateUnavailable
from tokenizer_proc.http.common import error_response, model_not_found
from tokenizer_proc.openai.schema import Message
from tokenizer_proc.request_checks import without_tokenizer
from tokenizer_proc.tokenizer_manager import TokenizerManager


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """vLLM's completion and chat forms in one struct (msgspec decodes no untagged union of
    objects); ``check_form`` refuses a mix of the two. None means "not given"."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[Message], Meta(min_length=1)] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def check_form(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestValidationError("give exactly one of `prompt` and `messages`", "prompt")
        if self.prompt is not None and self.add_generation_prompt is not None:
            raise RequestValidationError("add_generation_prompt goes with `messages`, not `prompt`", "add_generation_prompt")


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: list[TokenId]
    model: str | None = None


def build_tokenize_router(tm: TokenizerManager) -> APIRouter:
    router = APIRouter()
    # None under --skip-tokenizer-init: nothing to tokenize with.
    tools = (tm.tokenizer, ChatTemplate.for_tokenizer(tm.tokenizer)) if tm.tokenizer is not None else None

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body: TokenizeRequest = decode_body(await request.body(), TokenizeRequest)
        body.check_form()
        if body.model is not None and body.model != tm.model_name:
            return model_not_found(body.model)
        if tools is None:
            raise without_tokenizer("/tokenize has nothing to encode text with", "prompt" if body.prompt is not None else "messages")
        tokenizer, template = tools
        try:
            ids = _tokens(tokenizer, template, body)
        except ChatTemplateUnavailable as exc:
            return error_response(500, str(exc), err_type="internal_error")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": tm.context_length, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.tokenizer.id_to_token(i) for i in ids]
        return JSONResponse(out)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body: DetokenizeRequest = decode_body(await request.body(), DetokenizeRequest)
        if body.model is not None and body.model != tm.model_name:
            return model_not_found(body.model)
        tokenizer = tm.checks.require_tokenizer("/detokenize has nothing to decode token ids with", "tokens")
        vocab = tokenizer.vocab_size
        for i, token in enumerate(body.tokens):
            if token >= vocab:
                raise RequestValidationError(f"tokens[{i}] is {token}, not below the vocabulary size {vocab}", f"tokens[{i}]")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)})

    return router


def _tokens(tokenizer: LoadedTokenizer, template: ChatTemplate, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special)
    assert body.messages is not None
    messages = [m.to_template(i) for i, m in enumerate(body.messages)]
    try:
        rendered = template.render(messages, add_generation_prompt=body.add_generation_prompt is not False)
    except ChatTemplateError as exc:
        raise RequestValidationError(str(exc), "messages") from exc
    return tokenizer.encode(rendered, add_special_tokens=bool(body.add_special_tokens))
