"""A completions or chat stream's SSE events: ``ChoiceEvents`` is the ``EventSource`` that
``sse_stream.SseResponse`` sends, and ``StreamUsage`` what its chunks say of usage.

This is the per-event path: a plain content chunk is its choice's ``EventTemplate`` filled
with the text, and only other chunks are built as dicts and encoded whole (the shapes are
``tokenizer_proc.openai.shapes``').
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from pipeline.io_struct import RequestOutputStats
from tokenizer_proc.http.common import abort_unfinished, refusal
from tokenizer_proc.openai.chat_answers import finish_parsed
from tokenizer_proc.openai.chat_parsing import ChatParsing, delta_fields
from tokenizer_proc.openai.logprobs import openai_token_text
from tokenizer_proc.openai.shapes import (
    NO_EXTRAS,
    CompletionShape,
    Shape,
    chat_stream_choice,
    finish_reason_of,
    matched_stop_of,
    request_usage,
    stop_reason_of,
    with_ids,
)
from tokenizer_proc.openai.vllm_extras import AnswerExtras
from tokenizer_proc.req_state import ReqState, StreamChunk
from tokenizer_proc.http.sse_events import EventTemplate, Hole, TemplateError, sse
from tokenizer_proc.tokenizer_manager import TokenizerManager

_DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class StreamUsage:
    """What a stream says of usage. ``include_usage`` (OpenAI): every chunk carries
    ``"usage": null`` and a last chunk carries the whole request's usage. ``continuous``
    (vLLM's ``continuous_usage_stats``, which as in vLLM takes ``include_usage`` too): each
    chunk carries its choice's usage so far instead of null. ``always_keyed``: every chunk
    carries ``"usage": null`` even without ``include_usage`` (SGLang's completions chunks;
    ``ChoiceEvents`` sets it from its shape)."""

    n: int  # choices per prompt
    include_usage: bool
    continuous: bool
    always_keyed: bool = False

    def on_chunk(self, stats: RequestOutputStats | None, completion_tokens: int) -> dict[str, Any]:
        """``stats`` and ``completion_tokens``: the choice's as of this chunk."""
        if self.continuous:
            return {"usage": _choice_usage(stats, completion_tokens)}
        return {"usage": None} if self.include_usage or self.always_keyed else {}


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


class ChoiceEvents:
    """A completions or chat stream's events (an ``EventSource``). A content chunk with
    nothing but text and usage (no finish, logprobs, echo or ids) is the choice's template
    filled with the text (and with ``continuous`` usage, its counts: one template per
    choice and stats, which change at a few points of a request only); every other chunk
    is encoded whole. ``extras``: what vLLM's extra fields add (``vllm_extras``): a chat
    role and echo on the opening chunks, the prompt's ids on each choice's first chunk, each
    chunk's ids."""

    def __init__(
        self,
        tm: TokenizerManager,
        kind: Shape,
        states: list[ReqState],
        head: dict[str, Any],
        usage: StreamUsage,
        parsing: ChatParsing | None = None,
        extras: AnswerExtras = NO_EXTRAS,
    ) -> None:
        self.states = states
        self.ended = False
        self._tm = tm
        self._kind = kind
        self._head = head
        self._usage = replace(usage, always_keyed=kind.usage_on_every_chunk)
        self._extras = extras
        self._ids_out = tm.tokenizer is None  # --skip-tokenizer-init: the ids are the output
        self._text_of = openai_token_text(tm.token_texts, extras.token_id_texts)
        self._top = extras.output_top  # None: no output logprobs shown
        self._offsets = [0] * len(
            states
        )  # each choice's text offset so far (completions' logprobs)
        self._leading = [True] * len(states)  # a choice's first chunk: an echo goes on it
        # Per choice: the stats its template was made for (continuous usage), and the template.
        self._templates: list[tuple[RequestOutputStats | None, EventTemplate | None] | None] = [
            None
        ] * len(states)
        # Every content chunk before a choice's finish is its template filled in.
        shows_more = (
            self._ids_out
            or extras.token_ids
            or self._top is not None
            or any(s.echo is not None for s in states)
        )
        self._plain = parsing is None and not shows_more
        # A chat answer read for reasoning and tool calls: one splitter per choice, and each
        # choice's reasoning tokens once it has finished.
        self._parsing = parsing
        self._splitters = [parsing.splitter() for _ in states] if parsing is not None else []
        self._reasoning_tokens = [0] * len(states)

    def opening(self) -> bytes:
        """Chat's role chunk of each choice (with vLLM's first-chunk keys: the prompt's ids,
        asked, and text), then each choice's echo chunk (vLLM's chat echo)."""
        head, usage, extras, kind = self._head, self._usage, self._extras, self._kind
        out = b""
        for index, state in enumerate(self.states):
            opening = kind.opening(index, extras.role)
            if opening is not None:
                first = kind.opening_fields(state, extras)
                out += sse(
                    {
                        **head,
                        "choices": [opening],
                        **usage.on_chunk(state.request_stats, 0),
                        **first,
                    }
                )
        for index, state in enumerate(self.states if extras.echo else ()):
            echo = {
                "index": index,
                "delta": {"content": extras.echo, "reasoning_content": None},
                "logprobs": None,
                "finish_reason": None,
                "matched_stop": None,
            }
            out += sse({**head, "choices": [echo], **usage.on_chunk(state.request_stats, 0)})
        return out

    def events(self, index: int) -> bytes:
        state = self.states[index]
        if self._plain and not state.finished:
            chunks = state.take_pending()
            out = []
            for chunk in chunks:
                template = self._template(index, chunk.stats)
                if template is None:
                    state.pending[:0] = (
                        chunks  # a hole's marker in the model name: encoded whole below
                    )
                    break
                if chunk.text:  # ids that decode to no text yet are nothing to show
                    out.append(self._filled(template, chunk))
            else:
                return b"".join(out)
        refused = refusal(state) if state.finished else None
        if refused is not None:
            self.ended = True
            return b"data: " + bytes(refused.body) + b"\n\n"
        if self._parsing is not None:
            return self._parsed_events(index, self._parsing, state)
        kind, text_of, ids_out = self._kind, self._text_of, self._ids_out
        # Finished or not as taken: what comes while these events are sent is the next take's.
        chunks, finish_reason = state.take_pending(), finish_reason_of(state)
        stop_reason, matched_stop = stop_reason_of(state), matched_stop_of(state)
        out = []
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1  # the finish goes on the last event only
            final = finish_reason if last else None
            # Ids that decode to no text yet are nothing to show, unless ids or logprobs are shown.
            shows_ids = ids_out or self._top is not None or self._extras.token_ids
            if not (chunk.text or final is not None or (shows_ids and chunk.ids)):
                continue
            lead = self._leading[index]
            self._leading[index] = False
            template = self._template(index, chunk.stats) if self._plain and final is None else None
            if template is not None:
                out.append(self._filled(template, chunk))
                continue
            text = kind.echoed_text(state, self._extras) + chunk.text if lead else chunk.text
            logprobs = None
            if self._top is not None:
                logprobs = kind.chunk_logprobs(
                    chunk, text_of, self._offsets[index], state if lead else None, self._top
                )
                echoed = state.prompt_ids if lead and state.echo is not None else []
                self._offsets[index] += sum(len(text_of(t)) for t in echoed + chunk.ids)
            delta = with_ids(
                kind.delta(
                    index, text, final, stop_reason if last else None, logprobs, matched_stop
                ),
                chunk.ids,
                ids_out,
            )
            self._add_ids(delta, state, chunk, lead)
            out.append(
                sse(
                    {
                        **self._head,
                        "choices": [delta],
                        **self._usage.on_chunk(chunk.stats, chunk.completion_tokens),
                    }
                )
            )
        return b"".join(out)

    def _parsed_events(self, index: int, parsing: ChatParsing, state: ReqState) -> bytes:
        """A chat choice whose text the splitter reads: each chunk's reasoning, content and
        call deltas (a chunk with none of them and no logprobs is not sent); the finish, with
        whatever the splitter held back, on the last."""
        splitter = self._splitters[index]
        chunks, reason = state.take_pending(), finish_reason_of(state)
        stop_reason = stop_reason_of(state)
        out = []
        for i, chunk in enumerate(chunks):
            delta = splitter.feed(chunk.text, chunk.ids)
            final = None
            if i == len(chunks) - 1 and reason is not None:
                delta += splitter.finish()
                final, self._reasoning_tokens[index] = finish_parsed(
                    self._tm, parsing, splitter, state, reason
                )
            logprobs = (
                self._kind.chunk_logprobs(chunk, self._text_of, 0, top=self._top)
                if self._top is not None and chunk.ids
                else None
            )
            if (
                delta.empty
                and final is None
                and logprobs is None
                and not (self._extras.token_ids and chunk.ids)
            ):
                continue
            choice = chat_stream_choice(
                index,
                delta_fields(delta),
                final,
                stop_reason if final is not None else None,
                logprobs,
                matched_stop_of(state),
            )
            self._add_ids(choice, state, chunk, lead=False)
            out.append(
                sse(
                    {
                        **self._head,
                        "choices": [choice],
                        **self._usage.on_chunk(chunk.stats, chunk.completion_tokens),
                    }
                )
            )
        return b"".join(out)

    def _add_ids(
        self, choice: dict[str, Any], state: ReqState, chunk: StreamChunk, lead: bool
    ) -> None:
        """``return_token_ids``: a chunk's own ids, and on a completion choice's first chunk
        the prompt's before them (vLLM's order; chat sends the prompt's on its role chunk)."""
        if not self._extras.token_ids:
            return
        if lead and isinstance(self._kind, CompletionShape):
            choice["prompt_token_ids"] = state.prompt_ids
        choice["token_ids"] = chunk.ids

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
            usage = self._usage.on_chunk(
                None, 0
            )  # the same for every chunk: {"usage": null} or nothing
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
        usage = request_usage(self.states, self._usage.n)
        if self._parsing is not None and self._parsing.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(self._reasoning_tokens)}
        return sse({**self._head, "choices": [], "usage": usage}) + _DONE

    def close(self) -> None:
        # A disconnect ends the stream early: stop every choice still running.
        abort_unfinished(self._tm, self.states)


_TEXT = Hole()
_COMPLETION_TOKENS = Hole()
_TOTAL_TOKENS = Hole()
