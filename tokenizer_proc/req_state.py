"""The tokenizer manager's state for one live request.

``request_stats`` holds the latest ``RequestOutputStats`` the scheduler sent; meta_info,
metrics and span attributes are all built from it.

A streaming request keeps its unread output as pending chunks, one per output row, so a
client that keeps up gets one event per row (benchmark clients time each event: merged
rows would hide inter-token latency). Rows that arrive while the previous events are still
being sent (the client's socket is not writable: the stream waits in the ASGI send,
``sse_stream``) merge into the last chunk, and beyond ``MAX_PENDING_CHUNKS`` every row merges,
so a slow reader costs memory linear in its unread text, never an ever-growing queue.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from pipeline.io_struct import (
    FinishReason,
    LogprobParams,
    LoraRef,
    RequestOutputStats,
    SamplingParams,
    TraceContext,
)
from pipeline.logprob_columns import RowLogprobs

# Beyond this many unread chunks every row merges into the last: a defensive bound for a
# reader that is slow without ever blocking a send (the merge while sending is the usual one).
MAX_PENDING_CHUNKS = 256


@dataclass(slots=True)
class StreamChunk:
    """The text and ids of one stream event, and the completion count and stats through it:
    events sent together (several rows came while the stream generator was away) each show
    the values of their own row, not the newest one."""

    text: str
    ids: list[int]
    completion_tokens: int
    stats: RequestOutputStats | None
    logprobs: LogprobEntries | None = None  # the logprobs of ``ids``, when the request asked


@dataclass
class LogprobEntries:
    """Logprobs, one entry per token: the chosen token's, the top ones ((logprob, id), most
    likely first) and those of the asked ids, in their order; prompt positions' ranks too."""

    chosen: list[float] = field(default_factory=list)
    top: list[list[tuple[float, int]]] = field(default_factory=list)
    ids: list[list[float]] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # empty: none sent (output tokens)

    def extend(self, row: RowLogprobs | LogprobEntries) -> None:
        self.chosen.extend(row.chosen)
        self.top.extend(row.top)
        self.ids.extend(row.ids)
        self.ranks.extend(row.ranks)


@dataclass(slots=True)
class ChoiceGroup:
    """The n choices of one prompt of an OpenAI request, each a pipeline request (and a
    ReqState) of its own. vLLM's per-request figures (``request_params_n``, the longest
    choice's tokens) are the group's, taken when its last choice ends."""

    n: int
    unfinished: int
    longest: int = 0

    def end_choice(self, completion_tokens: int) -> bool:
        """Records a choice that ended; True when it was the group's last."""
        self.longest = max(self.longest, completion_tokens)
        self.unfinished -= 1
        return self.unfinished == 0


@dataclass
class ReqState:
    rid: str
    req_id: int
    stream: bool
    sampling: SamplingParams
    created_time: float  # time.time() when the HTTP request arrived
    logprob: LogprobParams | None = None  # the logprobs asked; None: none
    trace: TraceContext | None = None
    # gen_ai.operation.name: generate, chat, text_completion, embeddings.
    operation: str = "generate"
    route: str | None = None  # the HTTP route it came by (the span's http.route); None: internal
    internal: bool = False  # a health probe: served, but kept out of metrics and traces
    # The structured output's kind (``Constraint.kind``), for the metrics and the span;
    # None: unconstrained.
    constraint_kind: str | None = None
    lora: LoraRef | None = None  # the adapter it runs with; None: the base model
    # The n > 1 choices this one is of; None: a request of its own.
    choices: ChoiceGroup | None = None
    tokenized_time: float | None = None  # when the request left for the scheduler
    prompt_tokens: int = 0  # as sent to the scheduler; /get_load counts them until stats arrive
    request_stats: RequestOutputStats | None = None
    finished_reason: FinishReason | None = None
    completion_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Non-streaming requests accumulate here; streaming ones only keep what is unread.
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: LogprobEntries = field(default_factory=LogprobEntries)  # non-streaming, when asked
    # Prompt logprobs (logprob_start_len >= 0): the prompt's ids and the entries of its
    # positions max(start, 1) on, from the request's first row.
    prompt_ids: list[int] = field(default_factory=list)
    # /v1/completions echo: the prompt's text, which leads the answer (and its tokens'
    # logprobs the answer's logprobs); None without echo.
    echo: str | None = None
    prompt_logprobs: LogprobEntries = field(default_factory=LogprobEntries)
    pending: list[StreamChunk] = field(default_factory=list)
    sending: bool = False  # a stream event is being sent: new rows merge into the last chunk
    embedding: np.ndarray | None = None  # embedding requests: the pooled vector
    # Wall-clock time of each retraction, for the span's retract events.
    retract_times: list[float] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def update_request_stats(self, stats: RequestOutputStats, now: float) -> None:
        previous = self.request_stats
        self.request_stats = stats
        missed = stats.num_retractions - (previous.num_retractions if previous is not None else 0)
        if missed > 0:
            # A retraction re-enters the waiting queue, so its time is the new queue entry
            # time (metrics on); otherwise the best we know is when the news arrived.
            ts = stats.time_stats
            at = (
                ts.wait_queue_entry_time
                if ts is not None and ts.wait_queue_entry_time is not None
                else now
            )
            self.retract_times.extend([at] * missed)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def add_output(
        self,
        text: str,
        ids: list[int],
        completion_tokens: int,
        now: float,
        logprobs: RowLogprobs | None = None,
    ) -> None:
        if ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        self.completion_tokens = completion_tokens
        if self.stream:
            self._queue(text, ids, completion_tokens, logprobs)
        else:
            self.text += text
            self.output_ids.extend(ids)
            if logprobs is not None:
                self.logprobs.extend(logprobs)

    def _queue(
        self, text: str, ids: list[int], completion_tokens: int, logprobs: RowLogprobs | None
    ) -> None:
        if not text and not ids:
            return  # nothing to show: a finish without output gets its event from take_pending
        if self.pending and (self.sending or len(self.pending) >= MAX_PENDING_CHUNKS):
            last = self.pending[-1]
            last.text += text
            last.ids.extend(ids)
            last.completion_tokens = completion_tokens
            last.stats = self.request_stats
        else:
            last = StreamChunk(text, list(ids), completion_tokens, self.request_stats)
            self.pending.append(last)
        if logprobs is not None:
            if last.logprobs is None:
                last.logprobs = LogprobEntries()
            last.logprobs.extend(logprobs)

    def take_pending(self) -> list[StreamChunk]:
        """The unread chunks, oldest first. Once finished there is always at least one: the
        last chunk is the one the finish goes on."""
        chunks, self.pending = self.pending, []
        if not chunks and self.finished:
            chunks.append(StreamChunk("", [], self.completion_tokens, self.request_stats))
        return chunks


def weight_version_of(state: ReqState) -> str | None:
    """The version of the weights that made the request's latest tokens, from its stats."""
    stats = state.request_stats
    return stats.weight_version if stats is not None else None
