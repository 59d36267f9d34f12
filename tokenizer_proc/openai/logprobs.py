"""OpenAI's logprob shapes (docs/design.md section 11), from a choice's ``LogprobEntries``.

A token's text is its own decoding (special tokens shown); chat's ``bytes`` are the
token's raw bytes, so a character split over tokens (each shown as U+FFFD) can be put back
together. Without a tokenizer (``--skip-tokenizer-init``), and with vLLM's
``return_tokens_as_token_ids``, a text is ``token_id:N`` (``TokenIdText``; the bytes stay the
token's own where a tokenizer knows them). ``top_n`` keeps the first N top entries of each
position: the scheduler may have computed more for the request's prompt logprobs.
"""

from __future__ import annotations

from typing import Any

from pipeline.token_texts import TokenText, TokenTextCache
from tokenizer_proc.req_state import LogprobEntries


class TokenIdText:
    """A token's text as ``token_id:N``: without a tokenizer (--skip-tokenizer-init), or
    asked with ``return_tokens_as_token_ids``. ``raw_of``: where the tokens' own bytes come
    from (None: none known, the text's bytes)."""

    def __init__(self, raw_of: TokenText | None = None) -> None:
        self._raw_of = raw_of

    def __call__(self, token: int) -> str:
        return f"token_id:{token}"

    def raw(self, token: int) -> bytes:
        return self._raw_of.raw(token) if self._raw_of is not None else self(token).encode("ascii")


def openai_token_text(texts: TokenTextCache | None, as_token_ids: bool = False) -> TokenText:
    """``as_token_ids``: vLLM's ``return_tokens_as_token_ids``."""
    if texts is None or as_token_ids:
        return TokenIdText(texts)
    return texts


def completion_logprobs(
    entries: LogprobEntries,
    ids: list[int],
    text_of: TokenText,
    offset: int = 0,
    top_n: int | None = None,
) -> dict[str, Any]:
    """Completions' shape (``logprobs: N``): ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``, each ``top_logprobs`` entry a token -> logprob object of the N most
    likely tokens plus the chosen one (OpenAI: "up to logprobs+1 elements"), ``text_offset``
    each token's character offset in the choice's text. ``offset``: the character offset of
    the first of ``ids`` in the choice's text (a stream chunk continues where the previous one
    ended)."""
    tokens = [text_of(t) for t in ids]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    top = [
        {**{text_of(t): lp for lp, t in entry[:top_n]}, token: chosen}
        for entry, token, chosen in zip(entries.top or [[] for _ in ids], tokens, entries.chosen)
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(entries.chosen),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(
    entries: LogprobEntries, ids: list[int], text_of: TokenText, top_n: int | None = None
) -> dict[str, Any]:
    """Chat's shape (``logprobs: true, top_logprobs: N``): ``{"content": [{"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text_of.raw(token))}

    tops = entries.top or [[] for _ in ids]
    return {
        "content": [
            {**item(token, chosen), "top_logprobs": [item(t, lp) for lp, t in top[:top_n]]}
            for token, chosen, top in zip(ids, entries.chosen, tops)
        ]
    }


def echoed_completion_logprobs(
    prompt_ids: list[int],
    prompt: LogprobEntries,
    entries: LogprobEntries,
    ids: list[int],
    text_of: TokenText,
    top_n: int | None = None,
) -> dict[str, Any]:
    """``echo``: the prompt's tokens first (the first one's logprob and top entry null, as
    OpenAI's), then the completion's, the text offsets running through both."""
    head = completion_logprobs(
        prompt, prompt_ids[1:], text_of, len(text_of(prompt_ids[0])) if prompt_ids else 0, top_n
    )
    tail = completion_logprobs(
        entries, ids, text_of, sum(len(text_of(t)) for t in prompt_ids), top_n
    )
    first: dict[str, Any] = (
        {
            "tokens": [text_of(prompt_ids[0])],
            "token_logprobs": [None],
            "top_logprobs": [None],
            "text_offset": [0],
        }
        if prompt_ids
        else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )
    return {
        key: first[key] + head[key] + tail[key]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    }
