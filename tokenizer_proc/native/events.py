"""The events of a /generate stream: one request's (``GenerateEvents``) or a batch's
(``BatchEvents``), each an ``EventSource`` that ``SseResponse`` writes; and
``generate_body``, the shape of an answer and of each event."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

from pipeline.io_struct import RequestOutputStats
from pipeline.token_texts import TokenText
from tokenizer_proc.http.common import refusal
from tokenizer_proc.http.sse_events import EventTemplate, Hole, TemplateError, sse
from tokenizer_proc.native.logprob_meta import logprob_meta, prompt_logprob_meta
from tokenizer_proc.req_state import LogprobEntries, ReqState, StreamChunk
from tokenizer_proc.request_edge.meta_info import build_meta_info
from tokenizer_proc.tokenizer_manager import TokenizerManager


def generate_body(
    tm: TokenizerManager,
    text: str | Hole,
    output_ids: list[int] | Hole,
    meta_info: dict[str, Any],
    index: int | None = None,
) -> dict[str, Any]:
    """A /generate answer or stream event (or its template: Holes for the text and ids).
    Under --skip-tokenizer-init there is no text, and as SGLang does then, the answer has no
    ``text`` key at all, only ``output_ids``. A batch item's stream events carry its
    ``index`` in the batch, as SGLang's do."""
    if tm.tokenizer is None:
        body: dict[str, Any] = {"output_ids": output_ids, "meta_info": meta_info}
    else:
        body = {"text": text, "output_ids": output_ids, "meta_info": meta_info}
    if index is not None:
        body["index"] = index
    return body


class BatchEvents:
    """A /generate batch's stream (an ``EventSource``): each item's events are its own
    ``GenerateEvents``' (with its ``index``), and the stream ends with one ``[DONE]``."""

    def __init__(self, items: list[GenerateEvents]) -> None:
        self._items = items
        self.states = tuple(item.states[0] for item in items)

    @property
    def ended(self) -> bool:
        return any(item.ended for item in self._items)

    def opening(self) -> bytes:
        return b""

    def events(self, index: int) -> bytes:
        return self._items[index].events(0)

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def close(self) -> None:
        for item in self._items:
            item.close()


class GenerateEvents:
    """A /generate stream's events (an ``EventSource``). As SGLang streams them, each event
    carries the whole ``text`` and ``output_ids`` so far, and the output logprob entries of
    those ids; with ``--incremental-streaming-output`` (SGLang's flag) each carries only what
    is new since the previous event. Either way ``meta_info``'s counts are through the event
    and the finish goes on the last. An event before the last is the stream's template for
    its stats, filled with the chunk's text, ids and count: its meta_info depends on nothing
    else.

    The two modes differ only in where the chunks come from (``_take``): the state's own
    pending chunks, each a delta, or those chunks made cumulative by ``_take_cumulative``.
    The incremental path thus does exactly the work it did before the cumulative one
    existed; the cumulative one copies and encodes everything so far per event, bytes
    quadratic in the output's length, as SGLang's default does."""

    def __init__(
        self,
        tm: TokenizerManager,
        state: ReqState,
        text_of: TokenText | None,
        index: int | None = None,
    ) -> None:
        self.states = (state,)
        self._index = index  # a batch item's, on each of its events
        self.ended = False
        self._tm = tm
        self._state = state
        self._text_of = text_of
        incremental = tm.config.incremental_streaming_output
        self._take: Callable[[], list[StreamChunk]] = (
            state.take_pending if incremental else self._take_cumulative
        )
        # The prompt's logprobs go on the first event; on every event when each is the whole
        # answer so far (SGLang lists them on every event).
        self._prompt_logprobs_due = True
        self._every_event_lists_the_prompt = not incremental
        self._stats: RequestOutputStats | None = None  # the stats self._template was built from
        self._template: EventTemplate | None = None
        # The cumulative mode's output so far.
        self._text = ""
        self._ids: list[int] = []
        self._logprobs = LogprobEntries()

    def opening(self) -> bytes:
        return b""

    def events(self, index: int) -> bytes:
        state = self._state
        refused = refusal(state) if state.finished else None
        if refused is not None:
            self.ended = True
            return b"data: " + bytes(refused.body) + b"\n\n"
        chunks, finished = self._take(), state.finished
        if not finished and state.logprob is None:
            fills = [self._interim(chunk) for chunk in chunks]
            if _all_filled(fills):
                return b"".join(fills)
        out = []
        for i, chunk in enumerate(chunks):
            final = finished and i == len(chunks) - 1  # the finish goes on the last event only
            event = self._interim(chunk) if not final and state.logprob is None else None
            if event is not None:
                out.append(event)
                continue
            meta = build_meta_info(state, None if final else chunk)
            if state.logprob is not None:
                meta.update(logprob_meta(state.logprob, chunk.ids, chunk.logprobs, self._text_of))
                if state.logprob.logprob_start_len >= 0 and self._prompt_logprobs_due:
                    meta.update(
                        prompt_logprob_meta(
                            state.logprob, state.prompt_ids, state.prompt_logprobs, self._text_of
                        )
                    )
            self._prompt_logprobs_due = self._every_event_lists_the_prompt
            out.append(sse(generate_body(self._tm, chunk.text, chunk.ids, meta, self._index)))
        return b"".join(out)

    def _take_cumulative(self) -> list[StreamChunk]:
        """The state's pending chunks, each holding the text, ids and output logprob entries
        of the whole output through it (SGLang's default stream). Each chunk gets copies:
        several taken at once are each encoded with what was there at its own row."""
        chunks = self._state.take_pending()
        for chunk in chunks:
            self._text += chunk.text
            self._ids += chunk.ids
            chunk.text, chunk.ids = self._text, self._ids[:]
            if chunk.logprobs is not None:
                self._logprobs.extend(chunk.logprobs)
            if self._state.logprob is not None:
                so_far = self._logprobs
                chunk.logprobs = LogprobEntries(so_far.chosen[:], so_far.top[:], so_far.ids[:])
        return chunks

    def _interim(self, chunk: StreamChunk) -> bytes | None:
        """The event of a chunk before the last, filled into its template (None: no template)."""
        template = self._interim_template(chunk)
        if template is None:
            return None
        if self._tm.tokenizer is None:
            return template.fill(chunk.ids, chunk.completion_tokens)
        return template.fill(chunk.text, chunk.ids, chunk.completion_tokens)

    def _interim_template(self, chunk: StreamChunk) -> EventTemplate | None:
        """The template of an event before the last, for this chunk's stats (None: a rid
        that holds a hole's marker; such events are encoded whole)."""
        if chunk.stats is not self._stats or self._template is None:
            self._stats = chunk.stats
            meta = build_meta_info(self._state, chunk)
            meta["completion_tokens"] = _COUNT
            try:
                self._template = EventTemplate(
                    generate_body(self._tm, _TEXT, _IDS, meta, self._index)
                )
            except TemplateError:
                self._template = None
        return self._template

    def closing(self) -> bytes:
        return b"data: [DONE]\n\n"

    def close(self) -> None:
        # A disconnect (or any other exit before the finish): stop the work.
        if not self._state.finished:
            self._tm.abort(self._state.req_id)


_TEXT, _IDS, _COUNT = Hole(), Hole(), Hole()


def _all_filled(fills: list[bytes | None]) -> TypeGuard[list[bytes]]:
    return None not in fills
