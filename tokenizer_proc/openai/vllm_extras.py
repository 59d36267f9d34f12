"""vLLM's extra request fields on the OpenAI routes (docs/design.md section 6), with vLLM's
semantics: what each asks of a request's prompt, and what it adds to the answer.
``AnswerExtras`` is what one request's answer shows, read once from its body; the shapes
(``tokenizer_proc.openai.shapes``) and the stream (``tokenizer_proc.openai.stream``) take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.io_struct import LogprobParams
from pipeline.token_texts import TokenText
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.req_state import LogprobEntries

MAX_PROMPT_LOGPROBS = 20  # vLLM's default max_logprobs, as top_logprobs

# vLLM's floor for a logprob in JSON (-inf is not JSON).
_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class AnswerExtras:
    """What a request's answer shows beyond its text. ``output_top``: the output logprobs'
    top count (None: no output logprobs); ``prompt_top``: ``prompt_logprobs``' (None: null);
    ``token_id_texts``: ``return_tokens_as_token_ids``; ``token_ids``: ``return_token_ids``;
    ``echo`` and ``role``: a chat answer's leading text and its role.

    - ``prompt_logprobs`` (k, 0..20): the prompt's logprobs (``prompt_logprobs_entries``), on
      each completion choice, at a chat response's top level; never streamed (k > 0 with
      ``stream`` is a 400, as in vLLM). As in vLLM, an ``echo`` without it asks for the
      request's own top count (completions ``logprobs``, chat ``top_logprobs``): a completion
      echoed with logprobs, and any chat echo, list the prompt's logprobs too.
    - ``return_tokens_as_token_ids``: the logprobs' token texts are ``token_id:N``.
    - ``return_token_ids``: ``prompt_token_ids`` and each choice's ``token_ids``; a stream
      sends the prompt's once, on its first chunk (a completion choice's first chunk, a chat
      choice's role chunk), and each chunk's own ``token_ids``.
    - chat ``add_generation_prompt`` (default true) and ``continue_final_message`` (the
      template leaves the last message open, and the model continues it): false makes the
      answer's role the last message's; both true is a 400. ``echo`` puts the last message's
      text in front of the answer's content when its role is the answer's (a stream sends it
      as the chunk after the role chunk).
    """

    output_top: int | None = None
    prompt_top: int | None = None
    token_id_texts: bool = False
    token_ids: bool = False
    echo: str = ""
    role: str = "assistant"

    def logprob_params(self, echo_prompt: bool) -> LogprobParams | None:
        """What the scheduler computes for this answer: the output logprobs, and from
        position 0 the prompt's (with their ranks) when shown (or echoed, ``echo_prompt``),
        with the largest top count any of them shows. Output logprobs come with any ask (the
        wire has no prompt-only ask); the answer shows them only when ``output_top`` is set."""
        prompt = echo_prompt or self.prompt_top is not None
        if self.output_top is None and not prompt:
            return None
        return LogprobParams(
            top_logprobs_num=max(self.output_top or 0, self.prompt_top or 0),
            logprob_start_len=0 if prompt else -1,
            return_text=True,
        )


def check_prompt_logprobs(value: int | None, streaming: bool) -> None:
    """vLLM's rules: at least 0, at most its max_logprobs (-1, the whole vocabulary, is more
    than that), and not streamed unless 0 (a stream has no place for them)."""
    if value is None:
        return
    if value < -1:
        raise RequestValidationError(
            "prompt_logprobs must be a positive value or -1", "prompt_logprobs"
        )
    if streaming and value != 0:
        raise RequestValidationError(
            "prompt_logprobs are not available when stream=True", "prompt_logprobs"
        )
    if value == -1 or value > MAX_PROMPT_LOGPROBS:
        shown = "the vocabulary size" if value == -1 else str(value)
        raise RequestValidationError(
            f"Requested prompt logprobs of {shown}, which is greater than max allowed: "
            f"{MAX_PROMPT_LOGPROBS}",
            "prompt_logprobs",
        )


def check_truncation(value: int | None) -> None:
    if value == 0:
        raise RequestValidationError(
            "truncate_prompt_tokens must be at least 1, or -1 (as much as fits)",
            "truncate_prompt_tokens",
        )


def truncate_prompt(
    ids: list[int],
    keep: int | None,
    side: str | None,
    context_length: int,
    max_output: int,
    max_param: str,
) -> list[int]:
    """``truncate_prompt_tokens`` (k >= 1, or -1 for all the context leaves after the requested
    output) keeps the prompt's last k tokens (``truncation_side`` "right": its first k);
    ``usage.prompt_tokens`` counts what is kept.

    The prompt ``truncate_prompt_tokens`` leaves: its last ``keep`` tokens (its first with
    ``truncation_side`` "right"); -1 keeps what the context leaves after ``max_output``
    (the requested output, 0 when none is). More than that is a 400, as in vLLM."""
    if keep is None:
        return ids
    room = context_length - max_output
    if keep == -1:
        keep = max(room, 1)  # a prompt with no room left gets the context check's error
    elif keep > room:
        raise RequestValidationError(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len - {max_param} = "
            f"{room}. Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    if keep >= len(ids):
        return ids
    return ids[:keep] if side == "right" else ids[-keep:]


def prompt_logprobs_entries(
    prompt_ids: list[int], entries: LogprobEntries, top: int, text_of: TokenText | None
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: null for position 0, then per position the prompt token's
    entry first and the ``top`` most likely tokens' after it, ranked 1 to ``top``. ``text_of``
    None: no tokenizer, the decoded tokens are null. Each entry maps a token id (as a string)
    to ``{"logprob", "rank", "decoded_token"}``.

    The prompt token's ``rank`` is the scheduler's rank column (docs/design/logprobs.md): how
    many of the vocabulary's logprobs are at or above its own, as vLLM counts. A prompt token
    among the ``top`` is listed once, with its place there, as in vLLM (whose top entries
    overwrite its own); the two differ only between tied tokens. A block without ranks (from
    a sender before the column) shows null outside the top."""

    def entry(logprob: float, rank: int | None, token: int) -> dict[str, Any]:
        return {
            "logprob": max(logprob, _FLOOR),
            "rank": rank,
            "decoded_token": text_of(token) if text_of is not None else None,
        }

    out: list[dict[str, Any] | None] = [None] if prompt_ids else []
    tops = entries.top or [[] for _ in entries.chosen]
    ranks: list[int | None] = list(entries.ranks) or [None] * len(entries.chosen)
    for token, chosen, rank, position_top in zip(prompt_ids[1:], entries.chosen, ranks, tops):
        listed = {str(token): entry(chosen, rank, token)}
        for r, (logprob, t) in enumerate(position_top[:top], 1):
            listed[str(t)] = entry(logprob, r, t)
        out.append(listed)
    return out
