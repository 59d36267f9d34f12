"""The tokenizer manager's state for one live request.

``request_stats`` holds the latest ``RequestOutputStats`` the scheduler sent; meta_info,
metrics and span attributes are all built from it. Stream deltas that pile up while the
client is slow are merged into one pending delta, so a slow reader costs memory linear in
its unread text, never a queue of events.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np

from pipeline.io_struct import FinishReason, RequestOutputStats, SamplingParams, TraceContext


@dataclass
class ReqState:
    rid: str
    req_id: int
    stream: bool
    sampling: SamplingParams
    created_time: float  # time.time() when the HTTP request arrived
    trace: TraceContext | None = None
    operation: str = "generate"  # gen_ai.operation.name: generate, chat, text_completion, embeddings
    internal: bool = False  # a health probe: served, but kept out of metrics and traces
    tokenized_time: float | None = None  # when the request left for the scheduler
    request_stats: RequestOutputStats | None = None
    finished_reason: FinishReason | None = None
    completion_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Non-streaming requests accumulate here; streaming ones only keep what is unread.
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
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
            at = ts.wait_queue_entry_time if ts is not None and ts.wait_queue_entry_time is not None else now
            self.retract_times.extend([at] * missed)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def add_output(self, text: str, ids: list[int], completion_tokens: int, now: float) -> None:
        if ids:
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
        self.completion_tokens = completion_tokens
        if self.stream:
            self.pending_text += text
            self.pending_ids.extend(ids)
        else:
            self.text += text
            self.output_ids.extend(ids)

    def take_pending(self) -> tuple[str, list[int]]:
        text, ids = self.pending_text, self.pending_ids
        self.pending_text, self.pending_ids = "", []
        return text, ids
