"""What a completions or chat response says, choice by choice: the JSON shape of a whole
choice, of a stream's opening and delta chunks, and of ``usage`` (``CompletionShape`` and
``ChatShape``, with their one instances ``COMPLETION`` and ``CHAT``).

Every key vLLM or SGLang always sends on an object is on that object here, null when it has
no value (docs/api.md, "Keys that are always there"): clients read them as attributes. What
vLLM's extra request fields add (``AnswerExtras``: prompt logprobs, token ids, token-id
texts, a chat echo and role) is placed where vLLM places it
(``tokenizer_proc.openai.vllm_extras``).
"""

from __future__ import annotations

from typing import Any

from pipeline.io_struct import FinishAbort, FinishLength, FinishStop, RequestOutputStats
from pipeline.token_texts import TokenText
from tokenizer_proc.openai.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_completion_logprobs,
)
from tokenizer_proc.openai.vllm_extras import AnswerExtras, prompt_logprobs_entries
from tokenizer_proc.req_state import LogprobEntries, ReqState, StreamChunk, weight_version_of
from tokenizer_proc.http.sse_events import Hole

_FINISH_REASONS = {FinishStop: "stop", FinishLength: "length", FinishAbort: "abort"}

NO_EXTRAS = AnswerExtras()


def response_keys(states: list[ReqState]) -> dict[str, Any]:
    """The top-level keys every whole completions and chat response carries besides
    OpenAI's: vLLM's (null: no service tier, fingerprint, KV or encoder-cache transfer, or
    per-request metrics here) and SGLang's ``metadata``, whose weight version is that of
    the weights that made the last choice's last tokens."""
    return {
        "service_tier": None,
        "system_fingerprint": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
        "metadata": {"weight_version": weight_version_of(states[-1])},
    }


class CompletionShape:
    id_prefix = "cmpl-"
    object = "text_completion"
    route = "/v1/completions"
    operation = "text_completion"  # gen_ai.operation.name
    chunk_object = "text_completion"
    usage_on_every_chunk = True  # SGLang's stream chunks: "usage": null until the last

    @staticmethod
    def choice(
        index: int,
        state: ReqState,
        text_of: TokenText,
        extras: AnswerExtras = NO_EXTRAS,
        texts: TokenText | None = None,
    ) -> dict[str, Any]:
        """``texts``: the tokens' own texts, for prompt logprobs (None: no tokenizer)."""
        top = extras.output_top
        logprobs = None
        if top is not None and state.echo is not None:
            logprobs = echoed_completion_logprobs(
                state.prompt_ids,
                state.prompt_logprobs,
                state.logprobs,
                state.output_ids,
                text_of,
                top,
            )
        elif top is not None:
            logprobs = completion_logprobs(state.logprobs, state.output_ids, text_of, top_n=top)
        asked = extras.token_ids  # vLLM's order: token_ids, prompt_logprobs, prompt_token_ids
        return {
            "index": index,
            "text": CompletionShape.echoed_text(state, extras) + state.text,
            "logprobs": logprobs,
            "finish_reason": finish_reason_of(state),
            "stop_reason": stop_reason_of(state),
            "matched_stop": matched_stop_of(state),
            "token_ids": state.output_ids if asked else None,
            "prompt_logprobs": prompt_logprobs_of(state, extras, texts),
            "prompt_token_ids": state.prompt_ids if asked else None,
            "routed_experts": None,  # vLLM's: no expert routing is returned
        }

    @staticmethod
    def response_fields(
        states: list[ReqState], extras: AnswerExtras, texts: TokenText | None
    ) -> dict[str, Any]:
        return response_keys(states)  # its prompt_logprobs are on its choices

    @staticmethod
    def opening(index: int, role: str = "assistant") -> dict[str, Any] | None:
        return None

    @staticmethod
    def opening_fields(state: ReqState, extras: AnswerExtras) -> dict[str, Any]:
        return {}  # no opening chunk

    @staticmethod
    def delta(
        index: int,
        text: str | Hole,
        finish_reason: str | None,
        stop_reason: int | str | None,
        logprobs: dict[str, Any] | None = None,
        matched_stop: int | str | None = None,
    ) -> dict[str, Any]:
        """``matched_stop`` has its value on the finishing chunk only (``finish_reason`` set);
        ``prompt_token_ids`` and ``token_ids`` are null unless ``return_token_ids`` fills
        them in (``ChoiceEvents``)."""
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
            "matched_stop": matched_stop if finish_reason is not None else None,
            "prompt_token_ids": None,
            "token_ids": None,
        }

    @staticmethod
    def echoed_text(state: ReqState, extras: AnswerExtras = NO_EXTRAS) -> str:
        """The prompt's text, for ``echo`` (nothing otherwise). With ``return_token_ids``
        vLLM echoes no text: the prompt is in ``prompt_token_ids``."""
        return "" if extras.token_ids else state.echo or ""

    @staticmethod
    def chunk_logprobs(
        chunk: StreamChunk,
        text_of: TokenText,
        offset: int,
        state: ReqState | None = None,
        top: int | None = None,
    ) -> dict[str, Any]:
        """``state``: on a choice's first chunk, whose logprobs lead with the echoed prompt's.
        ``top``: the top entries shown per token."""
        entries = chunk.logprobs or LogprobEntries()
        if state is not None and state.echo is not None:
            return echoed_completion_logprobs(
                state.prompt_ids, state.prompt_logprobs, entries, chunk.ids, text_of, top
            )
        return completion_logprobs(entries, chunk.ids, text_of, offset, top)


class ChatShape:
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    route = "/v1/chat/completions"
    operation = "chat"
    chunk_object = "chat.completion.chunk"
    usage_on_every_chunk = False  # neither peer's chat chunks carry "usage": null unasked

    @staticmethod
    def choice(
        index: int,
        state: ReqState,
        text_of: TokenText,
        extras: AnswerExtras = NO_EXTRAS,
        texts: TokenText | None = None,
    ) -> dict[str, Any]:
        top = extras.output_top
        return {
            "index": index,
            "message": chat_message(extras.role, extras.echo + state.text),
            "logprobs": chat_logprobs(state.logprobs, state.output_ids, text_of, top)
            if top is not None
            else None,
            "finish_reason": finish_reason_of(state),
            "stop_reason": stop_reason_of(state),
            "matched_stop": matched_stop_of(state),
            "token_ids": state.output_ids if extras.token_ids else None,
            "routed_experts": None,  # vLLM's: no expert routing is returned
        }

    @staticmethod
    def response_fields(
        states: list[ReqState], extras: AnswerExtras, texts: TokenText | None
    ) -> dict[str, Any]:
        """After ``usage``, as vLLM's: the prompt's logprobs (one prompt for every choice),
        its ids (null unless asked) and its text (null: never returned)."""
        return {
            "prompt_logprobs": prompt_logprobs_of(states[0], extras, texts),
            "prompt_token_ids": states[0].prompt_ids if extras.token_ids else None,
            "prompt_text": None,
            **response_keys(states),
        }

    @staticmethod
    def opening(index: int, role: str = "assistant") -> dict[str, Any] | None:
        """OpenAI's first chunk of each choice names the role."""
        return {
            "index": index,
            "delta": {"role": role, "content": "", "reasoning_content": None},
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "matched_stop": None,
        }

    @staticmethod
    def opening_fields(state: ReqState, extras: AnswerExtras) -> dict[str, Any]:
        """vLLM's top-level keys on each choice's first chunk: the prompt's ids (null unless
        ``return_token_ids``) and its text (null: never returned)."""
        return {
            "prompt_token_ids": state.prompt_ids if extras.token_ids else None,
            "prompt_text": None,
        }

    @staticmethod
    def delta(
        index: int,
        text: str | Hole,
        finish_reason: str | None,
        stop_reason: int | str | None,
        logprobs: dict[str, Any] | None = None,
        matched_stop: int | str | None = None,
    ) -> dict[str, Any]:
        delta = (
            {"content": text, "reasoning_content": None} if text else {"reasoning_content": None}
        )
        return chat_stream_choice(index, delta, finish_reason, stop_reason, logprobs, matched_stop)

    @staticmethod
    def echoed_text(state: ReqState, extras: AnswerExtras = NO_EXTRAS) -> str:
        return ""  # a chat echo is a chunk of its own (ChoiceEvents.opening)

    @staticmethod
    def chunk_logprobs(
        chunk: StreamChunk,
        text_of: TokenText,
        offset: int,
        state: ReqState | None = None,
        top: int | None = None,
    ) -> dict[str, Any]:
        return chat_logprobs(chunk.logprobs or LogprobEntries(), chunk.ids, text_of, top)


COMPLETION = CompletionShape()
CHAT = ChatShape()
Shape = CompletionShape | ChatShape  # what a response is made with


def finish_reason_of(state: ReqState) -> str | None:
    """``FinishStop`` (EOS, a stop token or a stop string) is ``"stop"``, ``FinishLength`` is
    ``"length"``, ``FinishAbort`` (``/abort_request``, shutdown) is ``"abort"``."""
    reason = state.finished_reason
    return None if reason is None else _FINISH_REASONS[type(reason)]


def stop_reason_of(state: ReqState) -> int | str | None:
    """vLLM's ``stop_reason`` (streamed, on the finishing chunk): the stop string or
    ``stop_token_ids`` id that ended the choice, null for EOS and every other finish.
    ``FinishStop.matched`` is a token id both for EOS and for a stop token: only the
    request's own ``stop_token_ids`` make it a stop token (the stop checker tests them first)."""
    reason = state.finished_reason
    if not isinstance(reason, FinishStop):
        return None
    if isinstance(reason.matched, str) or reason.matched in state.sampling.stop_token_ids:
        return reason.matched
    return None


def matched_stop_of(state: ReqState) -> int | str | None:
    """SGLang's ``matched_stop`` (streamed on the finishing chunk only): what ``FinishStop``
    matched (a stop string, or a token id: a ``stop_token_ids`` id or an EOS id alike); null
    for a length or abort finish."""
    reason = state.finished_reason
    return reason.matched if isinstance(reason, FinishStop) else None


def chat_message(
    role: str,
    content: str | None,
    reasoning: str | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A whole chat choice's ``message``: OpenAI's keys with vLLM's (``refusal`` to
    ``function_call``, ``reasoning``) and SGLang's (``reasoning_content``, ``tool_calls``),
    each null when it has no value."""
    return {
        "role": role,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": tool_calls,
        "reasoning_content": reasoning,
        "reasoning": reasoning,
    }


def chat_stream_choice(
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    stop_reason: int | str | None,
    logprobs: dict[str, Any] | None = None,
    matched_stop: int | str | None = None,
) -> dict[str, Any]:
    """A chat stream chunk's choice: ``matched_stop`` (SGLang's) has its value on the
    finishing chunk only; ``token_ids`` (vLLM's) is null unless ``return_token_ids`` fills
    it in. ``delta`` carries ``reasoning_content`` (SGLang's) on every chunk."""
    return {
        "index": index,
        "delta": delta,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "matched_stop": matched_stop if finish_reason is not None else None,
        "token_ids": None,
    }


def prompt_logprobs_of(
    state: ReqState, extras: AnswerExtras, texts: TokenText | None
) -> list[dict[str, Any] | None] | None:
    """A choice's ``prompt_logprobs``: null unless asked."""
    if extras.prompt_top is None:
        return None
    return prompt_logprobs_entries(
        state.prompt_ids, state.prompt_logprobs, extras.prompt_top, texts
    )


def with_ids(choice: dict[str, Any], ids: list[int], ids_out: bool) -> dict[str, Any]:
    """A choice or delta, with its ``token_ids`` when the ids are the output
    (--skip-tokenizer-init)."""
    if ids_out:
        choice["token_ids"] = ids
    return choice


def _finished_stats(state: ReqState) -> RequestOutputStats:
    assert state.request_stats is not None, "a choice has its stats from its first output on"
    return state.request_stats


def request_usage(states: list[ReqState], n: int) -> dict[str, Any]:
    """``usage`` of ``states`` in choice order, ``n`` per prompt, from the pipeline's own
    numbers: ``ReqState.request_stats`` (prompt and cached tokens) and
    ``ReqState.completion_tokens``. As OpenAI does, a prompt is counted once however many
    choices it has: ``prompt_tokens`` sums over prompts, ``completion_tokens`` over every
    choice. A prompt's ``cached_tokens`` is the smallest count among its choices (the copy that
    really computed the prompt; the other copies may have reused its prefix), capped at the
    prompt (in ``--mode dllm`` a request's ``cached_tokens`` also counts its committed
    blocks), so ``cached_tokens <= prompt_tokens`` always holds."""
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
