"""The request bodies of the embedding endpoints: OpenAI's ``/v1/embeddings`` and the native
``/encode``."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from tokenizer_proc.request_edge.fields import TokenId

MAX_INPUTS = 256

# msgspec allows one array type per union, so the routes check that a list holds one kind.
EmbeddingInput = str | list[str | TokenId | list[TokenId]]


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None
    # vLLM's: a text input gets the tokenizer's special tokens (a Llama BOS) unless false.
    add_special_tokens: bool = True


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    text: str | list[str] | None = None
    input_ids: list[TokenId | list[TokenId]] | None = None
    rid: str | None = None
